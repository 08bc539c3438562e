"""`nanopt scaling plan CONFIG --budgets C1,C2 --sizes K`: an isoFLOP ladder written as a sweep; `nanopt scaling fit
RUNS_DIR | --csv FILE`: Chinchilla's approaches 2 and 3 fitted to it (nanopt/lab/scaling.py)."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
from pathlib import Path

import yaml

from nanopt.config import parse_overrides, split_args
from nanopt.errors import ConfigError
from nanopt.io import write_text
from nanopt.lab import scaling, sweep


def _flops(text: str) -> float:
    with contextlib.suppress(ValueError):
        if 0 < (value := float(text)) < math.inf:
            return value
    raise argparse.ArgumentTypeError(f"{text!r} is not a FLOP count; write e.g. 1e21")


def fit_main(argv: list[str]) -> int:
    """a law fitted to a ladder's runs or a CSV, with intervals and predictions. """
    p = argparse.ArgumentParser(prog="nanopt scaling fit", description=(
        "Fit L(N, D) = E + A/N^alpha + B/D^beta (approach 3) and the isoFLOP optima N_opt ~ C^a, D_opt ~ C^b "
        "(approach 2) to the finished runs below RUNS_DIR, or to a CSV; 95% bootstrap intervals."))
    p.add_argument("runs_dir", nargs="?", type=Path, help="a ladder's directory (finished runs below it)")
    p.add_argument("--csv", type=Path, help="columns params,tokens,loss (or params,flops,loss: D = C / 6N)")
    p.add_argument("--metric", default="final_val_bpb", help="summary.json figure fitted as L (default %(default)s)")
    p.add_argument("--params", default="params", choices=tuple(scaling.PARAMS), help="which parameters count as N: "
                   "all (summary.json `params`, embeddings included) or n_6n (those a token passes through: "
                   "matrices, norms and the head, not the lookup tables)")
    p.add_argument("--predict", type=_flops, action="append", default=[], metavar="FLOPS",
                   help="the loss-optimal size, tokens and loss at this budget (repeatable)")
    p.add_argument("--bootstrap", type=int, default=100, help="resamples for the intervals (default 100)")
    p.add_argument("--plot", type=Path, metavar="PNG", help="draw the isoFLOP curves and the fitted frontier")
    p.add_argument("--check", type=Path, action="append", default=[], metavar="RUN_DIR",
                   help="a finished run left out of the fit: its measured figure against the law's prediction")
    p.add_argument("--json", action="store_true", help="one JSON object: E, A, B, alpha, beta, a, b with intervals")
    args = p.parse_args(argv)
    if (args.runs_dir is None) == (args.csv is None):
        raise ConfigError("nanopt scaling fit takes a ladder's directory or --csv FILE, one of the two: "
                          "`nanopt scaling fit runs/ladder` or `nanopt scaling fit --csv points.csv`.")
    points = scaling.from_csv(args.csv) if args.csv else scaling.from_runs(args.runs_dir, args.metric, args.params)
    out = scaling.fit(points, bootstrap=args.bootstrap)
    out["predictions"] = [scaling.optimum({k: out[k]["value"] for k in scaling.LAW_KEYS}, c) for c in args.predict]
    out["checks"] = [scaling.check(out, run, args.metric, args.params) for run in args.check]
    if args.plot:
        scaling.plot(points, out, args.plot)
    print(json.dumps(out, indent=2) if args.json else scaling.report_text(out, out["predictions"]))
    return 0


def _budgets(text: str) -> list[float]:
    try:
        return [_flops(part) for part in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--budgets {text}: {e}; give FLOP counts separated by commas") from None


def plan_main(argv: list[str]) -> int:
    """an isoFLOP grid of runs around each budget's predicted optimum, written as a sweep. """
    p = argparse.ArgumentParser(prog="nanopt scaling plan", description=(
        "For each budget, --sizes model depths (model.depth) around the size the config's "
        "scaling.tokens_per_param predicts optimal, each run's tokens from its budget at nanopt's own FLOPs per "
        "token, its batch, lr, weight decay and warm-up from the scaling.* transfer rules applied to the config's "
        "own values. Prints every run before anything trains and writes DIR/ladder.yaml for `nanopt sweep "
        "--points`. Other --section.key=value flags apply to every run."))
    p.add_argument("--budgets", type=_budgets, required=True, help="FLOPs per run, e.g. 1e12,3e12,1e13")
    p.add_argument("--sizes", type=int, default=4, help="model sizes per budget (default 4)")
    p.add_argument("--out", type=Path, help="the ladder's directory (default runs/<config>-ladder)")
    config, rest = split_args(argv)
    args, raw = p.parse_known_args(rest)
    if not 1 <= args.sizes <= 32:
        raise ConfigError(f"--sizes {args.sizes}: the model sizes per budget; give 1 to 32 (3 or more to fit).")
    out = sweep.sweep_dir(args.out, f"{Path(config).stem if config else 'tiny'}-ladder", "--out")
    overrides = sweep.normal_overrides(raw)
    rungs = scaling.plan(config, parse_overrides(overrides), args.budgets, args.sizes)
    ladder = out / "ladder.yaml"
    out.mkdir(parents=True, exist_ok=True)
    write_text(ladder, yaml.safe_dump(scaling.points_file(rungs), sort_keys=False))
    sweep.plan(config, [], 1, overrides, 1, ladder)  # every run's config checked now, not after ten runs
    command = ["nanopt", "sweep", *([config] if config else []), "--points", str(ladder), "--dir", str(out), *overrides]
    print(f"{scaling.plan_text(rungs)}\n\n{len(rungs)} runs written to {ladder}; train them with\n  "
          f"{shlex.join(command)}\nthen fit: nanopt scaling fit {shlex.quote(str(out))}")
    return 0


SUBCOMMANDS = {"plan": plan_main, "fit": fit_main}


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: nanopt scaling {{{','.join(SUBCOMMANDS)}}} ...\n\n"
              + "".join(f"  {name:<5} {f.__doc__}\n" for name, f in SUBCOMMANDS.items())
              + "`nanopt scaling plan --help`, `nanopt scaling fit --help` for their options.")
        return 0
    if not argv or argv[0] not in SUBCOMMANDS:
        raise ConfigError(f"nanopt scaling takes a subcommand, one of {', '.join(SUBCOMMANDS)}: e.g. "
                          f"`nanopt scaling fit --csv points.csv`.")
    return SUBCOMMANDS[argv[0]](argv[1:])
