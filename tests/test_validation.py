"""Evaluation (nanopt/training/validation.py): the loss and bits per byte, checked by hand."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import CPU

from nanopt.config import ModelConfig
from nanopt.recipe.model import build_model
from nanopt.training.validation import SpeedrunClock, evaluate

torch.set_num_threads(1)


# ---------------------------------------------------------------- evaluation


def test_bpb_matches_hand_computation():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=5, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                    max_seq_len=8))
    token_bytes = torch.tensor([1, 2, 3, 0, 4])  # id 3 is a special token: it covers no bytes
    x = torch.tensor([[0, 1, 2, 3], [4, 4, 0, 1]])
    y = torch.tensor([[1, 2, 3, 4], [4, 0, 1, 2]])
    # A zero head gives uniform logits: ln 5 nats on each of 8 targets, over 2+3+0+4 + 4+1+2+3 = 19 bytes.
    torch.nn.init.zeros_(model.lm_head.weight)
    loss, bpb = evaluate(model, [(x, y)], token_bytes, CPU)
    assert loss == pytest.approx(math.log(5), abs=1e-6)
    assert bpb == pytest.approx(8 * math.log2(5) / 19, abs=1e-6)
    # Random weights, two batches: per-token cross-entropy summed by hand.
    torch.nn.init.normal_(model.lm_head.weight, 0, 0.5)
    batches = [(x[:1], y[:1]), (x[1:], y[1:])]
    loss, bpb = evaluate(model, batches, token_bytes, CPU)
    with torch.no_grad():
        nats = F.cross_entropy(model(x).reshape(-1, 5), y.reshape(-1), reduction="sum").item()
    assert loss == pytest.approx(nats / 8, rel=1e-5)
    assert bpb == pytest.approx(nats / math.log(2) / 19, rel=1e-5)


# ---------------------------------------------------------------- the speedrun clock


def test_the_clock_says_when_its_target_was_not_reached_and_how_close_the_run_came():
    clock = SpeedrunClock(1.6)
    clock.observe(4.9, 7.1, 2, 512, 0.5, CPU)
    assert clock.missed(4, 4.6775, 6.7483) == ("target val loss 1.6000 not reached in 4 steps (best val loss 4.6775, "
                                               "val bpb 6.7483); summary.json says \"target_reached\": false")
    assert clock.summary()["target_reached"] is False
    assert "(no evaluation ran)" in SpeedrunClock(1.6).missed(4, None, None)
    assert SpeedrunClock(6.5, "val_bpb").missed(4, 4.6, 6.7).startswith("target val bpb 6.5000 not reached")
    clock.observe(1.5, 2.2, 6, 1536, 1.5, CPU)
    assert clock.missed(8, 1.5, 2.2) is None  # reached
    assert SpeedrunClock(None).missed(8, 4.6, 6.7) is None  # no target
