"""Sampling with a KV cache: prefill the prompt once, then one token per step."""
from __future__ import annotations

from typing import Optional

import torch

from nanopt.model import Llama


@torch.no_grad()
def generate(
    model: Llama, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
    generator: Optional[torch.Generator] = None, use_cache: bool = True,
) -> torch.Tensor:
    """prompt: B T ids -> B (T + max_new_tokens) ids. temperature 0 = greedy.

    use_cache=False recomputes the whole context every token (the reference the cache must match).
    """
    B, T = prompt.shape
    total = T + max_new_tokens
    limit = model.rope_cos.shape[0]
    if total > limit:
        raise ValueError(f"prompt + new tokens = {total} exceeds the model's max_seq_len {limit}")
    device = prompt.device
    out = torch.empty(B, total, dtype=torch.long, device=device)
    out[:, :T] = prompt
    caches = model.new_caches(B, total, device, model.embed.weight.dtype) if use_cache else None
    logits = model(prompt, caches=caches, start_pos=0)[:, -1]  # B V
    for pos in range(T, total):
        out[:, pos] = _pick(logits, temperature, top_k, generator)
        if pos + 1 == total:
            break
        if use_cache:
            logits = model(out[:, pos : pos + 1], caches=caches, start_pos=pos)[:, -1]
        else:
            logits = model(out[:, : pos + 1])[:, -1]
    return out


def _pick(logits: torch.Tensor, temperature: float, top_k: int, generator: Optional[torch.Generator]) -> torch.Tensor:
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def sample_text(model: Llama, tokenizer, prompt: str, n: int, max_new_tokens: int, temperature: float,
                top_k: int, seed: int, device: torch.device) -> list[str]:
    """n continuations of `prompt` as text (the prompt included)."""
    ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(prompt)
    limit = model.rope_cos.shape[0]
    ids = ids[-max(1, limit - max_new_tokens):]
    max_new = min(max_new_tokens, limit - len(ids))
    x = torch.tensor([ids] * n, dtype=torch.long, device=device)
    g = torch.Generator().manual_seed(seed)
    out = generate(model, x, max_new, temperature, top_k, generator=g)
    return [tokenizer.decode(row.tolist()) for row in out]
