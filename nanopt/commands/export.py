"""`nanopt export RUN_OR_CHECKPOINT --out DIR [--dtype float32|bfloat16]`: a Hugging Face LlamaForCausalLM directory."""
from __future__ import annotations

import argparse

import torch

from nanopt.hf import export_model
from nanopt.loading import load


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nanopt export", description=(
        "Write a checkpoint as a Hugging Face LlamaForCausalLM directory (config.json, model.safetensors, "
        "tokenizer files when the run used a Hugging Face tokenizer)."))
    p.add_argument("path", help="a run directory (its newest checkpoint) or a checkpoint directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args(argv)
    loaded = load(args.path)
    meta = {"step": loaded.step, "source": str(loaded.source)}
    out = export_model(loaded.model, args.out, loaded.cfg.data.tokenizer, loaded.cfg, getattr(torch, args.dtype), meta)
    print(f"exported {loaded.source} (step {loaded.step}, {loaded.model.num_params():,} parameters) to {out}; "
          f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0

