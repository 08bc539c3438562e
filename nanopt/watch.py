"""`nanopt eval`'s logic: a checkpoint evaluated on its run's fixed val or test set, the result appended to the
run's evaluations (rundirs.EVALS_FILE), safe while the run trains. Once (also under torchrun), or watching:
every new complete checkpoint of a run until it finishes (rundirs.finished, with the run's own config)."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from nanopt import data, runtime
from nanopt.config import Config
from nanopt.errors import ConfigError
from nanopt.evaluation import evaluate, split_batches, token_bytes_table
from nanopt.io import append_jsonl
from nanopt.loading import checkpoint_config, find_checkpoint, load
from nanopt.metrics import setup_logging
from nanopt.rundirs import (CONFIG_FILE, EVALS_FILE, MODEL_FILE, STATE_FILE, checkpoint_dirs, checkpoints_dir, finished,
                            is_run, read_config, read_records, step_of, verify_checkpoint)
from nanopt.runtime import Runtime
from nanopt.tokenizer import get_tokenizer


@dataclass
class EvalSpec:
    """`nanopt eval`'s options: what to evaluate on, and how."""

    split: str = "val"
    batches: int = 0  # micro-batches in the evaluation set; 0: the run's eval.batches
    device: str = "auto"
    precision: str = "run"  # autocast as the run trained, or fp32 / bf16

    def __post_init__(self) -> None:
        if self.batches < 0:
            raise ConfigError(f"--batches must be positive, got {self.batches}.")

    def precision_for(self, cfg: Config) -> str:
        return cfg.train.precision if self.precision == "run" else self.precision

    def runtime_for(self, cfg: Config) -> Runtime:
        return runtime.init(self.device, "bf16" if self.precision_for(cfg) == "bf16" else "fp32", cfg.runtime.threads)


class Evaluator:
    """Evaluates checkpoints of one run on one split; the evaluation batches are built once per batch count."""

    def __init__(self, spec: EvalSpec, rt: Runtime):
        self.spec, self.rt = spec, rt
        self.batches: dict[int, Any] = {}
        self.token_bytes: Optional[torch.Tensor] = None

    def batch_count(self, cfg: Config) -> int:
        return self.spec.batches or cfg.eval.batches

    def run(self, ckpt: Path) -> dict[str, Any]:
        """Evaluate one checkpoint, append its record to the run's evaluations (main rank) and print one line."""
        split, rt = self.spec.split, self.rt
        loaded = load(ckpt)
        cfg = loaded.cfg
        model = loaded.model.to(rt.device)
        batches_n = self.batch_count(cfg)
        if batches_n not in self.batches:
            batches = split_batches(cfg, rt, data.data_dir(cfg, rt), split, batches_n)
            if batches is None:
                raise ConfigError(f"the run's data ({cfg.data.source}) has no `{split}_*.bin` shards; "
                                  f"use --split val or prepare a {split} split.")
            self.batches[batches_n] = batches
        if self.token_bytes is None:
            self.token_bytes = token_bytes_table(get_tokenizer(cfg.data.tokenizer), cfg.model.vocab_size, rt.device)
        t0 = time.perf_counter()
        loss, bpb = evaluate(model, self.batches[batches_n], self.token_bytes, rt)
        seconds = time.perf_counter() - t0
        record = {"step": loaded.step, "time": time.time(), f"{split}_loss": loss, f"{split}_bpb": bpb,
                  "source": "nanopt eval", "checkpoint": str(ckpt), "eval_batches": batches_n,
                  "eval_tokens": batches_n * cfg.train.micro_batch_size * cfg.train.seq_len,
                  "world_size": rt.world_size, "precision": self.spec.precision_for(cfg)}
        if rt.is_main:
            append_jsonl(loaded.run_dir / EVALS_FILE, record)
            print(f"{ckpt} (step {loaded.step}) | {split} loss {loss:.4f} | {split} bpb {bpb:.4f} | "
                  f"{record['eval_tokens']:,} tokens in {seconds:.1f} s on {rt.world_size} rank(s) | "
                  f"appended to {loaded.run_dir / EVALS_FILE}", flush=True)
        return record


def evaluate_checkpoint(path: str | Path, spec: EvalSpec) -> dict[str, Any]:
    """The newest complete checkpoint of a run directory, or a checkpoint, evaluated once."""
    ckpt = find_checkpoint(path)
    run_cfg = checkpoint_config(ckpt)
    setup_logging(int(os.environ.get("RANK", "0") or 0) == 0)
    rt = None
    try:
        rt = spec.runtime_for(run_cfg)
        # Rank 0's pick for everyone: a checkpoint the run writes meanwhile must not split the ranks.
        ckpt = Path(rt.gather_objects(str(ckpt))[0])
        record = Evaluator(spec, rt).run(ckpt)
        runtime.teardown(rt, wait_for_peers=True)
    finally:
        runtime.teardown(rt)
    return record


# ---------------------------------------------------------------- watching a training run
def evaluated(run_dir: Path, split: str) -> set[tuple[int, int]]:
    """(step, eval batches) already in the run's evaluations for this split: what a restarted watcher skips."""
    return {(r["step"], r["eval_batches"]) for r in read_records(run_dir / EVALS_FILE)
            if r.get(f"{split}_loss") is not None and r.get("source") == "nanopt eval"
            and isinstance(r.get("step"), int) and isinstance(r.get("eval_batches"), int)}


def finished_at(run_dir: Path) -> Optional[int]:
    """The step the run finished at, or None while it trains: rundirs.finished with the run's own config (a
    run resumed with more steps has a config that says so, so its earlier summary no longer counts)."""
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


def _check_watch(run_dir: Path, interval: float, timeout: float) -> None:
    """A run's directory, or an empty one a run is about to start in (the watcher may start first); finite
    times (time.sleep(nan) and sleep(inf) raise, a nan deadline is never reached), the interval above 0."""
    if not (math.isfinite(interval) and interval > 0) or not (math.isfinite(timeout) and timeout >= 0):
        raise ConfigError(f"--interval must be a number of seconds above 0 and --timeout one at least 0 (0 = never), "
                          f"got {interval} and {timeout}; e.g. --interval 30 --timeout 3600.")
    if (run_dir / STATE_FILE).is_file():
        raise ConfigError(f"{run_dir} is a checkpoint; --watch takes its run directory ({run_dir.parent.parent}).")
    if not (run_dir.is_dir() and (is_run(run_dir) or not any(run_dir.iterdir()))):
        raise ConfigError(f"{run_dir} is not a run directory (no {CONFIG_FILE}, metrics or checkpoints in it); "
                          f"--watch takes the directory a training run writes (runs/<name>), or an empty one a run "
                          f"is about to start in.")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise ConfigError("--watch runs in one process; start it without torchrun.")


def watch_run(run_dir: Path, spec: EvalSpec, interval: float = 30.0, timeout: float = 0.0) -> int:
    """Evaluate every new complete checkpoint of a run directory as it appears, until the run finishes and its
    last checkpoint is looked at, `timeout` seconds pass (0: never), or Ctrl-C; a last line says which.
    Read-only: checkpoints are renamed into place whole, and load() verifies each (manifest, crc32); one that
    is damaged, or pruned while read, is skipped with a line saying why. What the run's evaluations already
    hold is not done again, so a restarted watcher picks up where the last one stopped."""
    run_dir = Path(run_dir)
    _check_watch(run_dir, interval, timeout)
    setup_logging(True)
    deadline = time.monotonic() + timeout if timeout else None
    done = evaluated(run_dir, spec.split)
    handled: set[Path] = set()  # looked at in this session: evaluated, found done, or skipped
    steps_handled: set[int] = set()
    evaluator: Optional[Evaluator] = None
    count = 0
    print(f"watching {run_dir} for complete checkpoints every {interval:g} s "
          f"({len(done)} evaluation(s) already in {EVALS_FILE}; Ctrl-C to stop)", flush=True)
    try:
        while True:
            for ckpt in [c for c in checkpoint_dirs(checkpoints_dir(run_dir)) if c not in handled]:
                step = step_of(ckpt)
                try:
                    cfg = checkpoint_config(ckpt)
                    evaluator = evaluator or Evaluator(spec, spec.runtime_for(cfg))
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
                print(f"--timeout {timeout:g} s passed before the run finished; {count} checkpoint(s) evaluated "
                      f"(run the same command again to go on)", flush=True)
                return 0
            time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))
    except KeyboardInterrupt:
        print(f"stopped (Ctrl-C); {count} checkpoint(s) evaluated by this watcher", flush=True)
        return 0
    finally:
        runtime.teardown(evaluator.rt if evaluator else None)
