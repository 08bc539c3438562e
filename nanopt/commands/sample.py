"""`nanopt sample RUN_OR_CHECKPOINT --prompt ...`: continuations of a prompt from a trained model."""
from __future__ import annotations

import argparse
from operator import attrgetter
from typing import Any

from nanopt.config import DEVICES, config_from_dict
from nanopt.data.tokenizer import get_tokenizer
from nanopt.distributed import runtime
from nanopt.errors import ConfigError
from nanopt.evals.generate import sample_text
from nanopt.loading import WEIGHTS, load

# Each flag takes what its config key takes (type, bounds, UTF-8); one left out is the run's own (checked on load).
FLAGS = {"num_samples": "sample.num_samples", "max_new_tokens": "sample.max_new_tokens", "prompt": "sample.prompt",
         "temperature": "sample.temperature", "top_k": "sample.top_k", "seed": "run.seed"}


def _checked(flag: str, key: str, value: Any) -> Any:
    """A flag's value under its config key's rules (types, bounds, UTF-8), so a flag takes what the key takes."""
    section, name = key.split(".")
    try:
        return getattr(getattr(config_from_dict({section: {name: value}}, flag), section), name)
    except ConfigError as e:
        raise ConfigError(str(e) if str(e).startswith(flag) else f"{flag}: {e}") from None


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
    given = {dest: _checked(f"--{dest.replace('_', '-')}", key, getattr(args, dest)) for dest, key in FLAGS.items()
             if getattr(args, dest) is not None}
    for dest in ("num_samples", "max_new_tokens"):  # the config's 0 (no samples at the end of a run) asks nothing
        if given[dest] == 0:
            raise ConfigError(f"--{dest.replace('_', '-')} must be positive, got 0.")
    rt = runtime.init(args.device, "fp32")  # a clear error when --device cuda has no GPU behind it
    loaded = load(args.path, rt.device, weights=args.weights)
    cfg = loaded.cfg
    if not cfg.data.tokenizer:
        raise ConfigError(f"{loaded.source} has no tokenizer files and no nanopt.json naming one, so its token ids "
                          f"cannot be turned into text; save the tokenizer into that directory.")
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    v = {dest: given.get(dest, attrgetter(key)(cfg)) for dest, key in FLAGS.items()}
    samples = sample_text(loaded.model, tokenizer, v["prompt"], v["num_samples"], v["max_new_tokens"],
                          v["temperature"], v["top_k"], v["seed"], rt.device)
    print(f"--- {len(samples)} samples from {loaded.source} ({loaded.weights} weights), prompt {v['prompt']!r}, "
          f"temperature {v['temperature']}, top-k {v['top_k']}, seed {v['seed']} ---")
    for s in samples:
        print(s.strip())
        print("---")
    return 0
