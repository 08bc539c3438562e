"""How many tiny-config runs per hour does `nanopt sweep` do on this machine, concurrent vs one after another?

Runs the same real `nanopt sweep` (N seeds of configs/tiny.yaml) with `--parallel 1` (one run at a time
with every core's thread: what a for-loop over `nanopt train` does) and with `--parallel K` (K runs at once,
cores split between them: the sweep's CPU default), alternating, on a quiet machine and with `--load`
busy-looping processes sharing the cores. Wall time covers everything a run costs (start-up, data,
evals, the final sample, curves.png). Prints median runs/hour and the ratio to one-after-another.

    python bench/sweep.py
    python bench/sweep.py --runs 4 --steps 150 --rounds 2 --load 1
    python bench/sweep.py --smoke               # one sweep of two 2-step runs: checks that the bench runs
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import shutil
import time
from pathlib import Path
from typing import Optional

import _common as C


# --smoke's runs: a toy model, and none of what only costs time (the curves, the samples, most of the validation,
# the probe for a GPU); the harness is what a smoke checks.
SMOKE = ["--runtime.device=cpu", "--log.curves=false", "--sample.num_samples=0", "--eval.batches=1",
         "--eval.test_at_end=false", "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2",
         "--model.n_kv_heads=1", "--model.ffn_dim=64", "--train.seq_len=32", "--train.micro_batch_size=2",
         "--train.global_batch_tokens=64"]


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = C.parser(__file__, __doc__)
    p.add_argument("--runs", type=int, default=4, help="runs per sweep (seeds of configs/tiny.yaml)")
    p.add_argument("--steps", type=int, default=150, help="train.max_steps of each run (tiny.yaml: 150)")
    p.add_argument("--rounds", type=int, default=2, help="sweeps per mode and condition, alternating")
    p.add_argument("--parallel", default="1,2", help="--parallel values to compare; the first is the baseline")
    p.add_argument("--load", type=int, default=0, help="also measure with this many busy-looping processes")
    p.add_argument("--smoke", action="store_true", help=f"{C.SMOKE_HELP}: one sweep of two 2-step runs at --parallel "
                   "2 (the sweep's CPU default)")
    a = p.parse_args(argv)
    if a.smoke:
        a.runs, a.steps, a.rounds, a.parallel, a.load = 2, 2, 1, "2", 0
    if a.runs < 2:
        C.bad_input(__file__, f"--runs {a.runs}: a sweep is at least 2 runs (seeds), so --runs must be 2 or more.")
    return a


def spin() -> None:
    while True:
        pass


def sweep_seconds(a: argparse.Namespace, work: Path, parallel: int, tag: str) -> float:
    """Wall seconds of one fresh sweep of a.runs seeds at --parallel `parallel`."""
    cmd = [sys.executable, "-m", "nanopt.cli", "sweep", "configs/tiny.yaml", "--seeds", str(a.runs),
           "--name", tag, "--dir", str(work / tag), "--parallel", str(parallel),
           f"--train.max_steps={a.steps}", *(SMOKE if a.smoke else [])]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=C.REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return seconds


def measure(a: argparse.Namespace, work: Path, modes: list[int], condition: str) -> dict[int, list[float]]:
    times: dict[int, list[float]] = {m: [] for m in modes}
    for r in range(a.rounds):
        for m in modes[r % len(modes):] + modes[: r % len(modes)]:  # rotate the order each round
            times[m].append(sweep_seconds(a, work, m, f"{condition}-p{m}-r{r}"))
            C.progress(f"{condition}, round {r + 1}/{a.rounds}: --parallel {m} swept {a.runs} runs in "
                       f"{times[m][-1]:.0f} s")
    return times


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    modes = [int(m) for m in a.parallel.split(",")]
    C.banner("nanopt sweep: tiny-config runs per hour, concurrent vs one after another",
             {"sweep": f"{a.runs} runs of configs/tiny.yaml, {a.steps} steps each, {a.rounds} rounds per mode"},
             C.command(__file__, argv))
    work = Path(tempfile.mkdtemp(prefix="nanopt-sweep-bench-"))
    print("| machine | " + " | ".join(f"--parallel {m}: runs/hour" for m in modes) + " |")
    print("|---|" + "---|" * len(modes), flush=True)
    try:
        conditions(a, modes, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def conditions(a: argparse.Namespace, modes: list[int], work: Path) -> None:
    """A table row per condition: the quiet machine, then (with --load) the loaded one."""
    for condition, load in (("quiet", 0), ("loaded", a.load)):
        if condition == "loaded" and not load:
            continue
        spinners = [mp.Process(target=spin, daemon=True) for _ in range(load)]
        for s in spinners:
            s.start()
        try:
            times = measure(a, work, modes, condition)
        finally:
            for s in spinners:
                s.terminate()
        rate = {m: 3600 * a.runs / statistics.median(t) for m, t in times.items()}
        base = rate[modes[0]]
        cells = " | ".join(f"{rate[m]:.1f} ({rate[m] / base:.2f}x, {C.spread(times[m])})" for m in modes)
        label = condition if not load else f"{condition} ({load} busy process{'es' if load > 1 else ''})"
        print(f"| {label} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
