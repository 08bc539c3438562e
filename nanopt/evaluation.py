"""Evaluation outside the step loop: out-of-band `nanopt eval`, the test split at the end of training, the
speedrun clock's target, and the `nanopt runs` leaderboard.

The evaluation set of a split is data.eval_batches: eval.batches × train.micro_batch_size windows of
train.seq_len + 1 tokens, chosen by a permutation seeded with eval.seed alone and dealt round-robin to
ranks, so it is the same tokens at every evaluation, in every run with the same (seq_len, micro_batch,
batches), on any world size. Loss is nats per token; bpb = total nats / ln 2 / total UTF-8 bytes of the
target tokens (special tokens count 0 bytes), so it compares across tokenizers.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch

from nanopt import data
from nanopt.config import Config, ConfigError
from nanopt.runtime import Runtime

log = logging.getLogger("nanopt")


def token_bytes_table(tokenizer, vocab_size: int, device: torch.device) -> torch.Tensor:
    """(vocab_size,) UTF-8 bytes per id; ids the tokenizer does not know (model vocab padding) count 0."""
    return torch.tensor(tokenizer.token_bytes() + [0] * (vocab_size - tokenizer.vocab_size), device=device)


def split_batches(cfg: Config, rt: Runtime, directory: Path, split: str, batches: int) -> Optional[list]:
    """This rank's share of a split's fixed evaluation set, or None when the split has no shards."""
    from nanopt.train import _open_split

    if not data.split_paths(directory, split):
        return None
    windows = _open_split(directory, split, cfg)
    return data.eval_batches(windows, cfg.train.micro_batch_size, batches, rt.rank, rt.world_size, cfg.eval.seed)


# Out-of-band results get their own file: the training process owns metrics.jsonl (a resume trims it past
# the checkpoint's step, and on a Modal Volume the trainer's commit of it would drop lines written by
# another container), so evaluations written there could be lost.
EVALS = "evals.jsonl"


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line with a single write() in O_APPEND mode, so concurrent `nanopt eval` runs
    never interleave their lines."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- inside training


def test_at_end(cfg: Config, rt: Runtime, model: torch.nn.Module, directory: Path, token_bytes: torch.Tensor,
                metrics, step: int) -> dict[str, float]:
    """The test split's loss and bpb after the final step ({} when off or when there are no test shards)."""
    from nanopt.train import evaluate

    if not cfg.eval.test_at_end:
        return {}
    batches = split_batches(cfg, rt, directory, "test", cfg.eval.batches)
    if batches is None:
        return {}
    loss, bpb = evaluate(model, batches, token_bytes, rt)
    metrics.log(step, {"test_loss": loss, "test_bpb": bpb})
    if rt.is_main:
        log.info("step %6d | test loss %.4f | test bpb %.4f", step, loss, bpb)
    return {"test_loss": loss, "test_bpb": bpb}


def check_target(cfg: Config, state, val_loss: float, rt: Runtime) -> None:
    """Record the first evaluation at or below train.target_val_loss in state.extra["target"] (step, tokens,
    training seconds: the speedrun clock); the loop stops on it when train.stop_at_target is set."""
    target = cfg.train.target_val_loss
    if target is None:
        return
    hit = state.extra.get("target")
    if hit is not None and hit["target_val_loss"] != target:  # resumed with another target: start over
        state.extra["target"] = None
    if state.extra.get("target") is None and val_loss <= target:
        state.extra["target"] = {"target_val_loss": target, "val_loss": val_loss, "step": state.step,
                                 "tokens": state.tokens_seen, "train_seconds": state.train_seconds}
        if rt.is_main:
            log.info("target val loss %.4f reached at step %d after %.1f s of training (%s tokens)",
                     target, state.step, state.train_seconds, f"{state.tokens_seen:,}")


def pause_follows(cfg: Config, step: int) -> bool:
    """True when an evaluation or checkpoint comes right after this step; the step's device work must
    then be waited for inside the training clock (train_seconds), or it would be billed to the pause."""
    every = (cfg.eval.every, cfg.checkpoint.every)
    return step >= cfg.train.max_steps or any(n and step % n == 0 for n in every)


def target_summary(cfg: Config, state) -> dict[str, Any]:
    """summary.json fields of the speedrun clock (nulls when the target was set but not reached)."""
    target = cfg.train.target_val_loss
    if target is None:
        return {}
    hit = state.extra.get("target") or {}
    return {"target_val_loss": target, "target_reached": bool(hit), "step_to_target": hit.get("step"),
            "tokens_to_target": hit.get("tokens"), "train_seconds_to_target": hit.get("train_seconds")}


# ---------------------------------------------------------------- nanopt eval


def eval_cli(argv: list[str]) -> int:
    """`nanopt eval RUN_OR_CHECKPOINT [--split val|test] [--batches N]`, also under torchrun."""
    from nanopt import runtime
    from nanopt.loading import checkpoint_config, find_checkpoint, load
    from nanopt.main import setup_logging
    from nanopt.tokenizer import get_tokenizer
    from nanopt.train import _data_dir, evaluate

    p = argparse.ArgumentParser(prog="nanopt eval", description=(
        "Evaluate a checkpoint on the run's fixed validation (or test) set and append the result to the run's "
        f"{EVALS}. Safe while the run is still training; under torchrun the ranks share the batches."))
    p.add_argument("path", help="a run directory (its newest complete checkpoint) or a checkpoint directory")
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--batches", type=int, default=0, help="micro-batches in the evaluation set (default: eval.batches)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--precision", choices=("run", "fp32", "bf16"), default="run",
                   help="autocast as the run trained (default) or force one")
    args = p.parse_args(argv)
    if args.batches < 0:
        raise ConfigError(f"--batches must be positive, got {args.batches}.")
    ckpt = find_checkpoint(args.path)
    run_cfg = checkpoint_config(ckpt)
    setup_logging(int(os.environ.get("RANK", "0") or 0) == 0)
    rt = None
    try:
        precision = run_cfg.train.precision if args.precision == "run" else args.precision
        rt = runtime.init(args.device, "bf16" if precision == "bf16" else "fp32", run_cfg.runtime.threads)
        # Rank 0's pick for everyone: a checkpoint the run writes meanwhile must not split the ranks.
        ckpt = Path(rt.gather_objects(str(ckpt))[0])
        loaded = load(ckpt)
        cfg = loaded.cfg
        model = loaded.model.to(rt.device)
        batches_n = args.batches or cfg.eval.batches
        batches = split_batches(cfg, rt, _data_dir(cfg, rt), args.split, batches_n)
        if batches is None:
            raise ConfigError(f"the run's data ({cfg.data.source}) has no `{args.split}_*.bin` shards; "
                              f"use --split val or prepare a {args.split} split.")
        token_bytes = token_bytes_table(get_tokenizer(cfg.data.tokenizer), cfg.model.vocab_size, rt.device)
        t0 = time.perf_counter()
        loss, bpb = evaluate(model, batches, token_bytes, rt)
        seconds = time.perf_counter() - t0
        if rt.is_main:
            record = {"step": loaded.step, "time": time.time(), f"{args.split}_loss": loss, f"{args.split}_bpb": bpb,
                      "source": "nanopt eval", "checkpoint": str(ckpt), "eval_batches": batches_n,
                      "eval_tokens": batches_n * cfg.train.micro_batch_size * cfg.train.seq_len,
                      "world_size": rt.world_size, "precision": precision}
            append_record(loaded.run_dir / EVALS, record)
            print(f"{ckpt} (step {loaded.step}) | {args.split} loss {loss:.4f} | {args.split} bpb {bpb:.4f} | "
                  f"{record['eval_tokens']:,} tokens in {seconds:.1f} s on {rt.world_size} rank(s) | "
                  f"appended to {loaded.run_dir / EVALS}")
        runtime.teardown(rt, wait_for_peers=True)
    finally:
        runtime.teardown(rt)
    return 0


# ---------------------------------------------------------------- nanopt runs


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def leaderboard(root: Path) -> list[dict[str, Any]]:
    """Every runs/*/summary.json, fastest to target first, then the rest by final validation loss."""
    rows = []
    for path in sorted(root.glob("*/summary.json")):
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        rows.append({**summary, "run": path.parent.name})  # the directory names the run
    reached = sorted((r for r in rows if r.get("train_seconds_to_target") is not None),
                     key=lambda r: (r.get("target_val_loss") or 0, r["train_seconds_to_target"]))
    rest = sorted((r for r in rows if r.get("train_seconds_to_target") is None),
                  key=lambda r: (r.get("final_val_loss") is None, r.get("final_val_loss") or 0))
    return reached + rest


def format_leaderboard(rows: list[dict[str, Any]]) -> str:
    header = ("run", "target", "to target (s)", "steps", "tokens", "final val", "val bpb", "test bpb",
              "train (s)", "tokens seen", "params", "hardware")
    table = [header]
    for r in rows:
        table.append((
            r["run"], _fmt(r.get("target_val_loss"), ".3f"), _fmt(r.get("train_seconds_to_target"), ".1f"),
            _fmt(r.get("step_to_target"), "d"), _fmt(r.get("tokens_to_target"), ","),
            _fmt(r.get("final_val_loss"), ".4f"), _fmt(r.get("final_val_bpb"), ".4f"), _fmt(r.get("test_bpb"), ".4f"),
            _fmt(r.get("train_seconds"), ".1f"), _fmt(r.get("tokens_seen"), ","), _fmt(r.get("params"), ","),
            f"{r.get('world_size', '?')}x {r.get('hardware') or r.get('device') or '?'}",
        ))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def runs_cli(argv: list[str]) -> int:
    """`nanopt runs [DIR]`: the leaderboard of DIR/*/summary.json (default runs/)."""
    p = argparse.ArgumentParser(prog="nanopt runs", description=(
        "Compare finished runs: time-to-target (training seconds, excluding eval/checkpoint/logging), final "
        "validation loss and bpb, tokens and parameters, from DIR/*/summary.json."))
    p.add_argument("dir", nargs="?", default="runs")
    args = p.parse_args(argv)
    root = Path(args.dir)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory; give the directory that holds the runs (default runs/).")
    rows = leaderboard(root)
    if not rows:
        print(f"no finished runs in {root} (a run writes summary.json when it ends)")
        return 0
    print(format_leaderboard(rows))
    return 0
