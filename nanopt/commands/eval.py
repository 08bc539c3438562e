"""`nanopt eval RUN_OR_CHECKPOINT [--split val|test] [--batches N]`: out-of-band evaluation (also under
torchrun), appended to the run's evals.jsonl; safe while the run is still training. `--watch` keeps going:
every new complete checkpoint of a training run, until the run finishes."""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch

from nanopt import data, runtime
from nanopt.checkpoint import STEP_DIR, complete_checkpoints, verify
from nanopt.config import DEVICES, Config
from nanopt.errors import ConfigError
from nanopt.evaluation import EVALS, evaluate, split_batches, token_bytes_table
from nanopt.io import append_jsonl, read_jsonl
from nanopt.loading import checkpoint_config, find_checkpoint, load
from nanopt.metrics import setup_logging
from nanopt.runtime import Runtime
from nanopt.tokenizer import get_tokenizer


def main(argv: list[str]) -> int:
    """`nanopt eval RUN_OR_CHECKPOINT [--split val|test] [--batches N] [--watch]`, also under torchrun."""
    p = argparse.ArgumentParser(prog="nanopt eval", description=(
        "Evaluate a checkpoint on the run's fixed validation (or test) set and append the result to the run's "
        f"{EVALS}. Safe while the run is still training; under torchrun the ranks share the batches. With "
        "--watch, evaluate every new complete checkpoint of a run as it appears, until the run finishes."))
    p.add_argument("path", help="a run directory (its newest complete checkpoint) or a checkpoint directory")
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--batches", type=int, default=0, help="micro-batches in the evaluation set (default: eval.batches)")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--precision", choices=("run", "fp32", "bf16"), default="run",
                   help="autocast as the run trained (default) or force one")
    p.add_argument("--watch", action="store_true",
                   help="evaluate each new complete checkpoint of the run directory until the run's summary.json "
                        "appears and its last checkpoint is evaluated (or --timeout, or Ctrl-C)")
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
        """Evaluate one checkpoint, append its record to evals.jsonl (main rank) and print one line."""
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
            append_jsonl(loaded.run_dir / EVALS, record)
            print(f"{ckpt} (step {loaded.step}) | {args.split} loss {loss:.4f} | {args.split} bpb {bpb:.4f} | "
                  f"{record['eval_tokens']:,} tokens in {seconds:.1f} s on {rt.world_size} rank(s) | "
                  f"appended to {loaded.run_dir / EVALS}", flush=True)
        return record


# ---------------------------------------------------------------- --watch


def _is_run_dir(path: Path) -> bool:
    """A training run's directory, or an empty one a run is about to start in (the watcher may start first)."""
    if not path.is_dir():
        return False
    return not any(path.iterdir()) or any((path / n).exists() for n in ("config.yaml", "metrics.jsonl", "checkpoints"))


def evaluated(run_dir: Path, split: str) -> set[tuple[int, int]]:
    """(step, eval batches) already in evals.jsonl for this split: what a restarted watcher must not redo."""
    return {(r.get("step"), r.get("eval_batches")) for r in read_jsonl(run_dir / EVALS)
            if r.get(f"{split}_loss") is not None and r.get("source") == "nanopt eval"}


def finished_at(run_dir: Path) -> Optional[int]:
    """The step of a finished run (its summary.json's), or None while it trains. A summary older than
    config.yaml belongs to an earlier session of a run that was resumed and is training again."""
    summary, config = run_dir / "summary.json", run_dir / "config.yaml"
    try:
        if config.is_file() and config.stat().st_mtime > summary.stat().st_mtime:
            return None
        return int(json.loads(summary.read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _vanished(ckpt: Path) -> bool:
    """True when the checkpoint (or a file of it) is gone: `checkpoint.keep` pruned it while it was read."""
    return not ckpt.is_dir() or any(not (ckpt / n).exists() for n in ("COMPLETE", "state.json", "model.safetensors"))


def watch(args: argparse.Namespace) -> int:
    """Evaluate every new complete checkpoint of a run directory as it appears.

    Read-only on the checkpoints: a checkpoint is written under .tmp_step_N and renamed into place, so the
    listing only ever shows complete ones, and each is verified (manifest, crc32) before it is read. One
    that is pruned while being read is skipped with a line. What is already in evals.jsonl for this split
    and batch count is never evaluated again, so a restarted watcher picks up where the last one stopped.
    """
    run_dir = Path(args.path)
    if (run_dir / "state.json").is_file():
        raise ConfigError(f"{run_dir} is a checkpoint; --watch takes its run directory ({run_dir.parent.parent}).")
    if not _is_run_dir(run_dir):
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml, metrics.jsonl or checkpoints/ in it); "
                          f"--watch takes the directory a training run writes (runs/<name>), or an empty one a run "
                          f"is about to start in.")
    if args.interval <= 0 or args.timeout < 0:
        raise ConfigError(f"--interval must be above 0 and --timeout at least 0 (0 = never), "
                          f"got {args.interval} and {args.timeout}.")
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
          f"({len(done)} evaluation(s) already in {EVALS}; Ctrl-C to stop)", flush=True)
    try:
        while True:
            for ckpt in complete_checkpoints(run_dir / "checkpoints"):
                if ckpt in handled:
                    continue
                step = int(STEP_DIR.match(ckpt.name).group(1))
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
                        else verify(ckpt)
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
