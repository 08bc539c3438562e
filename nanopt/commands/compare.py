"""`nanopt compare RUN_A RUN_B`: where the difference between two runs comes from (nanopt/lab/compare.py)."""
from __future__ import annotations

import argparse

from nanopt.lab import compare as comparison
from nanopt.lab.runs import load_run, to_json


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nanopt compare", description=(
        "Where the difference between two finished runs comes from: config differences, tokens/s, step time "
        "and MFU (median logged step), time/steps/tokens to target and final val loss/bpb with B - A; val loss "
        "at the most steps, tokens, FLOPs and training seconds both reached; when both were profiled, step-time "
        "shares and top ops in ms per step. Markdown, or --json."))
    p.add_argument("run_a", help="run directory A (the baseline)")
    p.add_argument("run_b", help="run directory B (deltas are B - A)")
    p.add_argument("--json", action="store_true", help="one JSON object for tools")
    args = p.parse_args(argv)
    c = comparison.comparison(load_run(args.run_a), load_run(args.run_b))
    print(to_json(c) if args.json else comparison.markdown(c))
    return 0
