"""Optimizer groups and the learning-rate schedule (a pure function of step)."""
from __future__ import annotations

import pytest

from nanopt.config import ModelConfig, TrainConfig
from nanopt.model import build_model
from nanopt.optim import build_optimizer, lr_at, param_groups


def test_norm_gains_do_not_decay_and_tied_weights_appear_once():
    model = build_model(ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16))
    decay, no_decay = param_groups(model, 0.1)
    assert all(p.dim() == 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert len(no_decay["params"]) == 2 * 2 + 1  # two norms per layer + the final norm
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    opt = build_optimizer(model, TrainConfig(), "cpu")
    assert opt.defaults["betas"] == (0.9, 0.95)


def test_cosine_warms_up_linearly_then_decays_to_the_floor():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1, schedule="cosine")
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # half way: the mean of peak and floor
    assert lr_at(110, cfg) == pytest.approx(0.1)
    values = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_is_flat_then_decays_over_the_last_fraction():
    cfg = TrainConfig(lr=2.0, warmup_steps=0, max_steps=100, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert lr_at(0, cfg) == 2.0 and lr_at(79, cfg) == 2.0
    assert lr_at(80, cfg) == pytest.approx(2.0 - 2.0 / 20)
    assert lr_at(99, cfg) == pytest.approx(0.0)


def test_constant_schedule():
    cfg = TrainConfig(lr=0.5, warmup_steps=4, schedule="constant")
    assert [lr_at(s, cfg) for s in (0, 3, 4, 1000)] == [0.125, 0.5, 0.5, 0.5]
