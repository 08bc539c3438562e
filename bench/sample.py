"""KV-cache decoding vs recomputing the whole context for every new token, same model, same tokens.

    python bench/sample.py [--new-tokens 256] [--prompt-tokens 16] [--batch 1] [--repeats 3]

The model is the embedded default's shape (configs/tiny.yaml: 4 layers, 256 wide, GQA 8/4 heads, byte
vocabulary) with a context of prompt + new tokens; fp32 on CPU (CUDA when present). Both paths decode
greedily and must produce identical tokens (checked here); the printed ratio is full/cached time.
"""
from __future__ import annotations

from typing import Optional

from _common import alternate, banner, command, median, parser, spread

import torch  # noqa: E402  (after _common puts the repo on sys.path)

from nanopt.config import load_config  # noqa: E402
from nanopt.evals.generate import generate  # noqa: E402
from nanopt.recipe.model import build_model  # noqa: E402


@torch.no_grad()
def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__file__, __doc__)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_config(None).model
    cfg.max_seq_len = args.prompt_tokens + args.new_tokens
    torch.manual_seed(0)
    model = build_model(cfg, device).eval()
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_tokens), device=device)
    banner("KV-cache generation vs full recomputation", {
        "model": f"{model.num_params():,} params, {cfg.n_layers} layers, dim {cfg.dim}, heads "
                 f"{cfg.n_heads}/{cfg.n_kv_heads}",
        "decode": f"batch {args.batch}, prompt {args.prompt_tokens} + {args.new_tokens} new tokens, greedy, fp32 on "
                  f"{device.type}",
    }, command(__file__, argv))
    cached = generate(model, prompt, args.new_tokens, temperature=0.0, use_cache=True)
    full = generate(model, prompt, args.new_tokens, temperature=0.0, use_cache=False)
    assert torch.equal(cached, full), "the cached and recomputed tokens differ"
    times = alternate({
        "kv cache": lambda: generate(model, prompt, args.new_tokens, temperature=0.0, use_cache=True),
        "full recompute": lambda: generate(model, prompt, args.new_tokens, temperature=0.0, use_cache=False),
    }, repeats=args.repeats, warmup=0, device=device)
    tokens = args.batch * args.new_tokens
    for name, ts in times.items():
        print(f"{name:15s}: {median(ts):7.3f} s  ({tokens / median(ts):8.1f} tok/s, {spread(ts)})")
    print(f"\nspeed-up of the KV cache: {median(times['full recompute']) / median(times['kv cache']):.1f}x "
          f"(identical tokens)")


if __name__ == "__main__":
    main()
