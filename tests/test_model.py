"""The Llama model: shapes, init, parameter count, causality, attention backends agree."""
from __future__ import annotations

import math

import pytest
import torch

from nanopt.attention import eager, sdpa
from nanopt.config import ModelConfig, configs_dir, load_config
from nanopt.model import Llama, build_model, rope_frequencies


def small(**kw) -> ModelConfig:
    base = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


def test_logits_shape_and_loss_is_scalar():
    torch.manual_seed(0)
    model = build_model(small())
    idx = torch.randint(0, 97, (3, 17))
    assert model(idx).shape == (3, 17, 97)
    loss = model(idx, torch.randint(0, 97, (3, 17)))
    assert loss.shape == ()


def test_loss_at_init_is_about_ln_vocab():
    torch.manual_seed(0)
    cfg = small(vocab_size=512)
    model = build_model(cfg)
    idx = torch.randint(0, 512, (4, 64))
    targets = torch.randint(0, 512, (4, 64))
    loss = model(idx, targets).item()
    assert abs(loss - math.log(512)) < 0.1, loss


def test_llama_3_2_1b_parameter_count():
    cfg = load_config(configs_dir() / "1b.yaml").model
    with torch.device("meta"):
        model = Llama(cfg)
    assert model.num_params() == 1_235_814_400


def test_tied_head_is_the_embedding_after_meta_materialisation():
    model = build_model(small(tie_embeddings=True))
    assert model.lm_head.weight is model.embed.weight
    untied = build_model(small(tie_embeddings=False))
    assert untied.num_params() == model.num_params() + 97 * 64


def test_init_weights_follows_its_docstring():
    torch.manual_seed(0)
    cfg = small(dim=256, n_layers=4, ffn_dim=512, vocab_size=1000)
    model = build_model(cfg)
    assert model.embed.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)
    wo = model.layers[0].attention.wo.weight
    assert wo.std().item() == pytest.approx(cfg.init_std / math.sqrt(2 * cfg.n_layers), rel=0.05)
    assert torch.all(model.layers[1].mlp_norm.weight == 1)
    # RoPE tables are real numbers again after meta materialisation.
    assert torch.allclose(model.rope_cos[0], torch.ones_like(model.rope_cos[0]))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_future_tokens_do_not_change_earlier_logits(attention):
    torch.manual_seed(0)
    model = build_model(small())
    model.set_attention({"sdpa": sdpa, "eager": eager}[attention])
    idx = torch.randint(0, 97, (2, 20))
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 97
    a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-3)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_sdpa_equals_eager(kv_heads):
    torch.manual_seed(0)
    model = build_model(small(n_kv_heads=kv_heads))
    idx = torch.randint(0, 97, (2, 33))
    model.set_attention(eager)
    want = model(idx)
    model.set_attention(sdpa)
    got = model(idx)
    assert (got - want).abs().max().item() < 1e-5


def test_sdpa_equals_eager_with_a_cache_offset():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 16)
    k = torch.randn(2, 2, 12, 16)
    v = torch.randn(2, 2, 12, 16)
    assert torch.allclose(sdpa(q, k, v, 7), eager(q, k, v, 7), atol=1e-5)


def test_chunked_loss_equals_full_loss_and_gradient():
    torch.manual_seed(0)
    model = build_model(small())
    idx = torch.randint(0, 97, (2, 40))
    tgt = torch.randint(0, 97, (2, 40))
    full = model(idx, tgt)
    full.backward()
    g_full = model.embed.weight.grad.clone()
    model.zero_grad()
    model.loss_chunk_tokens = 16  # 80 tokens -> 5 chunks
    chunked = model(idx, tgt)
    chunked.backward()
    assert torch.allclose(full, chunked, atol=1e-6)
    assert torch.allclose(g_full, model.embed.weight.grad, atol=1e-6)


def test_llama3_rope_scaling_changes_only_low_frequencies():
    plain = rope_frequencies(small(dim=128, n_heads=2, rope_theta=500000.0))
    scaled = rope_frequencies(small(dim=128, n_heads=2, rope_theta=500000.0, rope_scaling="llama3"))
    assert torch.allclose(plain[:4], scaled[:4])  # highest frequencies untouched
    assert torch.allclose(plain[-1] / 32.0, scaled[-1])  # lowest divided by the factor
    assert torch.all(scaled <= plain + 1e-12)


def test_bf16_autocast_forward_backward_runs_and_is_close_to_fp32():
    torch.manual_seed(0)
    model = build_model(small())
    idx = torch.randint(0, 97, (2, 32))
    fp32 = model(idx, idx).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)
    loss.backward()
    assert abs(loss.item() - fp32) < 0.05
    assert model.embed.weight.grad is not None
