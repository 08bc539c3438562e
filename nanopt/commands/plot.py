"""`nanopt plot RUN_OR_SWEEP... [-o OUT.png] [--force] [--x steps|tokens|seconds] [--metric NAME]`: runs overlaid in
one PNG."""
from __future__ import annotations

import argparse

from nanopt.lab import plots
from nanopt.rundirs import METRICS_FILE


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nanopt plot", description=(
        f"Overlay one metric of several runs (from their {METRICS_FILE}) in one PNG and print its path. A sweep "
        "directory stands for every run below it; each line is named by its directory."))
    p.add_argument("paths", nargs="+", metavar="RUN_OR_SWEEP", help="run directories or directories of runs")
    p.add_argument("-o", "--out", default=None,
                   help="the PNG to write (default: plot_<metric>_<x>.png in the current directory)")
    p.add_argument("--x", choices=plots.X_AXES, default="steps",
                   help="x axis: optimizer steps, tokens seen, or training seconds (default: steps)")
    p.add_argument("--metric", default="val_loss",
                   help=f"any number in {METRICS_FILE}: val_loss (default), val_bpb, loss, mfu, tokens_per_s, lr, ...")
    p.add_argument("--force", action="store_true", help="replace the PNG if it exists (without it: exit 2, kept)")
    args = p.parse_args(argv)
    print(plots.plot_runs(args.paths, args.out or f"plot_{args.metric}_{args.x}.png", args.metric, args.x,
                          args.force))
    return 0
