"""The Llama model (nanopt/recipe/model.py): shapes, init, causality, kernels agree, the chunked loss, compile, and the
opt-in options each doing what their config comment says; all off, the plain Llama key for key and bit for bit."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ALL_ON, OPTIONS_VOCAB, options_config, options_model

import nanopt.recipe.model
from nanopt.config import ModelConfig, TrainConfig, config_from_dict, configs_dir, load_config, parse_overrides
from nanopt.errors import ConfigError
from nanopt.evals.generate import generate, generate_padded
from nanopt.hf import export_model
from nanopt.recipe.attention import eager, sdpa
from nanopt.recipe.mfu import meta_model, param_counts, token_flops
from nanopt.recipe.model import Block, Llama, apply_rope, build_model, rms_normalize, rope_frequencies, rope_tables
from nanopt.recipe.optim import param_groups

torch.set_num_threads(1)


def small(**kw) -> ModelConfig:
    base = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


def loss_and_grads(model, idx, targets, bf16: bool = False, saved: list | None = None):
    """(loss, {name: grad}) of one backward from zeroed grads; `saved` gets the bytes of each tensor autograd saves."""
    model.zero_grad(set_to_none=True)
    hooks = contextlib.nullcontext() if saved is None else torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), hooks:
        loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_shapes_loss_at_init_parameter_counts_init_and_build_models_options():
    torch.manual_seed(0)
    model, idx = build_model(small()), torch.randint(0, 97, (3, 17))
    assert model(idx).shape == (3, 17, 97) and model(idx, torch.randint(0, 97, (3, 17))).shape == ()
    loss = build_model(small(vocab_size=512))(torch.randint(0, 512, (4, 64)), torch.randint(0, 512, (4, 64))).item()
    assert abs(loss - math.log(512)) < 0.1, loss
    with torch.device("meta"):
        assert Llama(load_config(configs_dir() / "1b.yaml").model).num_params() == 1_235_814_400
    assert model.lm_head.weight is model.embed.weight  # tied after meta materialisation
    assert build_model(small(tie_embeddings=False)).num_params() == model.num_params() + 97 * 64
    torch.manual_seed(0)
    cfg = small(dim=256, n_layers=4, ffn_dim=512, vocab_size=1000)
    model = build_model(cfg)
    assert model.embed.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)
    wo = model.layers[0].attention.wo.weight
    assert wo.std().item() == pytest.approx(cfg.init_std / math.sqrt(2 * cfg.n_layers), rel=0.05)
    assert torch.all(model.layers[1].mlp_norm.weight == 1)
    # RoPE tables are real numbers again after meta materialisation.
    assert torch.allclose(model.rope_cos[0], torch.ones_like(model.rope_cos[0]))
    model = build_model(small(), kernel=eager, loss_chunk_tokens=24, dtype=torch.bfloat16)  # a ready model
    assert all(layer.attention.kernel is eager for layer in model.layers)
    assert model.loss_chunk_tokens == 24
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # bf16-pure casts the parameters only: bf16 cos/sin tables would round every rotation (issue 16, finding 6).
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    torch.testing.assert_close(model.rope_cos, rope_tables(small(), model.rope_cos.shape[0])[0])
    assert model.lm_head.weight is model.embed.weight
    idx = torch.randint(0, 97, (2, 16))
    assert model(idx, idx).dtype == torch.float32  # 32 tokens -> 2 chunks of the loss, summed in fp32


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_sdpa_equals_eager_and_future_tokens_do_not_change_earlier_logits(kv_heads):
    torch.manual_seed(0)
    model, idx = build_model(small(n_kv_heads=kv_heads)), torch.randint(0, 97, (2, 33))
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 97
    out = {}
    for kernel in (eager, sdpa):
        model.set_attention(kernel)
        out[kernel] = a = model(idx)
        b = model(changed)
        assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6) and not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-3)
    assert (out[sdpa] - out[eager]).abs().max().item() < 1e-5
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    assert torch.allclose(sdpa(q, k, v, 7), eager(q, k, v, 7), atol=1e-5)  # a cache offset


def test_evaluation_chunks_the_loss_even_when_training_does_not(monkeypatch):
    torch.manual_seed(0)
    model = build_model(small(), loss_chunk_tokens=0)
    idx, tgt = torch.randint(0, 97, (2, 40)), torch.randint(0, 97, (2, 40))
    sizes = []
    real = nanopt.recipe.model._chunk_loss_sum
    monkeypatch.setattr(nanopt.recipe.model, "_chunk_loss_sum", lambda h, *a, **k: (sizes.append(h.shape[1]), real(h, *a, **k))[1])
    monkeypatch.setattr(nanopt.recipe.model, "NO_GRAD_CHUNK_TOKENS", 20)  # 80 positions -> 4 chunks of 10 per row
    train_loss = model(idx, tgt)
    assert sizes == [40]  # with autograd: one piece, as configured
    with torch.no_grad():
        eval_loss = model(idx, tgt)
    assert sizes[1:] == [10, 10, 10, 10]
    torch.testing.assert_close(eval_loss, train_loss.detach())


def test_rms_normalize_is_the_textbook_formula_and_under_autocast_casts_once_and_changes_no_value(monkeypatch):
    """One cast instead of three: the forward is bitwise the fp32-output norm's, the backward one bf16 rounding off."""
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rms_normalize(t, 1e-5), (x,))  # the hand-written backward
    x, g = torch.randn(4, 7, 32, requires_grad=True), torch.randn(4, 7, 32)
    ref, out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), rms_normalize(x, 1e-5)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g)[0])
    torch.manual_seed(0)
    model, idx = build_model(small()), torch.randint(0, 97, (2, 32))
    norm = model.layers[0].attention_norm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(torch.randn(2, 3, 64)).dtype == torch.bfloat16
    assert norm(torch.randn(2, 3, 64)).dtype == torch.float32  # no autocast: the input's dtype, as before
    loss, grads = loss_and_grads(model, idx, idx, bf16=True)
    assert abs(loss.item() - model(idx, idx).item()) < 0.05 and model.embed.weight.grad is not None  # close to fp32
    monkeypatch.setattr(nanopt.recipe.model.RMSNorm, "forward",
                        lambda self, x: self.weight * rms_normalize(x.float(), self.eps).to(x.dtype))  # fp32 output
    ref_loss, ref_grads = loss_and_grads(model, idx, idx, bf16=True)
    assert torch.equal(loss, ref_loss)
    for g, r in zip(grads.values(), ref_grads.values()):
        assert (g - r).norm() <= 1e-2 * r.norm()


class Gate(torch.nn.Module):  # a parameterised module type init_weights has no rule for
    def __init__(self, dim: int):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.empty(dim))


@pytest.mark.parametrize("add, named", [
    (lambda m: setattr(m.layers[1], "gate", Gate(64)), r"layers\.1\.gate\.gain \(Gate\)"),
    (lambda m: setattr(m.layers[0].mlp.w1, "bias", torch.nn.Parameter(torch.empty(160))),
     r"layers\.0\.mlp\.w1\.bias \(Linear\)"),
    (None, r"layers\.0\.scale \(Block\)"),  # a bare parameter in Block, e.g. a learned residual scale added later
], ids=["module-type", "linear-bias", "bare-parameter"])
def test_init_raises_naming_a_parameter_without_a_rule(add, named, monkeypatch):
    if add is None:  # build_model itself refuses it
        original = Block.__init__
        monkeypatch.setattr(Block, "__init__", lambda self, *a, **k: original(self, *a, **k) or setattr(
            self, "scale", torch.nn.Parameter(torch.ones(()))))
        with pytest.raises(TypeError, match=named):
            build_model(small())
        return
    model = build_model(small())
    add(model)
    with pytest.raises(TypeError, match=named):
        model.init_weights()


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_seed_reproduces_its_weights_and_another_seed_does_not(tie):
    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return build_model(small(tie_embeddings=tie)).state_dict()

    first, again, other = weights(0), weights(0), weights(1)
    assert list(first) == list(again) == list(other)
    for name in first:
        assert torch.equal(first[name], again[name]), name
        assert torch.equal(first[name], other[name]) == name.endswith("norm.weight"), name  # gains start at one
    # Every matrix draws its own values: no two parameters (a tied head aside) share an initialisation.
    matrices = [w for n, w in first.items() if w.dim() == 2 and not (tie and n == "lm_head.weight")]
    assert len({(w.flatten()[0].item(), w.flatten()[-1].item()) for w in matrices}) == len(matrices)


def test_rope_is_hugging_faces_rotate_half_and_llama3_scaling_changes_only_low_frequencies():
    plain = rope_frequencies(small(dim=128, n_heads=2, rope_theta=500000.0))
    scaled = rope_frequencies(small(dim=128, n_heads=2, rope_theta=500000.0, rope_scaling="llama3"))
    assert torch.allclose(plain[:4], scaled[:4]) and torch.allclose(plain[-1] / 32.0, scaled[-1])  # high kept, low /32
    assert torch.all(scaled <= plain + 1e-12)
    cfg = ModelConfig(dim=64, n_heads=2, n_kv_heads=2, max_seq_len=16)
    cos, sin = rope_tables(cfg, 16)
    half = cfg.head_dim // 2
    plain_sin = sin[:, half:].repeat(1, 2)  # the unsigned table HF uses: [sin, sin]
    x = torch.randn(2, 2, 16, cfg.head_dim)
    rotate_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    torch.testing.assert_close(apply_rope(x, cos, sin), x * cos + rotate_half * plain_sin)
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))  # a rotation


@pytest.mark.parametrize("tie", [True, False])
def test_chunked_loss_and_every_gradient_match_the_full_logits_path(tie):
    torch.manual_seed(0)
    vocab = 4099  # large next to the model, and chunks that do not divide the token count
    model = build_model(options_config(vocab_size=vocab, max_seq_len=65, tie_embeddings=tie))
    idx, targets = torch.randint(0, vocab, (2, 65)), torch.randint(0, vocab, (2, 65))
    targets[0, :20] = targets[1, 50:] = -100  # ignored positions (e.g. padding) must not count in the mean
    model.loss_chunk_tokens = 10**9  # 130 tokens in one piece
    full_loss, full_grads = loss_and_grads(model, idx, targets)
    reference = F.cross_entropy(model(idx).reshape(-1, vocab).float(), targets.reshape(-1))
    assert torch.allclose(full_loss, reference, atol=1e-6)
    for chunk in (16, 47, 0):  # 0: `train.loss_chunk_tokens: 0`, never chunk
        model.loss_chunk_tokens = chunk
        loss, grads = loss_and_grads(model, idx, targets)
        assert torch.allclose(loss, full_loss, atol=1e-6, rtol=1e-6)
        assert grads.keys() == full_grads.keys()
        for name, g in grads.items():
            assert torch.allclose(g, full_grads[name], atol=1e-7, rtol=1e-5), name
        assert all(g.abs().sum() > 0 for g in full_grads.values())  # every parameter takes part


# ---------------------------------------------------------------- the opt-in model options
ALL_OFF = dict(qk_norm=False, mlp="swiglu", logit_softcap=0.0, value_embeddings=False, residual_scalars=False)


def tokens(b: int = 2, t: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, OPTIONS_VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def captured(model: Llama) -> list[tuple[torch.Tensor, ...]]:
    """The q, k, v each layer hands its attention kernel from now on (an sdpa that records them)."""
    calls = []
    model.set_attention(lambda q, k, v, causal_offset=0: calls.append(tuple(t.detach().clone() for t in (q, k, v)))
                        or sdpa(q, k, v, causal_offset))
    return calls


def test_all_options_off_is_the_default_model_key_for_key_and_bit_for_bit():
    per_layer = ["attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                 "attention.wo.weight", "mlp_norm.weight", "mlp.w1.weight", "mlp.w3.weight", "mlp.w2.weight"]
    expected = ["embed.weight", *(f"layers.{i}.{k}" for i in range(2) for k in per_layer), "norm.weight",
                "lm_head.weight"]
    default, off = options_model(), options_model(**ALL_OFF)
    assert list(default.state_dict()) == expected
    for (name, a), (_, b) in zip(default.state_dict().items(), off.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    idx = tokens()
    assert torch.equal(default(idx), off(idx))
    assert torch.equal(default(idx, idx), off(idx, idx))


def test_qk_norm_gives_the_kernel_unit_rms_queries_and_keys_per_head():
    for on in (True, False):
        model = options_model(qk_norm=on, norm_eps=1e-9)  # eps would pull small heads' RMS a little below 1
        calls = captured(model)
        model(tokens())
        assert len(calls) == 2
        for q, k, _ in calls:  # RoPE rotates pairs of dims, which keeps each head's RMS
            rms = [t.pow(2).mean(-1).sqrt() for t in (q, k)]  # B H T
            assert all(torch.allclose(r, torch.ones_like(r), atol=1e-4) for r in rms) == on
    assert list(options_model(qk_norm=True).state_dict()) == list(options_model().state_dict())  # no learnable gain


def test_relu2_mlp_is_w2_of_squared_relu_and_has_no_w3():
    model = options_model(mlp="relu2")
    mlp = model.layers[0].mlp
    assert not hasattr(mlp, "w3") and not any(".w3." in k for k in model.state_dict())
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        assert torch.allclose(mlp(x), mlp.w2(torch.relu(mlp.w1(x)) ** 2), atol=1e-6)
        assert not torch.allclose(mlp(x), mlp.w2(F.silu(mlp.w1(x))), atol=1e-3)


@pytest.mark.parametrize("chunk", [0, 8], ids=["whole", "chunked"])
def test_logit_softcap_caps_logits_and_the_loss_uses_the_capped_logits(chunk):
    cap = 1.0  # raw logits reach ~4.5: capped, but short of where fp32 tanh rounds to exactly ±1
    capped = options_model(logit_softcap=cap, init_std=0.2)
    plain = build_model(options_config(init_std=0.2))
    plain.load_state_dict(capped.state_dict())  # same keys: the cap has no weights
    idx, targets = tokens(), tokens(seed=2)
    with torch.no_grad():
        raw, logits = plain(idx), capped(idx)
        assert raw.abs().max() > 2 * cap  # the cap is exercised
        assert logits.abs().max() < cap
        assert torch.allclose(logits, cap * torch.tanh(raw / cap), atol=1e-6)
        capped.loss_chunk_tokens = chunk  # 24 positions in chunks of 8: the recomputed path
        expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        assert torch.allclose(capped(idx, targets), expected, atol=1e-6)
        assert not torch.allclose(plain(idx, targets), expected, atol=1e-3)


def test_value_embeddings_add_each_layers_own_lookup_to_v():
    model = options_model(value_embeddings=True)
    tables = [layer.attention.value_embed.weight for layer in model.layers]
    assert tables[0].shape == (OPTIONS_VOCAB, 2 * 8) and tables[0] is not tables[1]
    assert tables[0].std().item() == pytest.approx(model.cfg.init_std, rel=0.15)  # init like the embedding
    inputs: list[torch.Tensor] = []
    for layer in model.layers:  # the normalised x each attention receives
        layer.attention.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
    calls, idx = captured(model), tokens()
    with torch.no_grad():
        model(idx)
        for layer, x, (_, _, v) in zip(model.layers, inputs, calls, strict=True):
            att = layer.attention
            plain = att.wv(x).view(2, 12, 2, 8).transpose(1, 2)  # B Hkv T D
            lookup = att.value_embed(idx).view(2, 12, 2, 8).transpose(1, 2)  # B Hkv T D
            assert torch.allclose(v - plain, lookup, atol=1e-6)
            assert lookup.abs().max() > 0.01


def test_residual_scalars_start_as_the_plain_residual_and_mix_in_the_embedding():
    scaled, plain = options_model(residual_scalars=True), options_model()
    missing, unexpected = scaled.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(missing) == [f"layers.{i}.residual_scalars.{s}" for i in range(2) for s in "ab"] and not unexpected
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(scaled(idx), plain(idx))  # a = 1, b = 0 at init
        mix = scaled.layers[1].residual_scalars
        mix.a.fill_(0.7)
        mix.b.fill_(0.5)
        seen: dict[str, torch.Tensor] = {}
        scaled.layers[0].register_forward_hook(lambda m, args, out: seen.update(x=out))
        scaled.layers[1].attention_norm.register_forward_pre_hook(lambda m, args: seen.update(block_input=args[0]))
        assert not torch.allclose(scaled(idx), plain(idx), atol=1e-4)
        assert torch.allclose(seen["block_input"], 0.7 * seen["x"] + 0.5 * scaled.embed(idx), atol=1e-6)


# ---------------------------------------------------------------- counts, FLOPs, optimizer kinds
COMBOS = list(itertools.product([False, True], ["swiglu", "relu2"], [0.0, 3.0], [False, True], [False, True]))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("qk, mlp, cap, ve, rs", COMBOS)
def test_param_counts_equal_the_built_model_for_every_combination(qk, mlp, cap, ve, rs, tied):
    cfg = options_config(qk_norm=qk, mlp=mlp, logit_softcap=cap, value_embeddings=ve, residual_scalars=rs,
                         tie_embeddings=tied)
    model = build_model(cfg)
    counts = param_counts(meta_model(cfg))
    assert counts.total == model.num_params()
    assert counts.embedding == sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    assert counts.scalars == (4 if rs else 0)
    # N of 6N: everything but the lookups, the (tied or untied) head counted once.
    assert counts.n_6n == model.num_params(exclude_embedding=True) + (counts.lm_head if tied else 0)
    assert ve or counts.n_6n == model.num_params() - (0 if tied else model.embed.weight.numel())


def test_flops_per_token_follow_the_options():
    def with_(**kw) -> int:
        return token_flops(meta_model(options_config(dim=64, ffn_dim=160, **kw)), 64).model

    fpt = with_()
    assert fpt - with_(mlp="relu2") == 6 * 2 * 64 * 160  # one dim × ffn matrix fewer per layer
    assert with_(value_embeddings=True) == fpt  # a lookup: parameters, no matmul FLOPs
    assert with_(qk_norm=True) == with_(logit_softcap=30.0) == fpt  # elementwise, parameter-free
    assert with_(residual_scalars=True) - fpt == 6 * 2 * 2  # two scalars per layer, in N like the norm gains
    with_ve = param_counts(meta_model(options_config(value_embeddings=True))).total
    assert with_ve - param_counts(meta_model(options_config())).total == 2 * OPTIONS_VOCAB * 16


def test_optimizer_kinds_of_the_option_parameters():
    model = options_model(**ALL_ON, tie_embeddings=False)
    kind = {id(p): g["kind"] for g in param_groups(model, TrainConfig()) for p in g["params"]}
    for name, p in model.named_parameters():
        want = ("embedding" if "value_embed" in name or name == "embed.weight" else
                "scalar" if "residual_scalars" in name or p.ndim < 2 else
                "head" if name == "lm_head.weight" else "matrix")
        assert kind[id(p)] == want, name
    assert sum(1 for k in kind.values() if k == "embedding") == 1 + 2  # token + one value table per layer


# ---------------------------------------------------------------- training and decoding with all options on
def test_every_option_runs_under_bf16_autocast_and_in_pure_bf16_and_a_few_adamw_steps_lower_the_loss():
    model, idx = options_model(**ALL_ON), tokens()  # mixed dtypes are where options break
    fp32 = model(idx, idx).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)
        assert model(idx).dtype == torch.float32  # capped logits come back in fp32
    loss.backward()
    assert abs(loss.item() - fp32) < 0.05
    torch.manual_seed(0)
    pure = build_model(options_config(**ALL_ON), dtype=torch.bfloat16)
    assert abs(pure(idx, idx).item() - fp32) < 0.1
    model.loss_chunk_tokens = 16  # 48 positions: the chunked, recomputed loss path with the cap
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, targets = tokens(2, 24, seed=3), tokens(2, 24, seed=4)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        (loss := model(idx, targets)).backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    b = torch.stack([layer.residual_scalars.b for layer in model.layers])
    assert b.abs().max() > 0  # the embedding mix is learned, not stuck at its init


def test_kv_cache_decoding_matches_the_full_forward_with_every_option():
    model = options_model(**ALL_ON, init_std=0.2).eval()
    prompt = tokens(3, 7, seed=5)
    with torch.no_grad():
        caches = model.new_caches(3, 10, torch.device("cpu"), torch.float32)
        model(prompt, caches=caches, start_pos=0)
        step = model(tokens(3, 1, seed=6), caches=caches, start_pos=7)[:, -1]  # B V
        full = model(torch.cat([prompt, tokens(3, 1, seed=6)], dim=1))[:, -1]
    assert torch.allclose(step, full, atol=1e-5)
    cached = generate(model, prompt, 20, temperature=0.0, use_cache=True)
    assert torch.equal(cached, generate(model, prompt, 20, temperature=0.0, use_cache=False))
    assert torch.equal(cached, generate_padded(model, prompt, 20, temperature=0.0))
    assert len(set(cached[:, 7:].flatten().tolist())) > 3  # not a constant stream that would hide a bug


def test_training_blocks_run_only_in_a_training_forward_and_leave_the_state_dict_alone():
    """Llama.training_blocks (compiled blocks under fsdp) serve a forward with autograd on and no KV cache only;
    a plain list: the state_dict keys, parameters and submodules are the eager model's."""
    model = options_model(**ALL_ON)  # residual scalars and value embeddings: the blocks' keyword arguments too
    keys, params, modules = list(model.state_dict()), list(model.parameters()), list(model.modules())
    idx = tokens(2, 16)
    eager_loss, calls = model(idx, idx), []
    model.training_blocks = [lambda *a, block=block, i=i, **k: calls.append(i) or block(*a, **k)  # counting stand-ins
                             for i, block in enumerate(model.layers)]
    assert list(model.state_dict()) == keys and list(model.parameters()) == params
    assert list(model.modules()) == modules
    assert torch.equal(model(idx, idx), eager_loss) and calls == [0, 1]
    with torch.no_grad():
        model(idx, idx)
        model(idx)
    generate(model, idx[:, :4], 3, temperature=0.0, use_cache=True)
    caches = model.new_caches(2, 8, torch.device("cpu"), torch.float32)
    model(idx[:, :4], caches=caches, start_pos=0)  # a cached forward with autograd on
    assert calls == [0, 1]


def test_recompute_blocks_gives_the_same_loss_and_gradients_and_keeps_only_each_blocks_input():
    model = options_model(**ALL_ON)  # residual scalars re-read x0, value embeddings read idx: both reach the blocks
    idx, plain_saved, again_saved = tokens(2, 16), [], []
    plain = loss_and_grads(model, idx, idx, saved=plain_saved)
    model.recompute_blocks = True
    again = loss_and_grads(model, idx, idx, saved=again_saved)
    assert torch.equal(again[0], plain[0])
    for ours, theirs in zip(again[1].values(), plain[1].values()):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert sum(again_saved) < sum(plain_saved) / 2, (sum(again_saved), sum(plain_saved))  # activations: in backward
    with torch.no_grad():
        assert torch.equal(model(idx, idx), plain[0])


# ---------------------------------------------------------------- Hugging Face: refused, with the fix
@pytest.mark.parametrize("option", list(ALL_ON))
def test_export_refuses_each_option_naming_it(option, tmp_path):
    model = options_model(**{option: ALL_ON[option]})
    with pytest.raises(ConfigError, match=f"model.{option}=.*LlamaForCausalLM cannot represent.*--model.{option}="):
        export_model(model, tmp_path / "hf", tokenizer="")
    assert not (tmp_path / "hf").exists()  # refused before writing anything


# ---------------------------------------------------------------- torch.compile gives eager's numbers
SMALL_MODEL = small(vocab_size=257, ffn_dim=128, max_seq_len=32, n_layers=1)  # inductor compiles each layer anew
# Every speedrun option on: their ops and the hand-written RMS-norm backward must compile too.
ALL_OPTIONS = dataclasses.replace(SMALL_MODEL, **{**ALL_ON, "logit_softcap": 15.0}, tie_embeddings=False)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [SMALL_MODEL, ALL_OPTIONS], ids=["llama", "speedrun-options"])
def test_compiled_model_matches_eager_loss_and_grads(cfg):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, idx = build_model(cfg), torch.randint(0, 257, (4, 32))
    targets = torch.roll(idx, -1, dims=1)
    targets[:, -1] = -100  # an ignored position must stay ignored when compiled
    eager_loss, eager_grads = loss_and_grads(model, idx, targets)
    compiled_loss, grads = loss_and_grads(torch.compile(model), idx, targets)  # inductor, the train.compile path
    assert torch.isfinite(compiled_loss)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-5)
    for g, eager_g in zip(grads.values(), eager_grads.values(), strict=True):
        torch.testing.assert_close(g, eager_g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dim", [6_400_000, 99999999999999999999968])  # ~1 PB of weights; a size past int64
def test_a_model_too_big_to_allocate_is_one_paragraph_naming_the_model_keys(dim):
    with pytest.raises(ConfigError, match=r"cannot be allocated on cpu .*model\.dim, model\.n_layers"):
        build_model(small(vocab_size=257, dim=dim, ffn_dim=128))


# ---------------------------------------------------------------- the model family (model.depth, docs/scaling.md)
# depth, overrides -> (n_layers, dim, n_heads, n_kv_heads, ffn_dim)
FAMILY = [
    (4, [], (4, 256, 4, 4, 704)),
    (6, [], (6, 384, 6, 6, 1024)),  # Llama's 8/3: 1024 exactly
    (5, ["--model.aspect_ratio=50"], (5, 256, 4, 4, 704)),  # 250 rounds up to a whole head
    (6, ["--model.depth_head_dim=32"], (6, 384, 12, 12, 1024)),
    (6, ["--model.n_kv_heads=2"], (6, 384, 6, 2, 1024)),  # grouped-query attention when asked for
    (3, ["--model.mlp=relu2"], (3, 192, 3, 3, 768)),  # relu2: 4x
    (6, ["--model.dim=384", "--model.n_layers=6"], (6, 384, 6, 6, 1024)),  # explicit keys that agree
    (6, ["--model.dim=512"], "`model.dim` is 512, the family's 384"),  # keys that disagree: refused, named
    (6, ["--model.n_layers=3", "--model.ffn_dim=100"], "`model.ffn_dim` is 100"),
]


@pytest.mark.parametrize("depth, extra, shape", FAMILY, ids=[f"d{d}{''.join(e)}" for d, e, _ in FAMILY])
def test_model_depth_sets_the_shape_of_the_family_and_refuses_keys_that_disagree(depth, extra, shape):
    if isinstance(shape, str):
        with pytest.raises(ConfigError) as refused:
            load_config(None, parse_overrides([f"--model.depth={depth}", *extra]))
        text = str(refused.value)
        assert "`model.depth` (6) sets the model's shape" in text and shape in text and "model.depth=null" in text
        return
    m = load_config(None, parse_overrides([f"--model.depth={depth}", *extra])).model
    assert (m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim) == shape
    assert m.head_dim == m.dim // m.n_heads and m.ffn_dim % m.head_dim == 0
    again = config_from_dict(load_config(None, parse_overrides([f"--model.depth={depth}", *extra])).to_dict(), "x")
    assert again.model == m  # a saved config (its derived keys written out) reads back as the same model


def test_a_ladder_is_a_list_of_depths_whose_parameters_grow():
    counts = [build_model(load_config(None, parse_overrides([f"--model.depth={d}", "--model.vocab_size=64"])).model,
                          "meta").num_params() for d in (1, 2, 3, 4)]
    assert counts == sorted(counts) and len(set(counts)) == 4
