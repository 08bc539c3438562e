"""`nanopt eval RUN_OR_CHECKPOINT [--split val|test] [--batches N]`: out-of-band evaluation (also under
torchrun), appended to the run's evals.jsonl; safe while the run is still training."""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from nanopt import data, runtime
from nanopt.config import DEVICES
from nanopt.errors import ConfigError
from nanopt.evaluation import EVALS, evaluate, split_batches, token_bytes_table
from nanopt.io import append_jsonl
from nanopt.loading import checkpoint_config, find_checkpoint, load
from nanopt.metrics import setup_logging
from nanopt.tokenizer import get_tokenizer


def main(argv: list[str]) -> int:
    """`nanopt eval RUN_OR_CHECKPOINT [--split val|test] [--batches N]`, also under torchrun."""
    p = argparse.ArgumentParser(prog="nanopt eval", description=(
        "Evaluate a checkpoint on the run's fixed validation (or test) set and append the result to the run's "
        f"{EVALS}. Safe while the run is still training; under torchrun the ranks share the batches."))
    p.add_argument("path", help="a run directory (its newest complete checkpoint) or a checkpoint directory")
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--batches", type=int, default=0, help="micro-batches in the evaluation set (default: eval.batches)")
    p.add_argument("--device", choices=DEVICES, default="auto")
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
        batches = split_batches(cfg, rt, data.data_dir(cfg, rt), args.split, batches_n)
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
            append_jsonl(loaded.run_dir / EVALS, record)
            print(f"{ckpt} (step {loaded.step}) | {args.split} loss {loss:.4f} | {args.split} bpb {bpb:.4f} | "
                  f"{record['eval_tokens']:,} tokens in {seconds:.1f} s on {rt.world_size} rank(s) | "
                  f"appended to {loaded.run_dir / EVALS}")
        runtime.teardown(rt, wait_for_peers=True)
    finally:
        runtime.teardown(rt)
    return 0
