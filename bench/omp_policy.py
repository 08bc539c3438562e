"""Which OpenMP wait policy should `nanopt train` default to on CPU? Measured, not guessed.

Runs real `python -m nanopt.main` (or torchrun with 2 ranks) processes with OMP_WAIT_POLICY unset
(libgomp's default: spin a while, then sleep), ACTIVE, PASSIVE and libgomp's spin count set lower
(GOMP_SPINCOUNT), alternating, on a quiet machine and
with `--load` busy-looping processes sharing the cores (another job on the machine); at the tiny config's
shape and at nanoGPT's documented CPU shape. Prints median ms/step (each run's median over its steps
after warm-up) and each policy's ratio to the fastest in the same row.

    python bench/omp_policy.py
    python bench/omp_policy.py --rounds 3 --steps 40 --load 1
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _common as C  # importing _common puts REPO on sys.path: nanopt from this checkout

from nanopt import rundirs  # noqa: E402

POLICIES = ("unset", "ACTIVE", "PASSIVE", "spin:10000", "spin:100000")
SHAPES = {"tiny": [], "nanogpt": C.NANOGPT_SHAPE}  # configs/tiny.yaml as shipped; nanoGPT's CPU shape


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--load", type=int, default=1, help="busy-looping processes in the 'loaded' condition")
    p.add_argument("--ranks", default="1,2", help="world sizes to measure")
    p.add_argument("--shapes", default="tiny,nanogpt")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="unset | ACTIVE | PASSIVE | spin:N (policy unset, GOMP_SPINCOUNT=N: spin N times, then sleep)")
    return p.parse_args()


def spin() -> None:
    while True:
        pass


# The train command itself, not the CLI, which would fill in its own default when the variable is absent.
LAUNCH = "import sys\nfrom nanopt.commands.train import main\nsys.exit(main(sys.argv[1:]))\n"


def step_ms(a: argparse.Namespace, work: Path, shape: str, policy: str, ranks: int, tag: str) -> float:
    run_dir = work / tag
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy.startswith("spin:"):
        env["GOMP_SPINCOUNT"] = policy.split(":", 1)[1]
    elif policy != "unset":
        env["OMP_WAIT_POLICY"] = policy
    launch = work / "launch.py"
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"] if ranks > 1 else [sys.executable]
    cmd = [*launcher, str(launch), "--config", "configs/tiny.yaml", *SHAPES[shape], f"--run.dir={run_dir}",
           f"--train.max_steps={a.steps}", "--log.every=1", "--eval.every=0", "--eval.test_at_end=false",
           "--checkpoint.resume=false", "--log.tensorboard=false", "--sample.num_samples=0", "--train.precision=fp32"]
    if ranks > 1 and shape == "nanogpt":  # the same global batch: 2 ranks x 6 sequences
        cmd.append("--train.micro_batch_size=6")
    proc = subprocess.run(cmd, cwd=C.REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rows = rundirs.read_metrics(run_dir)
    return statistics.median(r["step_ms"] for r in rows if "step_ms" in r and r["step"] > min(5, a.steps // 3))


def main() -> None:
    a = parse()
    C.banner("OpenMP wait policy for nanopt train on CPU", {"load": f"{a.load} busy-looping process(es) when loaded"})
    work = Path(tempfile.mkdtemp(prefix="nanopt-omp-"))
    (work / "launch.py").write_text(LAUNCH)
    policies = tuple(a.policies.split(","))
    print("| shape | ranks | machine | " + " | ".join(f"{p} ms/step" for p in policies) + " | best |")
    print("|---|---|---|" + "---|" * (len(policies) + 1))
    for shape in a.shapes.split(","):
        for ranks in map(int, a.ranks.split(",")):
            for loaded in (False, True):
                spinners = [mp.Process(target=spin, daemon=True) for _ in range(a.load if loaded else 0)]
                for s in spinners:
                    s.start()
                times: dict[str, list[float]] = {p: [] for p in policies}
                for r in range(a.rounds):
                    order = policies[r % len(policies):] + policies[: r % len(policies)]
                    for policy in order:
                        times[policy].append(step_ms(a, work, shape, policy, ranks, f"{shape}-{ranks}-{loaded}-{policy}-{r}"))
                for s in spinners:
                    s.terminate()
                med = {p: statistics.median(t) for p, t in times.items()}
                best = min(med.values())
                cells = " | ".join(f"{med[p]:.1f} ({med[p] / best:.2f}x)" for p in policies)
                print(f"| {shape} | {ranks} | {'loaded' if loaded else 'quiet'} | {cells} | {min(med, key=med.get)} |",
                      flush=True)


if __name__ == "__main__":
    main()
