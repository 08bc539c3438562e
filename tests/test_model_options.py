"""The opt-in model options (qk_norm, mlp=relu2, logit_softcap, value_embeddings, residual_scalars): each
changes the forward pass as its config comment says, the parameter and FLOP counts follow it, the
optimizer files its parameters under the right kind, KV-cache decoding still matches the full forward,
and `nanopt export` / `train.init_from=hf:DIR` refuse what a Hugging Face Llama cannot hold. With every
option off the model is the plain Llama, key for key and bit for bit."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from conftest import small_overrides
from nanopt import cli
from nanopt.attention import sdpa
from nanopt.config import ModelConfig, TrainConfig
from nanopt.errors import ConfigError
from nanopt.flops import flops_per_token, param_counts
from nanopt.generate import generate, generate_padded
from nanopt.hf import export_model
from nanopt.main import run
from nanopt.model import Llama, build_model
from nanopt.optim import param_groups

torch.set_num_threads(1)

VOCAB = 61
ALL_ON = dict(qk_norm=True, mlp="relu2", logit_softcap=2.0, value_embeddings=True, residual_scalars=True)
ALL_OFF = dict(qk_norm=False, mlp="swiglu", logit_softcap=0.0, value_embeddings=False, residual_scalars=False)


def small(**kw) -> ModelConfig:
    base = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


def model_of(seed: int = 0, **kw) -> Llama:
    torch.manual_seed(seed)
    return build_model(small(**kw))


def tokens(b: int = 2, t: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


class Capture:
    """An attention kernel that records the q, k, v each layer hands it, then runs sdpa."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int = 0) -> torch.Tensor:
        self.calls.append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
        return sdpa(q, k, v, causal_offset)


# ---------------------------------------------------------------- all off = the plain Llama


def test_default_model_keeps_its_state_dict_keys():
    per_layer = ["attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                 "attention.wo.weight", "mlp_norm.weight", "mlp.w1.weight", "mlp.w3.weight", "mlp.w2.weight"]
    expected = ["embed.weight", *(f"layers.{i}.{k}" for i in range(2) for k in per_layer), "norm.weight",
                "lm_head.weight"]
    assert list(model_of().state_dict()) == expected


def test_all_options_off_is_the_default_model_bit_for_bit():
    default, off = model_of(), model_of(**ALL_OFF)
    for (name, a), (_, b) in zip(default.state_dict().items(), off.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    idx = tokens()
    assert torch.equal(default(idx), off(idx))
    assert torch.equal(default(idx, idx), off(idx, idx))


# ---------------------------------------------------------------- each option does what it says


def test_qk_norm_gives_the_kernel_unit_rms_queries_and_keys_per_head():
    for on in (True, False):
        model = model_of(qk_norm=on, norm_eps=1e-9)  # eps would pull small heads' RMS a little below 1
        capture = Capture()
        model.set_attention(capture)
        model(tokens())
        assert len(capture.calls) == 2
        for q, k, _ in capture.calls:  # RoPE rotates pairs of dims, which keeps each head's RMS
            rms_q, rms_k = q.pow(2).mean(-1).sqrt(), k.pow(2).mean(-1).sqrt()  # B H T
            unit = torch.allclose(rms_q, torch.ones_like(rms_q), atol=1e-4) and torch.allclose(
                rms_k, torch.ones_like(rms_k), atol=1e-4)
            assert unit == on
    assert list(model_of(qk_norm=True).state_dict()) == list(model_of().state_dict())  # no learnable gain


def test_relu2_mlp_is_w2_of_squared_relu_and_has_no_w3():
    model = model_of(mlp="relu2")
    mlp = model.layers[0].mlp
    assert not hasattr(mlp, "w3") and not any(".w3." in k for k in model.state_dict())
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        assert torch.allclose(mlp(x), mlp.w2(torch.relu(mlp.w1(x)) ** 2), atol=1e-6)
        assert not torch.allclose(mlp(x), mlp.w2(F.silu(mlp.w1(x))), atol=1e-3)


@pytest.mark.parametrize("chunk", [0, 8], ids=["whole", "chunked"])
def test_logit_softcap_caps_logits_and_the_loss_uses_the_capped_logits(chunk):
    cap = 1.0  # raw logits reach ~4.5: capped, but short of where fp32 tanh rounds to exactly ±1
    capped = model_of(logit_softcap=cap, init_std=0.2)
    plain = build_model(small(init_std=0.2))
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
    model = model_of(value_embeddings=True)
    tables = [layer.attention.value_embed.weight for layer in model.layers]
    assert tables[0].shape == (VOCAB, 2 * 8) and tables[0] is not tables[1]
    assert tables[0].std().item() == pytest.approx(model.cfg.init_std, rel=0.15)  # init like the embedding
    inputs: list[torch.Tensor] = []
    for layer in model.layers:  # the normalised x each attention receives
        layer.attention.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
    capture = Capture()
    model.set_attention(capture)
    idx = tokens()
    with torch.no_grad():
        model(idx)
        for layer, x, (_, _, v) in zip(model.layers, inputs, capture.calls, strict=True):
            att = layer.attention
            plain = att.wv(x).view(2, 12, 2, 8).transpose(1, 2)  # B Hkv T D
            lookup = att.value_embed(idx).view(2, 12, 2, 8).transpose(1, 2)  # B Hkv T D
            assert torch.allclose(v - plain, lookup, atol=1e-6)
            assert lookup.abs().max() > 0.01


def test_residual_scalars_start_as_the_plain_residual_and_mix_in_the_embedding():
    scaled, plain = model_of(residual_scalars=True), model_of()
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
    cfg = small(qk_norm=qk, mlp=mlp, logit_softcap=cap, value_embeddings=ve, residual_scalars=rs,
                tie_embeddings=tied)
    model = build_model(cfg)  # build_model checks the total itself; the parts are checked here
    counts = param_counts(cfg)
    assert counts.total == model.num_params()
    assert counts.embedding == sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    assert counts.scalars == (4 if rs else 0)
    # N of 6N: everything but the lookups, the (tied or untied) head counted once.
    assert counts.n_6n == model.num_params(exclude_embedding=True) + (counts.lm_head if tied else 0)


def test_flops_per_token_follow_the_options():
    base = small(dim=64, ffn_dim=160)
    fpt = flops_per_token(base, 64)

    def with_(**kw) -> int:
        return flops_per_token(small(dim=64, ffn_dim=160, **kw), 64)

    assert fpt - with_(mlp="relu2") == 6 * 2 * 64 * 160  # one dim × ffn matrix fewer per layer
    assert with_(value_embeddings=True) == fpt  # a lookup: parameters, no matmul FLOPs
    assert with_(qk_norm=True) == with_(logit_softcap=30.0) == fpt  # elementwise, parameter-free
    assert with_(residual_scalars=True) - fpt == 6 * 2 * 2  # two scalars per layer, in N like the norm gains
    assert param_counts(small(value_embeddings=True)).total - param_counts(small()).total == 2 * VOCAB * 16


def test_optimizer_kinds_of_the_option_parameters():
    model = model_of(**ALL_ON, tie_embeddings=False)
    kind = {id(p): g["kind"] for g in param_groups(model, TrainConfig()) for p in g["params"]}
    for name, p in model.named_parameters():
        if "value_embed" in name or name == "embed.weight":
            want = "embedding"
        elif "residual_scalars" in name or p.ndim < 2:
            want = "scalar"
        elif name == "lm_head.weight":
            want = "head"
        else:
            want = "matrix"
        assert kind[id(p)] == want, name
    assert sum(1 for k in kind.values() if k == "embedding") == 1 + 2  # token + one value table per layer


# ---------------------------------------------------------------- training and decoding with all options on


def test_a_few_adamw_steps_with_every_option_lower_the_loss():
    model = model_of(**ALL_ON)
    model.loss_chunk_tokens = 16  # 48 positions: the chunked, recomputed loss path with the cap
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, targets = tokens(2, 24, seed=3), tokens(2, 24, seed=4)
    losses = []
    for _ in range(15):
        loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    b = torch.stack([layer.residual_scalars.b for layer in model.layers])
    assert b.abs().max() > 0  # the embedding mix is learned, not stuck at its init


def test_kv_cache_decoding_matches_the_full_forward_with_every_option():
    model = model_of(**ALL_ON, init_std=0.2).eval()
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


# ---------------------------------------------------------------- Hugging Face: refused, with the fix


@pytest.mark.parametrize("option", list(ALL_ON))
def test_export_refuses_each_option_naming_it(option, tmp_path):
    model = model_of(**{option: ALL_ON[option]})
    with pytest.raises(ConfigError, match=f"model.{option}=.*LlamaForCausalLM cannot represent.*--model.{option}="):
        export_model(model, tmp_path / "hf", tokenizer="")
    assert not (tmp_path / "hf").exists()  # refused before writing anything


def test_cli_export_and_init_from_refuse_options_with_exit_2(tmp_path, corpus_dir, capsys):
    options = {f"model.{k}": str(v).lower() for k, v in ALL_ON.items()}
    run_dir = tmp_path / "run"
    assert run(small_overrides(**{"run.dir": run_dir, "train.max_steps": 2, "train.precision": "fp32",
                                  "log.tensorboard": "false", **options})) == 0
    capsys.readouterr()
    assert cli.run(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanopt export: error: this model cannot be exported") and "Traceback" not in err
    assert err.strip().count("\n") == 0  # one paragraph
    assert "model.value_embeddings=true" in err and "nanopt checkpoint directly" in err

    export_model(model_of(vocab_size=257, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128), tmp_path / "plain",
                 tokenizer="")
    assert run(small_overrides(**{"run.dir": tmp_path / "warm", "train.init_from": f"hf:{tmp_path / 'plain'}",
                                  "model.qk_norm": "true"})) == 2
    err = capsys.readouterr().err
    assert "model.qk_norm=true" in err and "--model.qk_norm=false" in err


def test_every_option_runs_under_bf16_autocast_and_in_pure_bf16():
    # Mixed dtypes are where options break: the value lookup is fp32 while wv's output is bf16, the scalars
    # are fp32 parameters on a bf16 residual stream (pure bf16), the cap's tanh runs in fp32.
    model = model_of(**ALL_ON)
    idx = tokens()
    fp32 = model(idx, idx).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)
        assert model(idx).dtype == torch.float32  # capped logits come back in fp32
    loss.backward()
    assert abs(loss.item() - fp32) < 0.05
    torch.manual_seed(0)
    pure = build_model(small(**ALL_ON), dtype=torch.bfloat16)
    assert abs(pure(idx, idx).item() - fp32) < 0.1
