"""`nanopt eval RUN_OR_CHECKPOINT [--split val|test] [--batches N] [--watch]`: out-of-band evaluation, also under
torchrun, appended to the run's evaluations (evals/checkpoint_eval.py); `--tasks`/`--core`: downstream task scores
(evals/tasks.py); `--make-tasks DIR`: the generated demo tasks (evals/taskgen.py)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

from nanopt.config import DEVICES, comma_list
from nanopt.errors import ConfigError
from nanopt.evals.checkpoint_eval import Evaluator, evaluate_checkpoint, watch_run
from nanopt.evals.taskgen import BUNDLE_DIR, make_tasks, test_plays, write_bundle
from nanopt.evals.tasks import TaskSpec, score_checkpoint, task_lines
from nanopt.io import refuse_link
from nanopt.loading import WEIGHTS
from nanopt.rundirs import CONFIG_FILE, EVALS_FILE, SUMMARY_FILE, is_run


def _bounded(cast: type, rule: str, low: float, above: bool = False) -> Callable[[str], Any]:
    """An argparse type: a finite number at least `low` (above it when `above`), else the flag's one paragraph."""
    def parse(text: str) -> Any:
        value = cast(text)
        if not (math.isfinite(value) and (value > low if above else value >= low)):
            raise argparse.ArgumentTypeError(f"{text} must be {rule}")
        return value
    parse.__name__ = cast.__name__  # argparse's "invalid int value: 'x'"
    return parse


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nanopt eval", exit_on_error=False, description=(
        f"Evaluate a checkpoint on the run's fixed val (or test) set and append the result to the run's {EVALS_FILE}; "
        "safe while the run trains; under torchrun the ranks share the batches."))
    p.add_argument("path", nargs="?", help="a run directory (its newest complete checkpoint) or a checkpoint "
                   "directory; with --tasks/--core also a Hugging Face directory")
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--batches", type=_bounded(int, "0 or more", 0), default=0,
                   help="micro-batches in the evaluation set (default: eval.batches)")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--precision", choices=("run", "fp32", "bf16"), default="run",
                   help="autocast as the run trained (default) or force one")
    p.add_argument("--weights", choices=WEIGHTS, default="run", help="the weights the run evaluated (its "
                   "eval.weights, default), the model's own, or the averaged ones (train.ema_decay); the record says "
                   "which")
    p.add_argument("--watch", action="store_true",
                   help=f"evaluate each new complete checkpoint of the run directory until the run has finished (its "
                        f"{SUMMARY_FILE} says so for its {CONFIG_FILE}) and its last checkpoint is evaluated")
    p.add_argument("--interval", type=_bounded(float, "a finite number of seconds above 0", 0, above=True),
                   default=30.0, help="with --watch: seconds between looks (default 30)")
    p.add_argument("--timeout", type=_bounded(float, "a finite number of seconds, 0 or more", 0), default=0.0,
                   help="with --watch: stop after this many seconds (0 = never)")
    tasks = p.add_argument_group("downstream tasks (--tasks needs pip install -e '.[eval]')")
    tasks.add_argument("--tasks", default="", help="comma list of lm-eval task or group names (or of YAMLs' names "
                       f"in --include-path); scores go to the run's {EVALS_FILE} and TensorBoard")
    tasks.add_argument("--include-path", default=None, help="a directory of local lm-eval task YAMLs")
    tasks.add_argument("--core", default=None, metavar="DIR", help="a CORE bundle (core.yaml, eval_data/, "
                       "eval_meta_data.csv): each task's accuracy and the centered mean")
    tasks.add_argument("--limit", type=_bounded(int, "1 or more", 1), default=None,
                       help="score only the first N documents of each task")
    tasks.add_argument("--num-fewshot", type=_bounded(int, "0 or more (or left out for each task's own)", 0),
                       default=None, help="few-shot examples (default: each task's own)")
    tasks.add_argument("--batch-size", type=_bounded(int, "1 or more", 1), default=32,
                       help="requests per forward pass (default 32)")
    tasks.add_argument("--json", action="store_true", help="print the records as JSON")
    tasks.add_argument("--make-tasks", default=None, metavar="DIR", help="write the generated demo tasks (an lm-eval "
                       "multiple-choice and a perplexity task, and a CORE bundle in DIR/core) from held-out text "
                       "of the embedded corpus; PATH is not read")
    try:
        args = p.parse_args(argv)
    except argparse.ArgumentError as e:  # a flag's value its type refused: bad input, one paragraph
        raise ConfigError(f"{e.argument_name} {e.message}") from None
    if args.make_tasks:
        return _make(args.make_tasks)
    if not args.path:
        p.error("give PATH: a run directory, a checkpoint directory or (with --tasks/--core) a Hugging Face one")
    _refuse_ignored_flags(p, args)
    _refuse_linked_evals(Path(args.path))
    if args.tasks or args.core:
        return _tasks(args)
    evaluator = Evaluator(args.split, args.batches, args.device, args.precision, args.weights)
    if args.watch:
        return watch_run(args.path, evaluator, args.interval, args.timeout)
    evaluate_checkpoint(args.path, evaluator)  # prints its line
    return 0


# Flags that mean something only beside another: a flag given without it would be silently ignored.
_ONLY_WITH = {"--tasks or --core": ("include_path", "limit", "num_fewshot", "batch_size", "json"),
              "--watch": ("interval", "timeout")}
_LOSS_ONLY = ("split", "batches")  # val/test loss only: --tasks/--core score tasks


def _refuse_ignored_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """ConfigError naming a flag given (not at its default) where it has no effect."""
    def given(dest: str) -> bool:
        return getattr(args, dest) != p.get_default(dest)

    scoring = bool(args.tasks or args.core)
    for needs, dests in _ONLY_WITH.items():
        if not (scoring if needs.startswith("--tasks") else args.watch) and (odd := next(filter(given, dests), None)):
            raise ConfigError(f"--{odd.replace('_', '-')} applies only with {needs}; it would be ignored here. Drop "
                              f"it, or add {needs}.")
    if scoring and (odd := next(filter(given, _LOSS_ONLY), None)):
        raise ConfigError(f"--{odd} sets the val/test loss evaluation, which --tasks/--core do not run; drop it, or "
                          f"evaluate the loss in a separate `nanopt eval` without --tasks/--core.")


def _refuse_linked_evals(path: Path) -> None:
    """A link at the run's evals file is refused before any evaluation runs, not at its append, after the work."""
    for run_dir in (path, path.parent.parent):  # a run directory, or a checkpoint in its checkpoints/
        if is_run(run_dir):
            refuse_link(run_dir / EVALS_FILE)


def _make(out: str) -> int:
    written = make_tasks(out)  # its refusals come before the corpus is read
    bundle = write_bundle(Path(out) / BUNDLE_DIR, test_plays())
    print("\n".join([*map(str, written), str(bundle)]))
    print(f"use: nanopt eval RUN --tasks nanopt_mc,nanopt_rolling --include-path {out} --core {bundle}")
    return 0


def _tasks(args: argparse.Namespace) -> int:
    if args.watch:
        raise ConfigError("--watch evaluates val/test loss only; run --tasks/--core on a checkpoint or run directory.")
    names = comma_list(args.tasks)
    if args.tasks and not names:
        raise ConfigError(f"--tasks {args.tasks!r} names no task; give a comma list of lm-eval task or group names, "
                          f"e.g. --tasks hellaswag,arc_easy (or leave --tasks out and score only --core).")
    spec = TaskSpec(names, args.include_path, args.limit, args.num_fewshot, args.core, args.batch_size)
    records, held = score_checkpoint(args.path, spec, args.device, args.precision, args.weights)
    print(json.dumps(records, indent=2) if args.json else "\n".join(task_lines(records)))
    if held:
        print(f"{len(held)} of these ({', '.join(r['task'] for r in held)}) were already in {EVALS_FILE} from the "
              f"same weights; not appended again", file=sys.stderr if args.json else sys.stdout)
    return 0
