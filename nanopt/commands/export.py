"""`nanopt export RUN_OR_CHECKPOINT --out DIR [--dtype float32|bfloat16] [--force]`: a Hugging Face LlamaForCausalLM
directory."""
from __future__ import annotations

import argparse
import sys

import torch

from nanopt.errors import EXIT_FAILED, DiskFull, debug_enabled
from nanopt.hf import check_export_target, export_model
from nanopt.loading import WEIGHTS, load


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nanopt export", description=(
        "Write a checkpoint as a Hugging Face LlamaForCausalLM directory (config.json, model.safetensors, "
        "tokenizer files when the run used a Hugging Face tokenizer)."), epilog=(
        "Exit status: 0 exported, 1 failed (a full disk: nothing of the new export is left, DIR keeps what it "
        "held), 2 bad input (DIR is a file, or holds another model's files without --force)."))
    p.add_argument("path", help="a run directory (its newest checkpoint) or a checkpoint directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--weights", choices=WEIGHTS, default="run", help="the weights the run evaluated (its "
                   "eval.weights, default), the model's own, or the averaged ones (train.ema_decay); nanopt.json "
                   "says which")
    p.add_argument("--force", action="store_true", help=(
        "replace another model's files in DIR: every model file there is removed or replaced by the new "
        "export's; other files are kept"))
    args = p.parse_args(argv)
    check_export_target(args.out, args.force)  # before the checkpoint loads: a wrong --out fails at once
    loaded = load(args.path, weights=args.weights)
    meta = {"step": loaded.step, "source": str(loaded.source), "weights": loaded.weights,
            **({"averaged_from": loaded.averaged_from} if loaded.averaged_from else {})}
    dtype = getattr(torch, args.dtype)
    try:
        out = export_model(loaded.model, args.out, loaded.cfg.data.tokenizer, loaded.cfg, dtype, meta, args.force)
    except DiskFull as e:
        if debug_enabled():
            raise
        free = "free space unknown" if e.free_bytes is None else f"{_gib(e.free_bytes)} free"
        print(f"nanopt export: error: no space left on {e.device} writing {e.path} ({free}; the weights need about "
              f"{_gib(loaded.model.num_params() * dtype.itemsize)}). No part of the new export is left in "
              f"{args.out}, and a model that was there is untouched. Free space on that device, or choose another "
              f"--out, and run the same command again.", file=sys.stderr)
        return EXIT_FAILED
    print(f"exported {loaded.source} (step {loaded.step}, {loaded.weights} weights, "
          f"{loaded.model.num_params():,} parameters) to {out}; "
          f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0
