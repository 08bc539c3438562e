"""µP (model.parametrization: mup, docs/scaling.md): the coordinate check, the per-kind lr factors, and mup at the
base width being sp exactly."""
from __future__ import annotations

import math

import pytest
import torch

from nanopt.config import ModelConfig, OptimConfig, TrainConfig
from nanopt.errors import ConfigError
from nanopt.hf import check_exportable
from nanopt.recipe.model import build_model
from nanopt.recipe.optim import build_optimizer, param_groups

WIDTHS = (32, 64, 128, 256)  # 8x, base 32: the model family at depth 2 with 16-wide heads (1 to 16 heads)


def family(width: int, parametrization: str, **kw) -> ModelConfig:
    cfg = ModelConfig(vocab_size=64, depth=2, aspect_ratio=width // 2, depth_head_dim=16, max_seq_len=32,
                      parametrization=parametrization, mup_base_dim=WIDTHS[0], **kw)
    cfg.apply_depth()
    return cfg


def rms(t: torch.Tensor) -> float:
    return t.pow(2).mean().sqrt().item()


def coordinates(cfg: ModelConfig, optimizer: str, steps: int = 4, lr: float = 1e-2) -> dict[str, float]:
    """RMS of the logits and of the last block's output on one fixed batch after `steps` optimizer steps at `lr`
    (trained on that batch), and of their change since init (the updates' effect), as the mup package's coordinate
    check measures them."""
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (8, 33), generator=torch.Generator().manual_seed(1))
    idx, targets = x[:, :-1], x[:, 1:]  # B T each
    opt = build_optimizer(model, TrainConfig(lr=lr, weight_decay=0.0), "cpu", OptimConfig(name=optimizer))

    def probe() -> dict[str, torch.Tensor]:
        seen: dict[str, torch.Tensor] = {}
        hook = model.layers[-1].register_forward_hook(lambda m, i, out: seen.__setitem__("block", out))  # B T C
        with torch.no_grad():
            seen["logits"] = model(idx)  # B T V
        hook.remove()
        return seen

    before = probe()
    for _ in range(steps):
        model(idx, targets).backward()
        opt.step()
        opt.zero_grad()
    after = probe()
    return {**{k: rms(v) for k, v in after.items()}, **{f"Δ{k}": rms(after[k] - before[k]) for k in after}}


# Widest over narrowest under mup stays within FLAT either way; under sp it passes GROWS. Measured at 256/32 over
# init seeds 0-5 (lr 1e-2, 4 steps): mup 0.84-1.03 for all four quantities and both optimizers; AdamW sp logits
# 3.4-4.3, Δlogits 3.7-4.7, block 70-93, Δblock 79-103; Muon (match_rms_adamw) sp logits 3.4-3.7, Δlogits 3.6-3.9,
# block 2.06-2.12, Δblock 2.32-2.40.
FLAT = 1.5
GROWS = {"adamw": {"logits": 2.5, "Δlogits": 2.5, "block": 10.0, "Δblock": 10.0},
         "muon": {"logits": 2.5, "Δlogits": 2.5, "block": 1.5, "Δblock": 1.5}}


@pytest.mark.parametrize("optimizer, widths", [("adamw", WIDTHS), ("muon", WIDTHS[::3])])
def test_coordinate_check_activations_and_updates_stay_flat_across_width_under_mup_and_grow_under_sp(optimizer,
                                                                                                     widths):
    table = {p: {w: coordinates(family(w, p), optimizer) for w in widths} for p in ("sp", "mup")}
    ratios = {p: {k: rows[widths[-1]][k] / rows[widths[0]][k] for k in rows[widths[0]]} for p, rows in table.items()}
    for p, rows in table.items():  # pytest -s shows the figures
        for w, row in rows.items():
            print(optimizer, p, w, {k: f"{v:.3g}" for k, v in row.items()})
        print(optimizer, p, f"{widths[-1]}/{widths[0]}", {k: f"{v:.2f}" for k, v in ratios[p].items()})
    assert all(1 / FLAT < r < FLAT for r in ratios["mup"].values()), ratios
    assert all(ratios["sp"][k] > bound for k, bound in GROWS[optimizer].items()), ratios


def test_mup_at_the_base_width_is_sp_exactly():
    """m = 1: the same weights, logits and lrs, bit for bit (so a config tuned under sp keeps its lr there)."""
    base = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=16,
                       tie_embeddings=False)
    mup = ModelConfig(**{**vars(base), "parametrization": "mup", "mup_base_dim": 64})
    models = []
    for cfg in (base, mup):
        torch.manual_seed(3)
        models.append(build_model(cfg))
    idx = torch.randint(0, 64, (2, 16))
    assert all(torch.equal(a, b) for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()))
    assert torch.equal(models[0](idx), models[1](idx))
    lrs = [[g["base_lr"] for g in param_groups(m, TrainConfig())] for m in models]
    assert lrs[0] == lrs[1]


def test_mup_scales_the_logits_and_the_hidden_init_by_the_width_and_sp_does_not():
    """4x the base width: logits = head(h) / 4; hidden matrices' std init_std / 2, the embedding's and an untied
    head's init_std. sp's logits are the head of the hidden states, unscaled."""
    model = build_model(ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                    max_seq_len=8, mup_base_dim=16))  # a base dim sp ignores
    idx = torch.randint(0, 64, (2, 8))
    assert torch.equal(model(idx), model.lm_head(model.hidden(idx)))
    cfg = ModelConfig(vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=768, max_seq_len=8,
                      tie_embeddings=False, parametrization="mup", mup_base_dim=64)
    model, idx = build_model(cfg), torch.randint(0, 512, (2, 8))
    torch.testing.assert_close(model(idx), model.lm_head(model.hidden(idx)) / 4)
    assert cfg.width_mult == 4.0
    assert model.layers[0].attention.wq.weight.std().item() == pytest.approx(cfg.init_std / 2, rel=0.05)
    assert model.layers[0].mlp.w1.weight.std().item() == pytest.approx(cfg.init_std / 2, rel=0.05)
    wo = model.layers[0].attention.wo.weight.std().item()  # the depth scaling stays on top
    assert wo == pytest.approx(cfg.init_std / 2 / math.sqrt(2 * cfg.n_layers), rel=0.05)
    for table in (model.embed.weight, model.lm_head.weight):
        assert table.std().item() == pytest.approx(cfg.init_std, rel=0.05)


# optim.name, optim.muon_adjust_lr -> the matrix kind's lr factor at width_mult 4 (every other kind: 1).
LR_FACTORS = [("adamw", "match_rms_adamw", 1 / 4), ("muon", "match_rms_adamw", 1 / 2), ("muon", "original", 1.0)]


@pytest.mark.parametrize("name, adjust, factor", LR_FACTORS, ids=[f"{n}-{a}" for n, a, _ in LR_FACTORS])
def test_mup_scales_only_the_hidden_matrices_lr(name, adjust, factor):
    model = build_model(ModelConfig(vocab_size=64, dim=128, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=256,
                                    max_seq_len=8, tie_embeddings=False, residual_scalars=True,
                                    parametrization="mup", mup_base_dim=32))
    train = TrainConfig(lr=0.01)
    lrs = {g["kind"]: g["base_lr"] for g in param_groups(model, train, OptimConfig(name=name, muon_adjust_lr=adjust))}
    assert lrs == {"matrix": pytest.approx(0.01 * factor), "embedding": 0.01, "head": 0.01, "scalar": 0.01}
    opt = build_optimizer(model, train, "cpu", OptimConfig(name=name, muon_adjust_lr=adjust))
    assert {g["kind"]: g["lr"] for g in opt.param_groups} == lrs  # the schedule starts from these


def test_a_mup_model_is_refused_by_the_hugging_face_export():
    """LlamaForCausalLM has no output multiplier: the export would compute other logits."""
    with pytest.raises(ConfigError) as refused:
        check_exportable(ModelConfig(parametrization="mup"))
    assert "model.parametrization=mup" in str(refused.value) and "--model.parametrization=sp" in str(refused.value)
