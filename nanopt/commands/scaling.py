"""`nanopt scaling fit RUNS_DIR | --csv FILE`: Chinchilla's approaches 2 and 3 fitted to a ladder of runs, with
bootstrap intervals and predictions at new budgets (nanopt/scaling.py)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from nanopt import scaling
from nanopt.errors import ConfigError


def _flops(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a FLOP count; write e.g. 1e21")
    return value


def fit_main(argv: list[str]) -> int:
    """a law fitted to a ladder's runs or a CSV, with intervals and predictions. """
    p = argparse.ArgumentParser(prog="nanopt scaling fit", description=(
        "Fit L(N, D) = E + A/N^alpha + B/D^beta (approach 3) and the isoFLOP optima N_opt ~ C^a, D_opt ~ C^b "
        "(approach 2) to the finished runs below RUNS_DIR, or to a CSV; 95%% bootstrap intervals."))
    p.add_argument("runs_dir", nargs="?", type=Path, help="a ladder's directory (finished runs below it)")
    p.add_argument("--csv", type=Path, help="columns params,tokens,loss (or params,flops,loss: D = C / 6N)")
    p.add_argument("--metric", default="final_val_bpb", help="summary.json figure fitted as L (default "
                   "final_val_bpb; final_val_loss)")
    p.add_argument("--params", default="params", choices=("params", "n_6n"), help="which parameters count as N: "
                   "all (summary.json `params`, embeddings included) or n_6n (those a token passes through: "
                   "matrices, norms and the head, not the lookup tables)")
    p.add_argument("--predict", type=_flops, action="append", default=[], metavar="FLOPS",
                   help="the loss-optimal size, tokens and loss at this budget (repeatable)")
    p.add_argument("--bootstrap", type=int, default=100, help="resamples for the intervals (default 100)")
    p.add_argument("--plot", type=Path, metavar="PNG", help="draw the isoFLOP curves and the fitted frontier")
    p.add_argument("--json", action="store_true", help="one JSON object: E, A, B, alpha, beta, a, b with intervals")
    args = p.parse_args(argv)
    if (args.runs_dir is None) == (args.csv is None):
        raise ConfigError("nanopt scaling fit takes a ladder's directory or --csv FILE, one of the two: "
                          "`nanopt scaling fit runs/ladder` or `nanopt scaling fit --csv points.csv`.")
    points = scaling.from_csv(args.csv) if args.csv else scaling.from_runs(args.runs_dir, args.metric, args.params)
    out = scaling.fit(points, bootstrap=args.bootstrap)
    law = {k: out[k]["value"] for k in scaling.LAW_KEYS}
    out["predictions"] = [scaling.optimum(law, c) for c in args.predict]
    if args.plot:
        scaling.plot(points, out, args.plot)
    print(json.dumps(out, indent=2) if args.json else scaling.report_text(out, out["predictions"]))
    return 0


SUBCOMMANDS = {"fit": fit_main}


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: nanopt scaling {{{','.join(SUBCOMMANDS)}}} ...\n\n  fit   {fit_main.__doc__ or ''}"
              f"`nanopt scaling fit --help` for its options.")
        return 0
    if not argv or argv[0] not in SUBCOMMANDS:
        raise ConfigError(f"nanopt scaling takes a subcommand, one of {', '.join(SUBCOMMANDS)}: e.g. "
                          f"`nanopt scaling fit --csv points.csv`.")
    return SUBCOMMANDS[argv[0]](argv[1:])
