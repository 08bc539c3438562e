"""`nanopt runs [DIR]`: finished runs below DIR grouped by seed, with statistics, a Welch test of one group
against another, or the leaderboard (nanopt/lab/runs.py)."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from nanopt.errors import ConfigError
from nanopt.lab import runs as experiments
from nanopt.rundirs import SUMMARY_FILE


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nanopt runs", description=(
        "Finished runs below DIR, recursively. Runs whose configs differ only in run.seed, run.init_seed, "
        "run.data_seed and neutral keys (names, paths, checkpointing, sampling) form a group, named by the keys that "
        "differ between groups (more than 3: by directory, then the keys there), with n, mean, sd and a 95% "
        "Student-t interval of time/steps/tokens to target and final val loss/bpb, and where its spread comes from "
        "(init, data order or both, each one's sd alone). When no two runs group, or with --runs, a leaderboard "
        "row per run. A run repeating another's setting and seeds (a copied sweep) counts once, with a warning."))
    p.add_argument("dir", nargs="?", default="runs")
    p.add_argument("--runs", action="store_true", help="the per-run leaderboard even when runs group")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="does A beat B? group names, unique parts of them, or directories of seeds")
    p.add_argument("--metric", default="final_val_loss",
                   help=f"{SUMMARY_FILE} figure for --compare, lower is better (default final_val_loss; "
                        "train_seconds_to_target, step_to_target, tokens_to_target, final_val_bpb, ...)")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level for --compare (default 0.05; "
                                                              "speedrun records ask for 0.01)")
    p.add_argument("--effect", type=float, default=None, help="with --compare: also the seeds per group needed to "
                   "show a difference of this size (in the metric's unit) at p < 0.01 with 80%% power")
    p.add_argument("--json", action="store_true", help="one JSON object (groups, runs, comparison) for tools")
    args = p.parse_args(argv)
    if not 0 < args.alpha < 1:
        raise ConfigError(f"--alpha {args.alpha}: give a significance level between 0 and 1, e.g. 0.05 or 0.01.")
    if args.effect is not None and not (math.isfinite(args.effect) and args.effect > 0):
        raise ConfigError(f"--effect {args.effect}: give the difference to detect as a finite number above 0, in the "
                          f"metric's unit (e.g. --effect 0.01 for final_val_loss).")
    if not args.compare and (odd := next((f for f in ("metric", "alpha", "effect")
                                           if getattr(args, f) != p.get_default(f)), None)):
        raise ConfigError(f"--{odd} applies only with --compare A B; it would be ignored here. Drop it, or add "
                          f"--compare.")
    report = experiments.runs_report(Path(args.dir), args.compare, args.metric, args.alpha, args.effect)
    print(experiments.to_json(report) if args.json else experiments.runs_text(report, per_run=args.runs))
    return 0
