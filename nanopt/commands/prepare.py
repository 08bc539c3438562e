"""`nanopt prepare`: documents -> tokenizer -> token shards (nanopt/data/prepare.py), resumable."""
from __future__ import annotations

import argparse
import sys
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Optional

from nanopt.config import load_config, parse_overrides, split_args
from nanopt.data.prepare import STATS, output_dir, prepare_with_retries, sample_documents, transient_errors
from nanopt.errors import EXIT_FAILED, ConfigError, debug_enabled
from nanopt.io import as_disk_full
from nanopt.training.metrics import setup_logging

USAGE = """usage: nanopt prepare [CONFIG.yaml | --config CONFIG.yaml] [--sample-documents N] [--verify] [--no-progress]
                      [--section.key=value ...]

Tokenise the dataset configured in the `prepare` section with data.tokenizer into token shards in
data.source (where training reads them). Running it again resumes an interrupted preparation and rebuilds
committed shards that were lost (missing, resized or replaced), to identical bytes.
  --verify            also read every shard and rebuild the corrupt ones (checksum mismatch); its last line
                      says how many shards and tokens it read and what it rebuilt
  --sample-documents N  tokenise the first N documents, print tokens per document and the documents the
                        budget needs (+25%); write nothing
  --no-progress       no progress bar
Overrides use dotted keys, e.g. --prepare.train_tokens=1e9 --prepare.workers=8.
One prepare at a time writes a directory (its lock.json; a second exits 2 naming the holder).
Exit status: 0 done, 1 failed (a full disk, a source that kept failing, a worker that died: every committed shard
is kept, so run it again to resume), 2 bad input.
"""


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    setup_logging(is_main=True)
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    p.add_argument("--sample-documents", type=int)
    p.add_argument("--verify", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    try:
        args, rest = p.parse_known_args(argv)
    except argparse.ArgumentError as e:  # one paragraph and exit 2, like every other bad input
        raise ConfigError(f"command line: {e}.") from None
    sample_n = args.sample_documents
    if sample_n is not None and sample_n <= 0:
        raise ConfigError(f"command line: `--sample-documents` takes a positive number of documents, got {sample_n}.")
    path, overrides = split_args(rest)
    cfg = load_config(path, parse_overrides(overrides))
    if sample_n is not None:
        e = sample_documents(cfg, sample_n)
        print(f"sampled {e['sampled_documents']} documents of {cfg.prepare.dataset}: "
              f"{e['mean_tokens_per_document']:.1f} tokens/document (median {e['median_tokens_per_document']:.0f}) "
              f"with {cfg.data.tokenizer}")
        if e["budget_tokens"]:
            print(f"budget {e['budget_tokens']:,} tokens (train+val+test) needs ~{e['documents_needed']:,} documents; "
                  f"with a 25% buffer: {e['documents_with_25pct_buffer']:,}")
        else:
            print("prepare.train_tokens is 0 (every document): no budget to size")
        return 0
    try:
        stats = prepare_with_retries(cfg, not args.no_progress, args.verify)
    except (BrokenProcessPool, *transient_errors()) as e:
        if debug_enabled() or getattr(e, "filename", None) is not None:  # a path, or a full disk: cli.run's paragraph
            raise
        if isinstance(e, BrokenProcessPool):
            what = "a tokenizer worker process died (killed for memory?)"
            hint = "with a lower `prepare.workers` or `prepare.batch_documents` if memory is short"
        else:
            what = f"the source kept failing ({type(e).__name__}: {e}) after {cfg.prepare.retries} retries"
            hint = "or raise `prepare.retries` for a flaky source"
        print(f"nanopt prepare: error: {what}. Every shard committed so far in {output_dir(cfg)} is kept; run the "
              f"same command again to resume from there, {hint}.", file=sys.stderr)
        return EXIT_FAILED
    except Exception as e:  # a full disk that a library raised as its own error (a tokenizer's or datasets' cache)
        full = as_disk_full(e, output_dir(cfg))
        if full is None or debug_enabled():
            raise
        print(f"nanopt prepare: error: {full}", file=sys.stderr)
        return EXIT_FAILED
    for name, s in stats["splits"].items():
        print(f"{name:>5}: {s['tokens']:,} tokens in {s['shards']} shards, {s['documents']:,} documents, "
              f"{s['mean_tokens_per_document']:.1f} mean / {s['median_tokens_per_document']:.0f} median "
              f"tokens/document")
    r = stats["this_run"]
    print(f"this run: {r['tokens']:,} tokens in {r['seconds']:.1f} s ({r['tokens_per_s'] or 0:,.0f} tokens/s); "
          f"wrote {output_dir(cfg) / STATS}")
    if args.verify:
        print(verified_line(r["verified"], output_dir(cfg)))
    return 0


def verified_line(verified: Optional[dict[str, Any]], out: Path) -> str:
    """What --verify checked: every shard committed before this run, read whole against its crc32."""
    if not verified or not verified["shards"]:
        return f"verify: no shards were committed in {out} before this run; those written now carry their checksums"
    rebuilt = verified["rebuilt"]
    found = f"{len(rebuilt)} lost or corrupt ({', '.join(rebuilt)}), rebuilt from the source to identical bytes"
    return (f"verify: {verified['shards']} shards ({verified['tokens']:,} tokens) in {out} read whole against their "
            f"crc32: {found if rebuilt else 'all OK'}")
