"""`nanopt sample RUN_OR_CHECKPOINT --prompt ...`: continuations of a prompt from a trained model."""
from __future__ import annotations

import argparse
import math

from nanopt import runtime
from nanopt.config import DEVICES, SEED_LIMIT, is_utf8
from nanopt.errors import ConfigError
from nanopt.generate import sample_text
from nanopt.loading import WEIGHTS, load
from nanopt.tokenizer import get_tokenizer


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nanopt sample", description=(
        "Sample continuations of a prompt with the KV cache (prefill once, then one token per step)."))
    p.add_argument("path", help="a run directory, a checkpoint directory, or a Hugging Face Llama directory")
    p.add_argument("--prompt", default=None, help="default: the run's sample.prompt")
    p.add_argument("-n", "--num-samples", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the run's sample.temperature)")
    p.add_argument("--top-k", type=int, default=None, help="0 = no top-k filter (default: the run's sample.top_k)")
    p.add_argument("--seed", type=int, default=None, help="default: the run's run.seed")
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument("--weights", choices=WEIGHTS, default="run", help="the weights the run evaluated (its "
                   "eval.weights, default), the model's own, or the averaged ones (train.ema_decay)")
    args = p.parse_args(argv)
    for name in ("num_samples", "max_new_tokens"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}.")
    rt = runtime.init(args.device, "fp32")  # a clear error when --device cuda has no GPU behind it
    loaded = load(args.path, rt.device, weights=args.weights)
    cfg = loaded.cfg
    if not cfg.data.tokenizer:
        raise ConfigError(f"{loaded.source} has no tokenizer files and no nanopt.json naming one, so its token ids "
                          f"cannot be turned into text; save the tokenizer into that directory.")
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    temperature = cfg.sample.temperature if args.temperature is None else args.temperature
    top_k = cfg.sample.top_k if args.top_k is None else args.top_k
    if not (0 <= temperature < math.inf and top_k >= 0):  # NaN fails too
        raise ConfigError(f"--temperature and --top-k must be zero or positive, got {temperature} and {top_k}.")
    prompt = cfg.sample.prompt if args.prompt is None else args.prompt
    if not is_utf8(prompt):
        raise ConfigError(f"--prompt {prompt!r} holds bytes that are no UTF-8 text; give the prompt as text.")
    seed = cfg.run.seed if args.seed is None else args.seed
    if not 0 <= seed < SEED_LIMIT:
        raise ConfigError(f"--seed must be in [0, 2^32), as `run.seed` is; got {seed}.")
    samples = sample_text(loaded.model, tokenizer, prompt, args.num_samples, args.max_new_tokens, temperature,
                          top_k, seed, rt.device)
    print(f"--- {len(samples)} samples from {loaded.source} ({loaded.weights} weights), prompt {prompt!r}, "
          f"temperature {temperature}, "
          f"top-k {top_k}, seed {seed} ---")
    for s in samples:
        print(s.strip())
        print("---")
    return 0
