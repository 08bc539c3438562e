"""`nanopt eval RUN_OR_CHECKPOINT [--split val|test] [--batches N] [--watch]`: out-of-band evaluation, also
under torchrun, appended to the run's evaluations file (nanopt/watch.py)."""
from __future__ import annotations

import argparse

from nanopt.config import DEVICES
from nanopt.rundirs import CONFIG_FILE, EVALS_FILE, SUMMARY_FILE
from nanopt.watch import Evaluator, evaluate_checkpoint, watch_run


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nanopt eval", description=(
        f"Evaluate a checkpoint on the run's fixed val (or test) set and append the result to the run's {EVALS_FILE}; "
        "safe while the run trains; under torchrun the ranks share the batches."))
    p.add_argument("path", help="a run directory (its newest complete checkpoint) or a checkpoint directory")
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--batches", type=int, default=0, help="micro-batches in the evaluation set (default: eval.batches)")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--precision", choices=("run", "fp32", "bf16"), default="run",
                   help="autocast as the run trained (default) or force one")
    p.add_argument("--watch", action="store_true",
                   help=f"evaluate each new complete checkpoint of the run directory until the run has finished (its "
                        f"{SUMMARY_FILE} says so for its {CONFIG_FILE}) and its last checkpoint is evaluated")
    p.add_argument("--interval", type=float, default=30.0, help="with --watch: seconds between looks (default 30)")
    p.add_argument("--timeout", type=float, default=0.0, help="with --watch: stop after this many seconds (0 = never)")
    args = p.parse_args(argv)
    evaluator = Evaluator(args.split, args.batches, args.device, args.precision)
    if args.watch:
        return watch_run(args.path, evaluator, args.interval, args.timeout)
    evaluate_checkpoint(args.path, evaluator)  # prints its line
    return 0
