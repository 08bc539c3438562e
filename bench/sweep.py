"""How many tiny-config runs per hour does `nanopt sweep` do on this machine, concurrent vs one after another?

Runs the same real `nanopt sweep` (N seeds of configs/tiny.yaml) with `--parallel 1` (one run at a time
with every core's thread: what a for-loop over `nanopt train` does) and with `--parallel K` (K runs at once,
cores split between them: the sweep's CPU default), alternating, on a quiet machine and with `--load`
busy-looping processes sharing the cores. Wall time covers everything a run costs (start-up, data,
evals, the final sample, curves.png). Prints median runs/hour and the ratio to one-after-another.

    python bench/sweep.py
    python bench/sweep.py --runs 4 --steps 150 --rounds 2 --load 1
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=4, help="runs per sweep (seeds of configs/tiny.yaml)")
    p.add_argument("--steps", type=int, default=150, help="train.max_steps of each run (tiny.yaml: 150)")
    p.add_argument("--rounds", type=int, default=2, help="sweeps per mode and condition, alternating")
    p.add_argument("--parallel", default="1,2", help="--parallel values to compare; the first is the baseline")
    p.add_argument("--load", type=int, default=0, help="also measure with this many busy-looping processes")
    return p.parse_args()


def spin() -> None:
    while True:
        pass


def sweep_seconds(a: argparse.Namespace, work: Path, parallel: int, tag: str) -> float:
    """Wall seconds of one fresh sweep of a.runs seeds at --parallel `parallel`."""
    cmd = [sys.executable, "-m", "nanopt.cli", "sweep", "configs/tiny.yaml", "--seeds", str(a.runs),
           "--name", tag, "--dir", str(work / tag), "--parallel", str(parallel),
           f"--train.max_steps={a.steps}"]
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
    return times


def main() -> None:
    a = parse()
    modes = [int(m) for m in a.parallel.split(",")]
    C.banner("nanopt sweep: tiny-config runs per hour, concurrent vs one after another",
             {"sweep": f"{a.runs} runs of configs/tiny.yaml, {a.steps} steps each, {a.rounds} rounds per mode"})
    work = Path(tempfile.mkdtemp(prefix="nanopt-sweep-bench-"))
    print("| machine | " + " | ".join(f"--parallel {m}: runs/hour" for m in modes) + " |")
    print("|---|" + "---|" * len(modes))
    for condition, load in (("quiet", 0), ("loaded", a.load)):
        if condition == "loaded" and not load:
            continue
        spinners = [mp.Process(target=spin, daemon=True) for _ in range(load)]
        for s in spinners:
            s.start()
        times = measure(a, work, modes, condition)
        for s in spinners:
            s.terminate()
        rate = {m: 3600 * a.runs / statistics.median(t) for m, t in times.items()}
        base = rate[modes[0]]
        cells = " | ".join(f"{rate[m]:.1f} ({rate[m] / base:.2f}x, {C.spread(times[m])})" for m in modes)
        label = condition if not load else f"{condition} ({load} busy process{'es' if load > 1 else ''})"
        print(f"| {label} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
