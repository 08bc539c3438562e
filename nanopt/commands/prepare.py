"""`nanopt prepare [CONFIG] [--sample-documents N] [--no-progress] [--section.key=value ...]`: documents ->
tokenizer -> token shards (nanopt/prepare.py), resumable."""
from __future__ import annotations

import sys
from concurrent.futures.process import BrokenProcessPool
from typing import Optional

from nanopt.config import load_config, parse_overrides, split_args
from nanopt.errors import ConfigError, debug_enabled
from nanopt.metrics import setup_logging
from nanopt.prepare import STATS, output_dir, prepare_with_retries, sample_documents, transient_errors


USAGE = """usage: nanopt prepare [CONFIG.yaml | --config CONFIG.yaml] [--sample-documents N] [--verify] [--no-progress]
                      [--section.key=value ...]

Tokenise the dataset configured in the `prepare` section with data.tokenizer into token shards in
data.source (where training reads them). Running it again resumes an interrupted preparation and rebuilds
committed shards that were lost (missing, resized or replaced), to identical bytes.
  --verify            also read every shard and rebuild the corrupt ones (checksum mismatch)
  --sample-documents N  tokenise the first N documents, print tokens per document and the documents the
                        budget needs (+25%); write nothing
  --no-progress       no progress bar
Overrides use dotted keys, e.g. --prepare.train_tokens=1e9 --prepare.workers=8.
"""


def _take_flags(argv: list[str]) -> tuple[Optional[int], bool, bool, list[str]]:
    """(--sample-documents N, progress bar?, --verify?, the remaining arguments for config.split_args)."""
    sample_n, progress, verify, rest = None, True, False, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--no-progress":
            progress = False
        elif arg == "--verify":
            verify = True
        elif arg == "--sample-documents" or arg.startswith("--sample-documents="):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            else:
                value = ""
            try:
                sample_n = int(value)
            except ValueError:
                sample_n = 0
            if sample_n <= 0:
                raise ConfigError(f"command line: `--sample-documents` takes a positive number of documents, got {value!r}.")
        else:
            rest.append(arg)
        i += 1
    return sample_n, progress, verify, rest


def main(argv: list[str]) -> int:
    """`nanopt prepare [--config] CONFIG [--sample-documents N] [--no-progress] [--section.key=value ...]`."""
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    setup_logging(is_main=True)
    sample_n, progress, verify, rest = _take_flags(argv)
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
        stats = prepare_with_retries(cfg, progress, verify)
    except (BrokenProcessPool, *transient_errors()) as e:
        if debug_enabled():
            raise
        if isinstance(e, BrokenProcessPool):
            what = "a tokenizer worker process died (killed for memory?)"
            hint = "with a lower `prepare.workers` or `prepare.batch_documents` if memory is short"
        else:
            what = f"the source kept failing ({type(e).__name__}: {e}) after {cfg.prepare.retries} retries"
            hint = "or raise `prepare.retries` for a flaky source"
        print(f"nanopt prepare: error: {what}. Every shard committed so far in {output_dir(cfg)} is kept; run the "
              f"same command again to resume from there, {hint}.", file=sys.stderr)
        return 1
    for name, s in stats["splits"].items():
        print(f"{name:>5}: {s['tokens']:,} tokens in {s['shards']} shards, {s['documents']:,} documents, "
              f"{s['mean_tokens_per_document']:.1f} mean / {s['median_tokens_per_document']:.0f} median tokens/document")
    run_ = stats["this_run"]
    print(f"this run: {run_['tokens']:,} tokens in {run_['seconds']:.1f} s ({run_['tokens_per_s'] or 0:,.0f} tokens/s); "
          f"wrote {output_dir(cfg) / STATS}")
    return 0
