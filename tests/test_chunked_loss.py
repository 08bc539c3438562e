"""The chunked cross-entropy (Llama._chunked_loss) is the same loss and the same gradients as full logits."""
from __future__ import annotations

import pytest
import torch

from nanopt.config import ModelConfig
from nanopt.model import build_model


def _loss_and_grads(model, idx, targets, chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    model.loss_chunk_tokens = chunk
    loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [True, False])
def test_chunked_loss_and_every_gradient_match_the_full_logits_path(tie):
    torch.manual_seed(0)
    vocab = 4099  # large next to the model, and chunks that do not divide the token count
    cfg = ModelConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=65,
                      tie_embeddings=tie)
    model = build_model(cfg)
    idx = torch.randint(0, vocab, (2, 65))
    targets = torch.randint(0, vocab, (2, 65))
    targets[0, :20] = -100  # ignored positions (e.g. padding) must not count in the mean
    targets[1, 50:] = -100

    full_loss, full_grads = _loss_and_grads(model, idx, targets, chunk=10**9)  # 130 tokens in one piece
    reference = torch.nn.functional.cross_entropy(model(idx).reshape(-1, vocab).float(), targets.reshape(-1))
    assert torch.allclose(full_loss, reference, atol=1e-6)
    for chunk in (16, 47, 0):  # 0: `train.loss_chunk_tokens: 0`, never chunk
        loss, grads = _loss_and_grads(model, idx, targets, chunk)
        assert torch.allclose(loss, full_loss, atol=1e-6, rtol=1e-6)
        assert grads.keys() == full_grads.keys()
        for name, g in grads.items():
            assert torch.allclose(g, full_grads[name], atol=1e-7, rtol=1e-5), name
        assert all(g.abs().sum() > 0 for g in full_grads.values())  # every parameter takes part
