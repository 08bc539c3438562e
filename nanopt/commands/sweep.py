"""`nanopt sweep [CONFIG] --set KEY=V1,V2 [--set ...] [--seeds N] [--name NAME | --dir DIR] [--parallel K]
[--nproc P] [--section.key=value ...]`: a grid of runs under runs/NAME/, one per device slot (nanopt/lab/sweep.py)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from nanopt.config import DEFAULT_CONFIG, split_args
from nanopt.errors import ConfigError
from nanopt.lab import sweep

DESCRIPTION = """\
Run every combination of the --set values, once per seed (S, S+1, ... from the config's run.seed or
--run.seed=S), each as a run directory DIR/<key=value,...,seed=S>/ in its own process (python -m nanopt.main,
or torchrun with --nproc). CUDA: one run per GPU (--nproc P: P GPUs per run), at most --parallel at a time
(default: as many as fit); CPU: --parallel runs share the cores (default: one run per core). Running it again
skips finished runs and resumes interrupted ones from their checkpoints (set --checkpoint.every for long
runs); a raised --train.max_steps resumes finished ones. A point whose directory ran another config is refused
before anything starts, naming the keys that differ: use the same config and overrides, or a new --name /
--dir. One sweep at a time per DIR (DIR/lock.json). Ctrl-C (or SIGTERM) starts nothing new and sends each
running run one SIGTERM: it saves a checkpoint and exits. Each run's output is in its stdout.log; DIR/sweep.json
describes the sweep. Exit status: 0 all done, 1 a run failed, 2 bad input (or DIR in use), 75 stopped by a
signal (run it again). Other --section.key=value flags apply to every run."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one paragraph and exit 2, like every other bad input
        raise ConfigError(f"{message}. Usage: {self.format_usage().strip().removeprefix('usage: ')}")


def main(argv: list[str]) -> int:
    p = _Parser(prog="nanopt sweep", allow_abbrev=False, description=DESCRIPTION,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                usage="nanopt sweep [CONFIG] (--set KEY=V1,V2 [--set ...] | --points FILE) [--seeds N] "
                      "[--name NAME | --dir DIR] [--parallel K] [--nproc P] [--section.key=value ...]")
    p.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2",
                   help="a config key and its values, comma-separated; repeat for more keys (the grid is their "
                        "product)")
    p.add_argument("--points", type=Path, metavar="FILE", help="the runs a YAML file lists, each its own setting "
                   "(`nanopt scaling plan` writes a ladder as one), instead of the product of --set values")
    p.add_argument("--seeds", type=int, default=1, help="runs per setting, seeds run.seed, run.seed+1, ... (default 1)")
    p.add_argument("--name", help="sweep name: the runs go under runs/NAME (default: CONFIG's name + '-sweep')")
    p.add_argument("--dir", help="where the runs go (default runs/NAME)")
    p.add_argument("--parallel", type=int, help="runs at a time (default: GPUs // nproc on CUDA, one per core on CPU)")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run, launched with torchrun (default 1)")
    config, rest = split_args(argv)
    args, raw_overrides = p.parse_known_args(rest)
    overrides = sweep.normal_overrides(raw_overrides)  # one spelling for plan's checks, the runs and sweep.json
    if args.parallel is not None and args.parallel < 1:
        raise ConfigError(f"--parallel {args.parallel}: the number of runs at a time; give 1 or more.")
    if not args.set and args.points is None and args.seeds == 1:
        raise ConfigError("nothing to sweep: give --set KEY=V1,V2 (e.g. --set optim.name=adamw,muon) and/or "
                          "--seeds N with N > 1.")
    points, configs = sweep.plan(config, args.set, args.seeds, overrides, args.nproc, args.points)
    name = args.name or f"{Path(config).stem if config else DEFAULT_CONFIG}-sweep"
    if "/" in name or name in ("", ".", ".."):
        raise ConfigError(f"--name {name!r}: a sweep name is one directory name; use --dir DIR for a path.")
    root = sweep.sweep_dir(args.dir, name, "--dir")
    meta = {"name": name, "config": config, "command": ["nanopt", "sweep", *argv],
            "set": dict(sweep.parse_set(s) for s in args.set), "points": str(args.points) if args.points else None,
            "seeds": sorted({pt.seed for pt in points}), "overrides": overrides}
    return sweep.run_sweep(config, root, points, configs, overrides, args.nproc, args.parallel, meta)
