"""`nanopt eval`'s logic: a checkpoint evaluated on its run's fixed val or test set, the result appended to the
run's evaluations (rundirs.EVALS_FILE), safe while the run trains. Once (also under torchrun), or watching:
every new complete checkpoint of a run until it finishes (rundirs.finished, with the run's own config)."""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from nanopt.config import Config
from nanopt.data.tokenizer import get_tokenizer
from nanopt.distributed import runtime
from nanopt.distributed.runtime import Runtime
from nanopt.errors import ConfigError
from nanopt.io import append_jsonl
from nanopt.loading import load
from nanopt.lock import DirLock
from nanopt.rundirs import (CONFIG_FILE, DCP_METADATA, EVALS_FILE, MODEL_FILE, STATE_FILE, WATCH_LOCK_FILE,
                            evaluation_key, finished, is_lease, is_run, read_config, read_records, recorded)
from nanopt.training import loader as data
from nanopt.training.checkpoint import (checkpoint_config, checkpoint_dirs, find_checkpoint, step_of, verify_checkpoint,
                                        weights_crc32)
from nanopt.training.metrics import setup_logging
from nanopt.training.validation import evaluate, split_batches, token_bytes_table


@dataclass
class Evaluator:
    """`nanopt eval`'s options and evaluator: the runtime starts with the first checkpoint; one set per batch count."""

    split: str = "val"
    batches: int = 0  # micro-batches in the evaluation set; 0: the run's eval.batches
    device: str = "auto"
    precision: str = "run"  # autocast as the run trained, or fp32 / bf16
    weights: str = "run"  # loading.WEIGHTS: the run's eval.weights, the model's own, or the averaged ones
    rt: Optional[Runtime] = None
    sets: dict[int, Any] = field(default_factory=dict)  # batch count -> this rank's evaluation batches
    token_bytes: Optional[torch.Tensor] = None

    def start(self, cfg: Config) -> Runtime:
        if self.rt is None:
            self.rt = runtime.init_to_evaluate(self.device, self.precision, cfg.train.precision, cfg.runtime.threads)
        return self.rt

    def batch_count(self, cfg: Config) -> int:
        return self.batches or cfg.eval.batches

    def run(self, ckpt: Path, verified: bool = False) -> dict[str, Any]:
        """Evaluate one checkpoint, append its record to the run's evaluations (main rank) and print one line."""
        loaded = load(ckpt, verified=verified, weights=self.weights)
        cfg, split = loaded.cfg, self.split
        rt = self.start(cfg)
        batches_n = self.batch_count(cfg)
        if batches_n not in self.sets:
            batches = split_batches(cfg, rt, data.data_dir(cfg, rt), split, batches_n)
            if batches is None:
                raise ConfigError(f"the run's data ({cfg.data.source}) has no `{split}_*.bin` shards; "
                                  f"use --split val or prepare a {split} split.")
            self.sets[batches_n] = batches
        if self.token_bytes is None:
            self.token_bytes = token_bytes_table(get_tokenizer(cfg.data.tokenizer), cfg.model.vocab_size, rt.device)
        t0 = time.perf_counter()
        loss, bpb = evaluate(loaded.model.to(rt.device), self.sets[batches_n], self.token_bytes, rt)
        seconds = time.perf_counter() - t0
        precision = cfg.train.precision if self.precision == "run" else self.precision
        precision = "fp32" if precision == "bf16" and rt.precision == "fp32" else precision  # emulated bf16 refused
        record = {"step": loaded.step, "time": time.time(), f"{split}_loss": loss, f"{split}_bpb": bpb,
                  "source": "nanopt eval", "checkpoint": str(ckpt), "weights": loaded.weights,
                  "weights_crc32": weights_crc32(ckpt, loaded.weights_file),
                  "eval_batches": batches_n, "eval_tokens": batches_n * cfg.train.micro_batch_size * cfg.train.seq_len,
                  "world_size": rt.world_size, "precision": precision,
                  **({"averaged_from": loaded.averaged_from} if loaded.averaged_from else {})}
        if rt.is_main:
            evals = loaded.run_dir / EVALS_FILE
            # One record per evaluation (evaluation_key): the same one again adds nothing.
            fresh = evaluation_key(record) not in recorded(loaded.run_dir)
            if fresh:
                append_jsonl(evals, record)
            of = f" ({loaded.weights} weights)" if loaded.weights != "model" else ""
            print(f"{ckpt} (step {loaded.step}){of} | {split} loss {loss:.4f} | {split} bpb {bpb:.4f} | "
                  f"{record['eval_tokens']:,} tokens in {seconds:.1f} s on {rt.world_size} rank(s) | "
                  f"{f'appended to {evals}' if fresh else f'already in {evals} from the same weights, not appended'}",
                  flush=True)
        return record


def evaluate_checkpoint(path: str | Path, evaluator: Evaluator) -> dict[str, Any]:
    """The newest complete checkpoint of a run directory, or a checkpoint, evaluated once."""
    ckpt = find_checkpoint(path)
    setup_logging(int(os.environ.get("RANK", "0") or 0) == 0)
    try:
        rt = evaluator.start(checkpoint_config(ckpt))
        # Rank 0's pick for everyone: a checkpoint the run writes meanwhile must not split the ranks.
        record = evaluator.run(Path(rt.gather_objects(str(ckpt))[0]), verified=True)  # find_checkpoint verified it
        runtime.teardown(wait_for_peers=True)
    finally:
        runtime.teardown()
    return record


# ---------------------------------------------------------------- watching a training run
def evaluated(run_dir: Path, split: str, weights: str = "model") -> set[tuple[int, int]]:
    """(step, eval batches) already in the run's evaluations for this split and weights: what a watcher skips."""
    return {(r["step"], r["eval_batches"]) for r in read_records(run_dir / EVALS_FILE)
            if r.get(f"{split}_loss") is not None and r.get("source") == "nanopt eval"
            and r.get("weights", "model") == weights
            and isinstance(r.get("step"), int) and isinstance(r.get("eval_batches"), int)}


def finished_at(run_dir: Path) -> Optional[int]:
    """The step the run finished at, or None (rundirs.finished by its current config: a resumed run's is newer)."""
    train = (read_config(run_dir) or {}).get("train")
    summary = train and finished(run_dir, train["max_steps"], train.get("stop_at_target", False))
    return summary["steps"] if summary else None


def _check_watch(run_dir: Path) -> None:
    """A run's directory, or one a run is about to start in, holding only leases: the lock a starting trainer takes
    first (the watcher may start before it writes anything else) and a watcher's (_watch_lease names that one)."""
    if (run_dir / STATE_FILE).is_file():
        raise ConfigError(f"{run_dir} is a checkpoint; --watch takes its run directory ({run_dir.parent.parent}).")
    starting = run_dir.is_dir() and all(is_lease(p.name) for p in run_dir.iterdir())
    if not (run_dir.is_dir() and (is_run(run_dir) or starting)):
        raise ConfigError(f"{run_dir} is not a run directory (no {CONFIG_FILE}, metrics or checkpoints in it); "
                          f"--watch takes the directory a training run writes (runs/<name>), or an empty one a run "
                          f"is about to start in.")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise ConfigError("--watch runs in one process; start it without torchrun.")


def watch_run(run_dir: Path, evaluator: Evaluator, interval: float = 30.0, timeout: float = 0.0) -> int:
    """Evaluate each new complete checkpoint of a run directory until the run finishes and its last checkpoint is
    looked at, `timeout` seconds pass (0: never), or Ctrl-C; a last line says which. A damaged checkpoint, or one
    pruned while read, is skipped with a line saying why; what the evaluations hold is not done again."""
    run_dir = Path(run_dir)
    _check_watch(run_dir)
    lease = _watch_lease(run_dir)
    setup_logging(True)
    deadline = time.monotonic() + timeout if timeout else None
    handled: set[Path] = set()  # looked at in this session: evaluated, found done, or skipped
    count = 0
    try:
        done = evaluated(run_dir, evaluator.split, "ema" if evaluator.weights == "ema" else "model")
        print(f"watching {run_dir} for complete checkpoints every {interval:g} s "
              f"({len(done)} evaluation(s) already in {EVALS_FILE}; Ctrl-C to stop)", flush=True)
        while True:
            for ckpt in [c for c in checkpoint_dirs(run_dir) if c not in handled]:
                step = step_of(ckpt)
                try:
                    cfg = checkpoint_config(ckpt)
                    evaluator.start(cfg)
                    if (step, evaluator.batch_count(cfg)) not in done:
                        evaluator.run(ckpt)  # load() verifies the manifest and crc32s before reading weights
                        done.add((step, evaluator.batch_count(cfg)))
                        count += 1
                except Exception:
                    weights = (ckpt / MODEL_FILE).exists() or (ckpt / DCP_METADATA).exists()  # whole or sharded
                    problem = verify_checkpoint(ckpt) if weights and (ckpt / STATE_FILE).exists() else \
                        "it was removed while being read (pruned by checkpoint.keep)"
                    if problem is None:
                        raise  # not the checkpoint's fault: bad input or a bug, say so
                    print(f"skipped {ckpt}: {problem}", flush=True)  # the next checkpoint may be fine
                handled.add(ckpt)
            last = finished_at(run_dir)
            if last is not None and last in {step_of(c) for c in handled}:
                print(f"the run finished at step {last}; {count} checkpoint(s) evaluated by this watcher", flush=True)
                return 0
            if deadline is not None and time.monotonic() >= deadline:
                print(f"--timeout {timeout:g} s passed before the run finished; {count} checkpoint(s) evaluated "
                      f"(run the same command again to go on)", flush=True)
                return 0
            time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))
    except KeyboardInterrupt:
        print(f"stopped (Ctrl-C); {count} checkpoint(s) evaluated by this watcher", flush=True)
        return 0
    finally:
        lease.release()
        runtime.teardown()


def _watch_lease(run_dir: Path) -> DirLock:
    """The watcher's lease beside the trainer's: a second watcher would evaluate every checkpoint again, so it is
    refused, naming the first; a dead watcher's lease (the trainer's rules) is taken over."""
    lease = DirLock(run_dir, what="watched run", filename=WATCH_LOCK_FILE)
    try:
        return lease.acquire()
    except ConfigError as e:
        held = None
        with contextlib.suppress(ConfigError):
            held = lease.holder()
        if held is None:
            raise e from None  # not another watcher: the lease could not be written
        raise ConfigError(f"{run_dir} is already watched by {held.describe()} ({lease.path} is its lease); one "
                          f"watcher per run evaluates each checkpoint once. Let that watcher go on, or stop it and "
                          f"start this one; if it is gone for good, its lease expires {lease.expires_s:.0f} s after "
                          f"its last heartbeat (or delete {lease.path}).") from None

