"""`nanopt average RUN (--last K | --steps a,b,c) --out DIR`: a checkpoint whose weights are the mean of some of a
run's checkpoints (nanopt/lab/averaging.py)."""
from __future__ import annotations

import argparse

from nanopt.lab.averaging import average_checkpoints, parse_steps
from nanopt.training.checkpoint import read_state


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nanopt average", description=(
        "Average the weights of some of a run's checkpoints (fp32 sums, saved in each tensor's dtype) into a new "
        "checkpoint, DIR/checkpoints/step_NNNNNN (the newest averaged step), that nanopt eval, sample and export "
        "load like any other; its state.json lists the checkpoints averaged."), epilog=(
        "Exit status: 0 written, 2 bad input (checkpoints of different models, incomplete or missing ones, fewer "
        "than 2, or DIR not empty: nothing is overwritten)."))
    p.add_argument("path", help="a run directory")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--last", type=int, metavar="K", help="the run's newest K checkpoints (K >= 2)")
    which.add_argument("--steps", metavar="A,B,C", help="the checkpoints of these steps")
    p.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory for the averaged checkpoint")
    args = p.parse_args(argv)
    steps = parse_steps(args.steps) if args.steps is not None else None
    ckpt = average_checkpoints(args.path, args.out, args.last, steps)
    averaged = [c["step"] for c in read_state(ckpt)["averaged_from"]["checkpoints"]]
    print(f"averaged {len(averaged)} checkpoints of {args.path} (steps {', '.join(map(str, averaged))}) into {ckpt}; "
          f"evaluate it with: nanopt eval {args.out}")
    return 0
