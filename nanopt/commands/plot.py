"""`nanopt plot RUN_OR_SWEEP... [-o OUT.png] [--x steps|tokens|seconds] [--metric NAME]`: runs overlaid in one PNG."""
from __future__ import annotations

import argparse
from pathlib import Path

from nanopt import plots
from nanopt.errors import ConfigError
from nanopt.rundirs import METRICS_FILE


def output_path(out: Path) -> Path:
    """The -o path, checked before any run is read: a .png file name in an existing directory."""
    if out.suffix.lower() != ".png":
        raise ConfigError(f"-o {out} must name a .png file.")
    if out.is_dir():
        raise ConfigError(f"-o {out} is a directory; give a file name, e.g. -o {out / 'plot.png'}.")
    if not out.parent.is_dir():
        raise ConfigError(f"-o {out}: the directory {out.parent} does not exist; create it or write elsewhere.")
    return out


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
    args = p.parse_args(argv)
    if not plots.have_matplotlib():
        raise ConfigError("nanopt plot draws with matplotlib, which is not installed; pip install matplotlib.")
    out = output_path(Path(args.out or f"plot_{args.metric}_{args.x}.png"))
    runs = plots.runs_to_plot(args.paths)
    try:
        written = plots.overlay_png(runs, out, args.metric, args.x)
    except OSError as e:  # not writable, the disk full, or the directory removed meanwhile
        raise ConfigError(f"-o {out} cannot be written ({e.strerror or e}); write elsewhere.") from None
    print(written)
    return 0
