"""Which OpenMP wait policy should `nanopt train` default to on CPU? Measured, not guessed.

Runs real `python -m nanopt.main` (or torchrun with 2 ranks) processes with OMP_WAIT_POLICY unset
(libgomp's default: spin a while, then sleep), ACTIVE, PASSIVE and libgomp's spin count set lower
(GOMP_SPINCOUNT), alternating, on a quiet machine and
with `--load` busy-looping processes sharing the cores (another job on the machine); at the tiny config's
shape and at nanoGPT's documented CPU shape. Prints median ms/step (each run's median over its steps
after warm-up) and each policy's ratio to the fastest in the same row; on stderr, as it goes, what it measures
and each run's result (the defaults are 80 runs, several minutes).

    python bench/omp_policy.py
    python bench/omp_policy.py --rounds 3 --steps 40 --load 1
    python bench/omp_policy.py --smoke                 # one short run: checks that the bench runs
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import _common as C  # importing _common puts REPO on sys.path: nanopt from this checkout

from nanopt import rundirs  # noqa: E402

POLICIES = ("unset", "ACTIVE", "PASSIVE", "spin:10000", "spin:100000")
SHAPES = {"tiny": [], "nanogpt": C.NANOGPT_SHAPE}  # configs/tiny.yaml as shipped; nanoGPT's CPU shape


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = C.parser(__file__, __doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--load", type=int, default=1, help="busy-looping processes in the 'loaded' condition (0: "
                   "measure the quiet machine only)")
    p.add_argument("--ranks", default="1,2", help="world sizes to measure")
    p.add_argument("--shapes", default="tiny,nanogpt", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="unset | ACTIVE | PASSIVE | spin:N (policy unset, GOMP_SPINCOUNT=N: spin N times, then sleep)")
    p.add_argument("--smoke", action="store_true", help=f"{C.SMOKE_HELP}: one run of 3 steps at nanoGPT's shape, "
                   "one rank, the quiet machine, policy PASSIVE (add --policies to alternate more)")
    a = p.parse_args(argv)
    if a.smoke:
        a.rounds, a.steps, a.load, a.ranks, a.shapes = 1, 3, 0, "1", "nanogpt"
        a.policies = a.policies if a.policies != ",".join(POLICIES) else "PASSIVE"
    unknown = [s for s in a.shapes.split(",") if s not in SHAPES]
    if unknown:
        C.bad_input(__file__, f"--shapes names {', '.join(unknown)}; the shapes are {', '.join(SHAPES)}.")
    return a


def spin() -> None:
    while True:
        pass


# The train command itself, not the CLI, which would fill in its own default when the variable is absent.
LAUNCH = "import sys\nfrom nanopt.commands.train import main\nsys.exit(main(sys.argv[1:]))\n"


def step_ms(a: argparse.Namespace, work: Path, shape: str, policy: str, ranks: int, tag: str) -> float:
    run_dir = work / tag
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    # launch.py lives in the work directory, so `import nanopt` would find an installed copy, not this checkout
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(C.REPO), os.environ.get("PYTHONPATH", "")) if p)
    if policy.startswith("spin:"):
        env["GOMP_SPINCOUNT"] = policy.split(":", 1)[1]
    elif policy != "unset":
        env["OMP_WAIT_POLICY"] = policy
    launch = work / "launch.py"
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"] if ranks > 1
                else [sys.executable])
    cmd = [*launcher, str(launch), "--config", "configs/tiny.yaml", *SHAPES[shape], f"--run.dir={run_dir}",
           f"--train.max_steps={a.steps}", "--log.every=1", "--eval.every=0", "--eval.test_at_end=false",
           "--checkpoint.resume=false", "--log.tensorboard=false", "--log.curves=false", "--sample.num_samples=0",
           "--train.precision=fp32"]
    if ranks > 1 and shape == "nanogpt":  # the same global batch: 2 ranks x 6 sequences
        cmd.append("--train.micro_batch_size=6")
    proc = subprocess.run(cmd, cwd=C.REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rows = rundirs.read_metrics(run_dir)
    return statistics.median(r["step_ms"] for r in rows if "step_ms" in r and r["step"] > min(5, a.steps // 3))


def measure_row(a: argparse.Namespace, work: Path, shape: str, ranks: int, load: int,
                counter: list[int]) -> dict[str, list[float]]:
    """Each policy's ms/step, `a.rounds` runs each, the order rotating each round, with `load` spinners running."""
    policies = a.policies.split(",")
    machine = f"loaded ({load} busy)" if load else "quiet"
    C.progress(f"measuring {shape} shape, {ranks} rank(s), {machine}: {', '.join(policies)} x {a.rounds} round(s)")
    spinners = [mp.Process(target=spin, daemon=True) for _ in range(load)]
    for s in spinners:
        s.start()
    times: dict[str, list[float]] = {p: [] for p in policies}
    try:
        for r in range(a.rounds):
            for policy in policies[r % len(policies):] + policies[: r % len(policies)]:
                t0 = time.perf_counter()
                times[policy].append(step_ms(a, work, shape, policy, ranks, f"{shape}-{ranks}-{load}-{r}-{policy}"))
                counter[0] += 1
                C.progress(f"  [{counter[0]}/{counter[1]}] round {r + 1}: {policy} {times[policy][-1]:.1f} ms/step "
                           f"(run {time.perf_counter() - t0:.0f} s)")
    finally:
        for s in spinners:
            s.terminate()
    return times


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    policies = a.policies.split(",")
    rows = [(shape, ranks, load) for shape in a.shapes.split(",") for ranks in map(int, a.ranks.split(","))
            for load in ((0, a.load) if a.load else (0,))]
    C.banner("OpenMP wait policy for nanopt train on CPU", {
        "load": f"{a.load} busy-looping process(es) when loaded" if a.load else "quiet machine only (--load 0)",
        "runs": f"{len(rows)} rows x {len(policies)} policies x {a.rounds} round(s) = "
                f"{len(rows) * len(policies) * a.rounds} runs of {a.steps} steps"}, C.command(__file__, argv))
    work = Path(tempfile.mkdtemp(prefix="nanopt-omp-"))
    (work / "launch.py").write_text(LAUNCH)
    print("| shape | ranks | machine | " + " | ".join(f"{p} ms/step" for p in policies) + " | best |")
    print("|---|---|---|" + "---|" * (len(policies) + 1), flush=True)
    counter = [0, len(rows) * len(policies) * a.rounds]  # runs done, runs in all
    try:
        for shape, ranks, load in rows:
            times = measure_row(a, work, shape, ranks, load, counter)
            med = {p: statistics.median(t) for p, t in times.items()}
            best = min(med.values())
            cells = " | ".join(f"{med[p]:.1f} ({med[p] / best:.2f}x)" for p in policies)
            print(f"| {shape} | {ranks} | {'loaded' if load else 'quiet'} | {cells} | {min(med, key=med.get)} |",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
