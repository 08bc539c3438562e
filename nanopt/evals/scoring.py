"""THE continuation scorer: each continuation token's log-probability given its context and whether it is the greedy
prediction (batched by length, logits only where scored), as nanochat's forward_model serves every task type.
lm-eval's requests (tasks.py) sum them, CORE (core_benchmark.py) takes their mean."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from nanopt.distributed.runtime import Runtime, static_shapes
from nanopt.evals.generate import padded_length
from nanopt.recipe.model import Llama

Request = tuple[list[int], list[int]]  # (context ids, continuation ids)
TokenScores = tuple[torch.Tensor, torch.Tensor]  # a continuation's tokens: log-probabilities, is-greedy flags


def _windows(requests: list[Request], max_len: int) -> list[tuple[list[int], int]]:
    """Each request as (context + continuation cropped on the left to max_len + 1 tokens, its last n scored)."""
    wholes = [((context + continuation)[-(max_len + 1):], len(continuation)) for context, continuation in requests]
    return [(whole, min(n, len(whole) - 1)) for whole, n in wholes]


def _batches(order: list[int], lengths: list[int], batch_size: int, max_tokens: int) -> list[list[int]]:
    """Requests, longest first (little padding), in batches of at most batch_size rows and max_tokens tokens."""
    out: list[list[int]] = []
    for i in order:
        if out and len(out[-1]) < batch_size and lengths[out[-1][0]] * (len(out[-1]) + 1) <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def continuation_scores(model: Llama, requests: list[Request], rt: Runtime, batch_size: int = 32,
                        max_tokens: int = 16384) -> list[tuple[float, bool]]:
    """(sum of log-probabilities of the continuation given its context, whether greedy decoding would have
    produced it) per request, in request order. An empty continuation (BPE can merge a short continuation into
    the context's last token) scores (0.0, True), as in the harness's own models."""
    return [(lp.sum().item(), bool(greedy.all())) for lp, greedy in token_scores(model, requests, rt, batch_size,
                                                                                   max_tokens)]


@torch.no_grad()  # not inference_mode: XLA tensors refuse it
def token_scores(model: Llama, requests: list[Request], rt: Runtime, batch_size: int = 32,
                 max_tokens: int = 16384) -> list[TokenScores]:
    """Each request's TokenScores, in request order, on the host."""
    max_len = model.rope_cos.shape[0]
    windows = _windows(requests, max_len)
    lengths = [len(w) - 1 for w, _ in windows]
    order = sorted(range(len(windows)), key=lambda i: -lengths[i])
    results: list[Optional[TokenScores]] = [None] * len(windows)
    for batch in _batches(order, lengths, batch_size, max_tokens):
        for i, scored in zip(batch, _score_batch(model, [windows[i] for i in batch], rt, max_len)):
            results[i] = scored
    return results  # type: ignore[return-value]


def _score_batch(model: Llama, windows: list[tuple[list[int], int]], rt: Runtime,
                 max_len: int) -> list[TokenScores]:
    device, static = rt.device, static_shapes(rt.device)
    B, T = len(windows), max(len(w) - 1 for w, _ in windows)
    if static:
        T = padded_length(T, max_len)
    x = torch.zeros(B, T, dtype=torch.long)  # B T, right-padded: causal attention never looks at the padding
    picks, targets, counts = [], [], []  # flat positions (b * T + t) whose logits score a continuation token
    for b, (whole, n) in enumerate(windows):
        x[b, : len(whole) - 1] = torch.tensor(whole[:-1])
        picks += range(b * T + len(whole) - 1 - n, b * T + len(whole) - 1)
        targets += whole[len(whole) - n:]  # position t predicts token t + 1; n may be 0
        counts.append(n)
    pick = torch.tensor(picks)
    if static:  # a fixed number of picked rows per bucket: one compiled graph per (B, T) bucket
        pick = F.pad(pick, (0, padded_length(len(picks), B * T) - len(picks)))
    with rt.autocast():
        h = model.hidden(x.to(device)).flatten(0, 1)  # B*T C
        logits = model.logits(h.index_select(0, pick.to(device)))  # N C @ C V -> N V
    logits = logits.float()[: len(picks)]  # N V
    target = torch.tensor(targets, device=logits.device)
    # cross_entropy fuses log-softmax and the pick: no second N x V tensor written and read back
    token_lp = -F.cross_entropy(logits, target, reduction="none").cpu()  # N
    greedy = (logits.argmax(-1) == target).cpu()  # N
    return list(zip(token_lp.split(counts), greedy.split(counts)))
