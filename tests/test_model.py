"""The Llama model: shapes, init, parameter count, causality, attention backends agree."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import nanopt.model
from nanopt.attention import eager, sdpa
from nanopt.config import ModelConfig, configs_dir, load_config
from nanopt.flops import param_counts
from nanopt.model import Block, Llama, apply_rope, build_model, rms_normalize, rope_frequencies, rope_tables


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
    model = build_model(small(), kernel={"sdpa": sdpa, "eager": eager}[attention])
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


def test_evaluation_chunks_the_loss_even_when_training_does_not(monkeypatch):
    """loss_chunk_tokens 0 (the compiled GPU configs) means no chunks with autograd; under no_grad chunks cost
    nothing, so evaluation bounds its logits to NO_GRAD_CHUNK_TOKENS positions at a time. Same loss."""
    torch.manual_seed(0)
    model = build_model(small(), loss_chunk_tokens=0)
    idx, tgt = torch.randint(0, 97, (2, 40)), torch.randint(0, 97, (2, 40))
    sizes = []
    real = nanopt.model._chunk_loss_sum
    monkeypatch.setattr(nanopt.model, "_chunk_loss_sum", lambda h, *a, **k: (sizes.append(h.shape[1]), real(h, *a, **k))[1])
    monkeypatch.setattr(nanopt.model, "NO_GRAD_CHUNK_TOKENS", 20)  # 80 positions -> 4 chunks of 10 per row
    train_loss = model(idx, tgt)
    assert sizes == [40]  # with autograd: one piece, as configured
    with torch.no_grad():
        eval_loss = model(idx, tgt)
    assert sizes[1:] == [10, 10, 10, 10]
    torch.testing.assert_close(eval_loss, train_loss.detach())


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


def test_rmsnorm_under_autocast_casts_once_and_changes_no_value():
    """The norm hands bf16 to the Linears after it (they would each cast the fp32 output to these same values):
    one cast instead of three, one saved copy instead of three. The forward is bitwise that of the fp32-output
    norm; in backward the Linears' input gradients now meet in bf16 before the norm (one more bf16 rounding)."""
    torch.manual_seed(0)
    model = build_model(small())
    idx = torch.randint(0, 97, (2, 32))
    norm = model.layers[0].attention_norm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(torch.randn(2, 3, 64)).dtype == torch.bfloat16
    assert norm(torch.randn(2, 3, 64)).dtype == torch.float32  # no autocast: the input's dtype, as before

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, idx)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads()
    fp32_output = lambda self, x: self.weight * rms_normalize(x.float(), self.eps).to(x.dtype)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nanopt.model.RMSNorm, "forward", fp32_output)
        ref_loss, ref_grads = loss_and_grads()
    assert torch.equal(loss, ref_loss)
    for g, r in zip(grads, ref_grads):
        assert (g - r).norm() <= 1e-2 * r.norm()


def test_build_model_returns_a_ready_model():
    model = build_model(small(), kernel=eager, loss_chunk_tokens=24, dtype=torch.bfloat16)
    assert all(layer.attention.kernel is eager for layer in model.layers)
    assert model.loss_chunk_tokens == 24
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # bf16-pure casts the parameters only: bf16 cos/sin tables would round every rotation (issue 16, finding 6).
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    torch.testing.assert_close(model.rope_cos, rope_tables(small(), model.rope_cos.shape[0])[0])
    assert model.lm_head.weight is model.embed.weight
    idx = torch.randint(0, 97, (2, 16))
    assert model(idx, idx).dtype == torch.float32  # 32 tokens -> 2 chunks of the loss, summed in fp32


class Gate(torch.nn.Module):
    """A parameterised module type init_weights has no rule for."""

    def __init__(self, dim: int):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.empty(dim))


def test_init_raises_on_a_module_type_without_a_rule():
    model = build_model(small())
    model.layers[1].gate = Gate(64)
    with pytest.raises(TypeError, match=r"layers\.1\.gate\.gain \(Gate\)"):
        model.init_weights()


def test_build_model_raises_on_a_bare_parameter_without_a_rule(monkeypatch):
    original = Block.__init__

    def with_scalar(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.scale = torch.nn.Parameter(torch.ones(()))  # e.g. a learned residual scale added later

    monkeypatch.setattr(Block, "__init__", with_scalar)
    with pytest.raises(TypeError, match=r"layers\.0\.scale \(Block\)"):
        build_model(small())


def test_init_rejects_a_linear_bias():
    model = build_model(small())
    model.layers[0].mlp.w1.bias = torch.nn.Parameter(torch.empty(160))
    with pytest.raises(TypeError, match=r"layers\.0\.mlp\.w1\.bias \(Linear\)"):
        model.init_weights()


def test_build_model_checks_the_flops_parameter_count(monkeypatch):
    cfg = small()
    wrong = dataclasses.replace(param_counts(cfg), total=param_counts(cfg).total + 1)
    monkeypatch.setattr(nanopt.model, "param_counts", lambda m: wrong)
    with pytest.raises(RuntimeError, match=f"{wrong.total:,}.*{wrong.total - 1:,}"):
        build_model(cfg)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_seed_reproduces_its_weights_and_another_seed_does_not(tie):
    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return build_model(small(tie_embeddings=tie)).state_dict()

    first, again, other = weights(0), weights(0), weights(1)
    assert list(first) == list(again) == list(other)
    for name in first:
        assert torch.equal(first[name], again[name]), name
        if name.endswith("norm.weight"):  # gains start at one whatever the seed
            assert torch.equal(first[name], other[name]), name
        else:
            assert not torch.equal(first[name], other[name]), name
    # Every matrix draws its own values: no two parameters (a tied head aside) share an initialisation.
    matrices = [w for n, w in first.items() if w.dim() == 2 and not (tie and n == "lm_head.weight")]
    assert len({(w.flatten()[0].item(), w.flatten()[-1].item()) for w in matrices}) == len(matrices)


def test_rms_normalize_matches_the_textbook_formula_and_its_gradient():
    # The hand-written backward (model._RMSNormalize) against autograd's, in float64 via gradcheck too.
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rms_normalize(t, 1e-5), (x,))
    x = torch.randn(4, 7, 32, requires_grad=True)
    g = torch.randn(4, 7, 32)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    (ref_grad,) = torch.autograd.grad(ref, x, g)
    out = rms_normalize(x, 1e-5)
    (grad,) = torch.autograd.grad(out, x, g)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, ref_grad)


def test_rope_is_hugging_faces_rotate_half():
    # rope_tables carries rotate-half's sign in the sin table; apply_rope must equal HF's formula.
    cfg = ModelConfig(dim=64, n_heads=2, n_kv_heads=2, max_seq_len=16)
    cos, sin = rope_tables(cfg, 16)
    plain_sin = sin[:, cfg.head_dim // 2 :].repeat(1, 2)  # the unsigned table HF uses: [sin, sin]
    x = torch.randn(2, 2, 16, cfg.head_dim)
    half = cfg.head_dim // 2
    rotate_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    torch.testing.assert_close(apply_rope(x, cos, sin), x * cos + rotate_half * plain_sin)
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))  # a rotation
