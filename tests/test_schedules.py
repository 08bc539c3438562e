"""train.batch_schedule / seq_len_schedule: each step's stage, its lr factor and accounting, the windows loader
across stages (and bit-identical without them), exact resume mid-stage, and compiling once per stage."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, small_overrides
from nanopt import data, shards
from nanopt.config import load_config, parse_overrides, resolve
from nanopt.main import run
from nanopt.optim import lr_multiplier
from nanopt.plan import Plan, build_plan


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


# ---------------------------------------------------------------- the windows loader
def _windows(tmp_path, seq_len: int = 16) -> data.TokenWindows:
    paths = [shards.write_shard(tmp_path / f"train_{s:06d}.bin", np.arange(s * 2500, (s + 1) * 2500), 65536)
             for s in range(2)]  # distinct ids: a window's content names the window
    return data.TokenWindows(paths, seq_len)


def _rows(loader: data.Loader, steps: int, accum=None, seq_len=None) -> list[tuple[int, ...]]:
    return [tuple(r) for _ in range(steps) for x, _ in loader.micro_batches(accum, seq_len) for r in x.tolist()]


def test_windows_without_a_schedule_are_the_old_formula_bit_for_bit(tmp_path):
    w = _windows(tmp_path)
    mb, world, accum, seed = 4, 2, 3, 11
    per_step = accum * world * mb
    for rank in range(world):
        loader = data.Loader(w, mb, rank, world, accum, seed)
        for t in range(30):  # past an epoch (312 windows)
            got = loader.micro_batches()
            for m, (x, y) in enumerate(got):
                samples = [t * per_step + (m * world + rank) * mb + b for b in range(mb)]
                perms = {e: torch.randperm(len(w), generator=torch.Generator().manual_seed(seed * 1_000_003 + e))
                         for e in {s // len(w) for s in samples}}
                rows = np.stack([w.get(int(perms[s // len(w)][s % len(w)])) for s in samples])
                assert torch.equal(x, torch.from_numpy(rows[:, :-1])) and torch.equal(y, torch.from_numpy(rows[:, 1:]))


def test_a_batch_change_serves_more_rows_and_a_seq_len_change_a_new_grid(tmp_path):
    loader = data.Loader(_windows(tmp_path, seq_len=32), 2, 0, 1, 2, seed=1)
    assert len(_rows(loader, 3, accum=2, seq_len=16)) == 12 and loader.sample == 12
    assert len(_rows(loader, 1, accum=5, seq_len=16)) == 10 and loader.sample == 22
    rows = _rows(loader, 2, accum=2, seq_len=32)
    # 22 windows of 16 tokens = 352 tokens consumed: the 32-token grid goes on at sample ceil(352 / 32) = 11
    assert {len(r) for r in rows} == {32} and loader.sample == 11 + 8
    grid = loader._grid(32)
    perm = torch.randperm(len(grid), generator=torch.Generator().manual_seed(1 * 1_000_003))
    assert rows[0] == tuple(grid.get(int(perm[11]))[:-1])
    assert set(loader._grids) == {16, 32}


def test_the_windows_loader_resumes_mid_stage_from_its_state(tmp_path):
    w = _windows(tmp_path)
    plan = [(2, 16)] * 3 + [(4, 16)] * 3 + [(2, 32)] * 40  # 40 steps of 32: past an epoch of that grid
    straight = data.Loader(w, 2, 0, 1, 2, seed=4)
    want = [row for accum, seq in plan for row in _rows(straight, 1, accum, seq)]
    first = data.Loader(w, 2, 0, 1, 2, seed=4)
    got = [row for accum, seq in plan[:8] for row in _rows(first, 1, accum, seq)]
    resumed = data.Loader(w, 2, 0, 1, 2, seed=0)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [row for accum, seq in plan[8:] for row in _rows(resumed, 1, accum, seq)]
    assert got == want


def test_a_checkpoint_from_before_the_cursor_resumes_where_it_was(tmp_path):
    w = _windows(tmp_path)
    straight = data.Loader(w, 4, 0, 1, 2, seed=5)
    want = _rows(straight, 10)[5 * 8:]
    resumed = data.Loader(w, 4, 0, 1, 2, seed=0)
    resumed.load_state_dict({"step": 5, "seed": 5, "world": 1, "accum": 2, "micro_batch": 4})
    assert _rows(resumed, 5) == want


# ---------------------------------------------------------------- real runs
STEPS = 8
# Stage 1 steps 0-2 (256 tokens, seq 16), stage 2 steps 3-4 (512, seq 16), stage 3 steps 5-7 (512, seq 32).
SCHEDULED = {"train.batch_schedule": "0:256,3:512", "train.seq_len_schedule": "0:16,5:32",
             "train.precision": "fp32", "train.max_steps": STEPS, "checkpoint.every": 2, "log.tensorboard": "false"}


def _args(run_dir, **changes: object) -> list[str]:
    return [*small_overrides(**{**SCHEDULED, **changes}), f"--run.dir={run_dir}"]


@pytest.mark.slow
def test_a_scheduled_run_counts_its_stages_and_resumes_mid_stage_bit_exactly(tmp_path, corpus_dir, capsys):
    reference = tmp_path / "reference"
    assert run(_args(reference)) == 0
    out = capsys.readouterr().out
    assert "stage 2 from step 3: 512 tokens/step, seq 16, accum 8, lr x1.41" in out
    assert "stage 3 from step 5: 512 tokens/step, seq 32, accum 4, lr x1.41" in out
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["tokens_seen"] == 3 * 256 + 5 * 512 and summary["packing_cropped_share"] is None
    records = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    lines = {r["step"]: r for r in records if "loss" in r}
    cfg = load_config(reference / "config.yaml")
    ratio = [lines[s]["lr"] / lr_multiplier(s - 1, cfg.train) for s in range(1, STEPS + 1)]
    assert ratio[3:] == pytest.approx([ratio[0] * math.sqrt(2)] * 5) and ratio[:3] == pytest.approx([ratio[0]] * 3)
    assert "cropped_share" not in lines[1]

    killed = tmp_path / "killed"  # killed in step 5: resumes from step 4, inside stage 2
    env = {**os.environ, "NANOPT_TEST_HOOK": "kill-in-step:5", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "nanopt.main", *_args(killed)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert run(_args(killed)) == 0
    assert "stage 2 from step 4: 512 tokens/step" in capsys.readouterr().out
    after = json.loads((killed / "summary.json").read_text())
    assert after["weights_sha256_per_rank"] == summary["weights_sha256_per_rank"]
    assert after["tokens_seen"] == summary["tokens_seen"]


@pytest.mark.slow
def test_compiled_each_seq_len_is_one_static_graph_a_batch_change_none_and_a_recompile_no_mfu_figure(tmp_path,
                                                                                                  corpus_dir):
    """micro_batch_size is fixed, so a batch change is shape-free. Three lengths (16, 32, then 8): under dynamo's
    default the second recompiles with T dynamic and the third reuses that slower graph; static, each length is its
    own graph, 3 x one length's. The first step of each stage, logged alone with its compile, has no MFU."""
    counts = {}
    for name, seq_schedule in (("one", ""), ("three", "0:16,2:32,4:8")):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        args = _args(tmp_path / name, **{"train.compile": "true", "train.max_steps": 6, "train.seq_len_schedule":
                                         seq_schedule, "train.batch_schedule": "0:256,2:512,4:1024", "log.every": 1,
                                         "checkpoint.every": 0})
        assert run(args) == 0
        counts[name] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # "one" changes its batch twice (accum 2 -> 4 -> 8) on a single seq_len: no recompile for that
    assert counts["one"] > 0 and counts["three"] == 3 * counts["one"], counts
    records = [json.loads(x) for x in (tmp_path / "three" / "metrics.jsonl").read_text().splitlines()]
    mfu = {r["step"]: r["mfu"] for r in records if "loss" in r}
    assert mfu[1] is None and mfu[3] is None and mfu[5] is None  # each stage's first step
    assert mfu[4] is not None and mfu[6] is not None
