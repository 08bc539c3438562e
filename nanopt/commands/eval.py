"""`nanopt eval RUN_OR_CHECKPOINT [--split val|test] [--batches N]`: out-of-band evaluation (also under
torchrun), appended to the run's evaluations file (rundirs.EVALS_FILE); safe while the run is still training.
`--watch` keeps going: every new complete checkpoint of a training run, until the run finishes (by the rule
every command uses, rundirs.finished, with the run's own config)."""
from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch

from nanopt import data, runtime
from nanopt.config import DEVICES, Config
from nanopt.errors import ConfigError
from nanopt.evaluation import evaluate, split_batches, token_bytes_table
from nanopt.io import append_jsonl
from nanopt.loading import checkpoint_config, find_checkpoint, load
from nanopt.metrics import setup_logging
from nanopt.rundirs import (CONFIG_FILE, EVALS_FILE, MODEL_FILE, STATE_FILE, SUMMARY_FILE, checkpoint_dirs,
                            checkpoints_dir, finished, is_run, read_config, read_records, step_of, verify_checkpoint)
from nanopt.runtime import Runtime
from nanopt.tokenizer import get_tokenizer


def main(argv: list[str]) -> int:
    """`nanopt eval RUN_OR_CHECKPOINT [--split val|test] [--batches N] [--watch]`, also under torchrun."""
    p = argparse.ArgumentParser(prog="nanopt eval", description=(
        "Evaluate a checkpoint on the run's fixed validation (or test) set and append the result to the run's "
        f"{EVALS_FILE}. Safe while the run is still training; under torchrun the ranks share the batches. With "
        "--watch, evaluate every new complete checkpoint of a run as it appears, until the run finishes."))
    p.add_argument("path", help="a run directory (its newest complete checkpoint) or a checkpoint directory")
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--batches", type=int, default=0, help="micro-batches in the evaluation set (default: eval.batches)")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--precision", choices=("run", "fp32", "bf16"), default="run",
                   help="autocast as the run trained (default) or force one")
    p.add_argument("--watch", action="store_true",
                   help=f"evaluate each new complete checkpoint of the run directory until the run has finished "
                        f"(its {SUMMARY_FILE} says it trained to its {CONFIG_FILE}'s train.max_steps, or stopped at "
                        f"its target) and its last checkpoint is evaluated (or --timeout, or Ctrl-C)")
    p.add_argument("--interval", type=float, default=30.0, help="with --watch: seconds between looks (default 30)")
    p.add_argument("--timeout", type=float, default=0.0, help="with --watch: stop after this many seconds (0 = never)")
    args = p.parse_args(argv)
    if args.batches < 0:
        raise ConfigError(f"--batches must be positive, got {args.batches}.")
    if args.watch:
        return watch(args)
    ckpt = find_checkpoint(args.path)
    run_cfg = checkpoint_config(ckpt)
    setup_logging(int(os.environ.get("RANK", "0") or 0) == 0)
    rt = None
    try:
        rt = _runtime(args, run_cfg)
        # Rank 0's pick for everyone: a checkpoint the run writes meanwhile must not split the ranks.
        ckpt = Path(rt.gather_objects(str(ckpt))[0])
        Evaluator(args, rt).run(ckpt)
        runtime.teardown(rt, wait_for_peers=True)
    finally:
        runtime.teardown(rt)
    return 0


def _runtime(args: argparse.Namespace, run_cfg: Config) -> Runtime:
    precision = run_cfg.train.precision if args.precision == "run" else args.precision
    return runtime.init(args.device, "bf16" if precision == "bf16" else "fp32", run_cfg.runtime.threads)


class Evaluator:
    """Evaluates checkpoints of one run on one split; the evaluation batches are built once per batch count."""

    def __init__(self, args: argparse.Namespace, rt: Runtime):
        self.args, self.rt = args, rt
        self.batches: dict[int, Any] = {}
        self.token_bytes: Optional[torch.Tensor] = None

    def batch_count(self, cfg: Config) -> int:
        return self.args.batches or cfg.eval.batches

    def run(self, ckpt: Path) -> dict[str, Any]:
        """Evaluate one checkpoint, append its record to the run's evaluations (main rank) and print one line."""
        args, rt = self.args, self.rt
        loaded = load(ckpt)
        cfg = loaded.cfg
        model = loaded.model.to(rt.device)
        batches_n = self.batch_count(cfg)
        if batches_n not in self.batches:
            batches = split_batches(cfg, rt, data.data_dir(cfg, rt), args.split, batches_n)
            if batches is None:
                raise ConfigError(f"the run's data ({cfg.data.source}) has no `{args.split}_*.bin` shards; "
                                  f"use --split val or prepare a {args.split} split.")
            self.batches[batches_n] = batches
        if self.token_bytes is None:
            self.token_bytes = token_bytes_table(get_tokenizer(cfg.data.tokenizer), cfg.model.vocab_size, rt.device)
        t0 = time.perf_counter()
        loss, bpb = evaluate(model, self.batches[batches_n], self.token_bytes, rt)
        seconds = time.perf_counter() - t0
        precision = cfg.train.precision if args.precision == "run" else args.precision
        record = {"step": loaded.step, "time": time.time(), f"{args.split}_loss": loss, f"{args.split}_bpb": bpb,
                  "source": "nanopt eval", "checkpoint": str(ckpt), "eval_batches": batches_n,
                  "eval_tokens": batches_n * cfg.train.micro_batch_size * cfg.train.seq_len,
                  "world_size": rt.world_size, "precision": precision}
        if rt.is_main:
            append_jsonl(loaded.run_dir / EVALS_FILE, record)
            print(f"{ckpt} (step {loaded.step}) | {args.split} loss {loss:.4f} | {args.split} bpb {bpb:.4f} | "
                  f"{record['eval_tokens']:,} tokens in {seconds:.1f} s on {rt.world_size} rank(s) | "
                  f"appended to {loaded.run_dir / EVALS_FILE}", flush=True)
        return record


# ---------------------------------------------------------------- --watch


def _watchable(path: Path) -> bool:
    """A training run's directory (rundirs.is_run), or an empty one a run is about to start in (the watcher
    may start first)."""
    return path.is_dir() and (is_run(path) or not any(path.iterdir()))


def check_watch_times(interval: float, timeout: float) -> None:
    """--interval a finite number of seconds above 0, --timeout finite and at least 0: time.sleep(nan) and
    sleep(inf) raise, and a nan deadline is never reached."""
    if not (math.isfinite(interval) and interval > 0) or not (math.isfinite(timeout) and timeout >= 0):
        raise ConfigError(f"--interval must be a number of seconds above 0 and --timeout one at least 0 (0 = never), "
                          f"got {interval} and {timeout}; e.g. --interval 30 --timeout 3600.")


def evaluated(run_dir: Path, split: str) -> set[tuple[int, int]]:
    """(step, eval batches) already in the run's evaluations for this split: what a restarted watcher must not
    redo. A damaged line is ConfigError naming the file and line (rundirs.read_records)."""
    return {(r["step"], r["eval_batches"]) for r in read_records(run_dir / EVALS_FILE)
            if r.get(f"{split}_loss") is not None and r.get("source") == "nanopt eval"
            and isinstance(r.get("step"), int) and isinstance(r.get("eval_batches"), int)}


def finished_at(run_dir: Path) -> Optional[int]:
    """The step the run finished at, or None while it trains: rundirs.finished with the run's own config
    (its train.max_steps and train.stop_at_target), the rule training itself uses to decide that a re-run
    does not train on. A run resumed with more steps has a config that says so, so its earlier summary no
    longer counts."""
    config = read_config(run_dir)
    if config is None:
        return None  # not started yet
    train = config.get("train", {})
    max_steps, stop_at_target = train.get("max_steps"), train.get("stop_at_target", False)
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or not isinstance(stop_at_target, bool):
        raise ConfigError(f"{run_dir / CONFIG_FILE}: train.max_steps ({max_steps!r}) must be an integer and "
                          f"train.stop_at_target ({stop_at_target!r}) true or false; the file is damaged. The run "
                          f"writes it when it starts: restart the run, or mend the file.")
    summary = finished(run_dir, max_steps, stop_at_target)
    return None if summary is None else summary["steps"]


def _vanished(ckpt: Path) -> bool:
    """True when the checkpoint (or a file of it) is gone: `checkpoint.keep` pruned it while it was read."""
    return not ckpt.is_dir() or not (ckpt / STATE_FILE).exists() or not (ckpt / MODEL_FILE).exists()


def watch(args: argparse.Namespace) -> int:
    """Evaluate every new complete checkpoint of a run directory as it appears.

    Read-only on the checkpoints: a checkpoint is written under .tmp_step_N and renamed into place, so the
    listing only ever shows whole ones, and each is verified (manifest, crc32) before it is read. One that
    is damaged, or pruned while being read, is skipped with a line saying why. What is already in the run's
    evaluations for this split and batch count is never evaluated again, so a restarted watcher picks up
    where the last one stopped.
    """
    run_dir = Path(args.path)
    check_watch_times(args.interval, args.timeout)
    if (run_dir / STATE_FILE).is_file():
        raise ConfigError(f"{run_dir} is a checkpoint; --watch takes its run directory ({run_dir.parent.parent}).")
    if not _watchable(run_dir):
        raise ConfigError(f"{run_dir} is not a run directory (no {CONFIG_FILE}, metrics or checkpoints in it); "
                          f"--watch takes the directory a training run writes (runs/<name>), or an empty one a run "
                          f"is about to start in.")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise ConfigError("--watch runs in one process; start it without torchrun.")
    setup_logging(True)
    deadline = time.monotonic() + args.timeout if args.timeout else None
    done = evaluated(run_dir, args.split)
    handled: set[Path] = set()  # looked at in this session: evaluated, found done, or skipped
    steps_handled: set[int] = set()
    evaluator: Optional[Evaluator] = None
    count = 0
    print(f"watching {run_dir} for complete checkpoints every {args.interval:g} s "
          f"({len(done)} evaluation(s) already in {EVALS_FILE}; Ctrl-C to stop)", flush=True)
    try:
        while True:
            for ckpt in checkpoint_dirs(checkpoints_dir(run_dir)):
                if ckpt in handled:
                    continue
                step = step_of(ckpt)
                try:
                    cfg = checkpoint_config(ckpt)
                    if evaluator is None:
                        evaluator = Evaluator(args, _runtime(args, cfg))
                    if (step, evaluator.batch_count(cfg)) not in done:
                        evaluator.run(ckpt)  # load() verifies the manifest and crc32s before reading weights
                        done.add((step, evaluator.batch_count(cfg)))
                        count += 1
                except Exception:
                    problem = "it was removed while being read (pruned by checkpoint.keep)" if _vanished(ckpt) \
                        else verify_checkpoint(ckpt)
                    if problem is None:
                        raise  # not the checkpoint's fault: bad input or a bug, say so
                    print(f"skipped {ckpt}: {problem}", flush=True)  # the next checkpoint may be fine
                handled.add(ckpt)
                steps_handled.add(step)
            last = finished_at(run_dir)
            if last is not None and last in steps_handled:
                print(f"the run finished at step {last}; {count} checkpoint(s) evaluated by this watcher", flush=True)
                return 0
            if deadline is not None and time.monotonic() >= deadline:
                print(f"--timeout {args.timeout:g} s passed before the run finished; {count} checkpoint(s) evaluated "
                      f"(run the same command again to go on)", flush=True)
                return 0
            time.sleep(args.interval if deadline is None else max(0.0, min(args.interval, deadline - time.monotonic())))
    except KeyboardInterrupt:
        print(f"stopped (Ctrl-C); {count} checkpoint(s) evaluated by this watcher", flush=True)
        return 0
    finally:
        runtime.teardown(evaluator.rt if evaluator else None)
