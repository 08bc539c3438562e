"""THE decode loop: prefill the prompt once, then one token per step on the KV cache (one padded shape on XLA),
until max_new_tokens or a stop condition (lm-eval's greedy generate_until stops at its strings)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from nanopt.distributed.runtime import static_shapes
from nanopt.recipe.model import Llama

Stop = Optional[Callable[[list[int]], bool]]  # stop(row 0's new ids) true: the last of them ends the decoding


@torch.no_grad()
def generate(model: Llama, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             generator: Optional[torch.Generator] = None, use_cache: bool = True, stop: Stop = None,
             padded: Optional[bool] = None) -> torch.Tensor:
    """prompt: B T ids -> B (T + max_new_tokens) ids, fewer where stop turns true first. temperature 0 = greedy.
    use_cache=False recomputes the whole context every token (the reference the cache must match). padded (the
    default on XLA, where a cache growing by one is a new graph per token): every forward sees one B×L host buffer,
    prompt + new tokens rounded up to a power of two, zero-padded on the right (causal attention hides it), and
    reads the last real position through a device index: one compiled graph serves the whole bucket."""
    B, T = prompt.shape
    total = _fits(model, T + max_new_tokens)
    padded = use_cache and static_shapes(prompt.device) if padded is None else padded
    device = model.embed.weight.device if padded else prompt.device
    out = torch.zeros(B, padded_length(total, model.rope_cos.shape[0]) if padded else total, dtype=torch.long,
                      device="cpu" if padded else device)  # B L
    out[:, :T] = prompt
    caches = model.new_caches(B, total, device, model.embed.weight.dtype) if use_cache and not padded else None
    for pos in range(T, total):
        if padded:  # B L C -> B 1 C at the position whose logits predict token `pos`
            h = model.hidden(out.to(device)).index_select(1, torch.tensor([pos - 1]).to(device))
            logits = model.logits(h)[:, 0].cpu()
        elif caches is not None:  # the prompt prefilled once, then one token a step
            last = (prompt, 0) if pos == T else (out[:, pos - 1 : pos], pos - 1)
            logits = model(last[0], caches=caches, start_pos=last[1])[:, -1]  # B V
        else:
            logits = model(out[:, :pos])[:, -1]
        out[:, pos] = _pick(logits, temperature, top_k, generator)
        if stop is not None and stop(out[0, T : pos + 1].tolist()):
            return out[:, : pos + 1].to(prompt.device)
    return out[:, :total].to(prompt.device)


def generate_padded(model: Llama, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                    top_k: int = 0, generator: Optional[torch.Generator] = None, stop: Stop = None) -> torch.Tensor:
    """generate's static-shape path on any device (how XLA's is checked on a CPU)."""
    return generate(model, prompt, max_new_tokens, temperature, top_k, generator, stop=stop, padded=True)


def padded_length(n: int, limit: int) -> int:
    """n rounded up to a power of two (at least 16, at most limit): compiled devices see few shapes."""
    return min(limit, max(16, 1 << (n - 1).bit_length()))


def _fits(model: Llama, total: int) -> int:
    if total > (limit := model.rope_cos.shape[0]):
        raise ValueError(f"prompt + new tokens = {total} exceeds the model's max_seq_len {limit}")
    return total


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
    """n continuations of `prompt` as text (the prompt included), each max_new_tokens long. Past the model's
    context (max_seq_len) the window slides: the cache is rebuilt from the last half of the context."""
    ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(prompt)
    limit = model.rope_cos.shape[0]
    out = torch.tensor([ids] * n, dtype=torch.long, device=device)  # n T
    g = torch.Generator().manual_seed(seed)
    new_tokens = 0
    while new_tokens < max_new_tokens:
        keep = out.shape[1] if out.shape[1] < limit else max(1, limit // 2)
        context = out[:, -keep:]
        chunk = min(max_new_tokens - new_tokens, limit - keep)
        step = generate(model, context, chunk, temperature, top_k, generator=g)[:, keep:]  # n chunk
        out = torch.cat([out, step], dim=1)
        new_tokens += chunk
    return [tokenizer.decode(row.tolist()) for row in out]
