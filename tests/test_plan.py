"""The stage plan (nanopt/training/plan.py): train.batch_schedule / seq_len_schedule give each step its stage, its lr factor
and its tokens, in steps or in tokens, within max_steps."""
from __future__ import annotations

import math

import pytest
from conftest import REPO, small_overrides

from nanopt.config import load_config, parse_overrides, resolve
from nanopt.training.plan import Plan, build_plan


def _schedule(world: int = 1, **keys: object) -> Plan:
    cfg = resolve(load_config(None, parse_overrides(small_overrides(**keys))), world)
    return build_plan(cfg.train, world)


def test_a_step_is_in_the_last_stage_started_in_steps_or_in_tokens():
    by_steps = _schedule(**{"train.batch_schedule": "0:256,3:512", "train.seq_len_schedule": "0:16,5:32"})
    assert [(s.start, s.batch_tokens, s.seq_len, s.accum) for s in by_steps.stages] == [
        (0, 256, 16, 4), (3, 512, 16, 8), (5, 512, 32, 4)]
    assert [by_steps.at(step, 0).number for step in range(7)] == [1, 1, 1, 2, 2, 3, 3]
    by_tokens = _schedule(**{"train.batch_schedule": "0:256,1000:512", "train.schedule_unit": "tokens"})
    assert [by_tokens.at(0, tokens).number for tokens in (0, 768, 999, 1000, 5000)] == [1, 1, 1, 2, 2]
    assert _schedule(world=2, **{"train.batch_schedule": "0:256,3:512"}).stages[1].accum == 2  # 512 / (4 × 32 × 2)


@pytest.mark.parametrize("rule, factor", [("sqrt", math.sqrt(2)), ("linear", 2.0), ("none", 1.0)])
def test_the_lr_factor_follows_the_batch_lr_rule(rule, factor):
    schedule = _schedule(**{"train.batch_schedule": "0:256,3:512", "train.batch_lr_rule": rule})
    assert [s.lr_factor for s in schedule.stages] == [1.0, pytest.approx(factor)]
    assert [s.lr_factor for s in _schedule().stages] == [1.0]  # no schedule: the lr as before, exactly


def test_tokens_left_counts_each_stage_at_its_own_batch():
    by_steps = _schedule(**{"train.batch_schedule": "0:256,3:512", "train.max_steps": 6})
    assert by_steps.tokens_left(0) == 3 * 256 + 3 * 512
    assert by_steps.tokens_left(4) == 2 * 512
    by_tokens = _schedule(**{"train.batch_schedule": "0:256,1000:512", "train.schedule_unit": "tokens",
                             "train.max_steps": 6})
    assert by_tokens.tokens_left(0) == 4 * 256 + 2 * 512  # 4 steps of 256 reach 1000 tokens
    assert _schedule(**{"train.max_steps": 6}).tokens_left(2) == 4 * 256


def test_the_plan_gives_each_stage_its_steps_and_tokens_within_max_steps():
    by_steps = _schedule(**{"train.batch_schedule": "0:256,3:512", "train.seq_len_schedule": "0:16,5:32",
                            "train.max_steps": 8})
    assert [(s.first_step, s.steps, s.tokens) for s in by_steps.stages] == [(0, 3, 768), (3, 2, 1024), (5, 3, 1536)]
    assert sum(s.tokens for s in by_steps.stages) == 768 + 1024 + 1536
    short = _schedule(**{"train.batch_schedule": "0:256,3:512", "train.max_steps": 2})  # stage 2 is never reached
    assert [(s.first_step, s.steps, s.tokens) for s in short.stages] == [(0, 2, 512), (2, 0, 0)]
    # In tokens a stage runs whole steps until the next start: 4 × 256 passes 1000, and the first 512-token step
    # passes both 1200 and 1500, so the stage from 1200 is skipped (as the loop's at() skips it).
    by_tokens = _schedule(**{"train.batch_schedule": "0:256,1000:512,1200:384,1500:256",
                             "train.schedule_unit": "tokens", "train.max_steps": 9})
    assert [(s.first_step, s.steps) for s in by_tokens.stages] == [(0, 4), (4, 1), (5, 0), (5, 4)]
    tokens = 0
    for step in range(9):
        stage = by_tokens.at(step, tokens)
        assert stage.first_step <= step < stage.first_step + stage.steps
        tokens += stage.batch_tokens
    assert tokens == sum(s.tokens for s in by_tokens.stages) == 4 * 256 + 512 + 4 * 256


def test_the_speedrun_plan_trains_its_batch_ramp():
    plan = build_plan(load_config(REPO / "configs" / "speedrun-gpu.yaml").train, 1)  # one H100
    assert [(s.steps, s.batch_tokens, s.seq_len, s.accum) for s in plan.stages] == [
        (1000, 262_144, 2048, 4), (1000, 393_216, 2048, 6), (1500, 524_288, 2048, 8)]
    assert sum(s.tokens for s in plan.stages) == 1_441_792_000
