"""data.packing: bos_bestfit throughput: packed training tokens per second on one core.

A synthetic corpus with realistic document lengths (lognormal, mean ~1000 tokens, a GPT-2-sized vocabulary,
a BOS before each document) is written as shards with shards.write_shard to a temp dir; the packed loader
(nanopt/training/packing.py) then serves steps of micro_batch x (seq_len + 1) rows on one thread: the plan (best fit from
the buffer by bisection) and the rows' tokens read from the memmapped shards. Medians of alternating repeats.
It is a benchmark, not a test. The goal is >= 1M tokens/s per core (a GPU step of ~0.5M tokens takes ~0.2 s).

    python bench/packing_speed.py [--tokens 20000000] [--seq-len 2048] [--micro-batch 16] [--steps 30]
    python bench/packing_speed.py --tokens 20000 --seq-len 64 --micro-batch 2 --buffer 16 --steps 2 --repeats 1
        # toy sizes, what the test suite runs
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import _common as C  # importing _common puts REPO on sys.path: nanopt from this checkout
import numpy as np
import torch

from nanopt.data import shards  # noqa: E402
from nanopt.training import packing  # noqa: E402

VOCAB, BOS = 50257, 50256


def write_corpus(directory: Path, tokens: int, mean: float, n_shards: int, seed: int) -> list[Path]:
    """Lognormal document lengths (sigma 1, mean `mean`), random ids, cut into shards mid-document as prepare does."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    lengths = np.maximum(2, rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, int(tokens / mean * 1.2)))
    ends = np.cumsum(lengths.astype(np.int64))
    ends = ends[ends < tokens]
    stream = rng.integers(0, BOS, tokens, dtype=np.uint16)
    stream[np.append(0, ends)] = BOS
    return [shards.write_shard(directory / f"train_{i:06d}.bin", part, VOCAB)
            for i, part in enumerate(np.array_split(stream, n_shards))]


def time_steps(loader: packing.PackedLoader, steps: int, seq_len: int) -> float:
    """Seconds per packed training token over `steps` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        batches = loader.micro_batches(seq_len=seq_len)
    seconds = time.perf_counter() - t0
    return seconds / (steps * sum(x.numel() for x, _ in batches))


def main(argv: Optional[list[str]] = None) -> None:
    ap = C.parser(__file__, __doc__)
    ap.add_argument("--tokens", type=int, default=20_000_000)
    ap.add_argument("--mean-doc", type=float, default=1000.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--buffer", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measure(args, C.command(__file__, argv))
    finally:
        torch.set_num_threads(threads)  # as it was: a test calls main() in its own process


def measure(args: argparse.Namespace, cmd: str) -> None:
    """The corpus written, the BOS index built and timed, then the packed steps, alternating repeats."""
    print(f"# bos_bestfit packing speed: {cmd}")
    print(f"cpu     : {C.cpu_model()} | os.cpu_count {os.cpu_count()} | torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_corpus(Path(tmp), args.tokens, args.mean_doc, args.shards, seed=0)
        maps = [shards.open_shard(p) for p in paths]
        t0 = time.perf_counter()
        docs = packing.Documents(maps, BOS)
        index_s = time.perf_counter() - t0
        print(f"corpus  : {args.tokens:,} tokens in {len(paths)} shards, {len(docs.lengths):,} documents, mean "
              f"{docs.lengths.mean():.0f} / median {np.median(docs.lengths):.0f} tokens; BOS index built in "
              f"{index_s:.2f} s ({args.tokens / index_s / 1e6:.0f}M tokens/s)")
        loader = packing.PackedLoader(docs, args.micro_batch, 0, 1, args.accum, 0, args.seq_len, args.buffer)
        time_steps(loader, 2, args.seq_len)  # warm-up: the buffer fills, pages come in
        per_token = [time_steps(loader, args.steps, args.seq_len) for _ in range(args.repeats)]
        rate = 1 / statistics.median(per_token)
        print(f"rows    : seq_len {args.seq_len}, {args.micro_batch} x {args.accum} rows per step, buffer "
              f"{args.buffer}; cropped share {loader.packer.cropped_share:.1%}, epoch {loader.packer.epoch}")
        print(f"speed   : {rate / 1e6:.2f}M packed tokens/s on one core (median of {args.repeats} x {args.steps} "
              f"steps; spread {1 / max(per_token) / 1e6:.2f}-{1 / min(per_token) / 1e6:.2f}M); goal >= 1M")


if __name__ == "__main__":
    main()
