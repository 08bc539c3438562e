"""The training loop end to end on the embedded corpus: loss falls, the run directory is complete."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from nanopt import train
from nanopt.config import TrainConfig, load_config
from nanopt.main import run
from nanopt.plan import build_plan

from conftest import small_overrides


@pytest.mark.slow
def test_tiny_run_learns_and_writes_a_complete_run_directory(tmp_path, corpus_dir, capsys):
    args = small_overrides(**{
        "train.max_steps": 30, "train.lr": 1e-2, "train.warmup_steps": 3, "log.every": 5,
        "eval.every": 15, "sample.num_samples": 1, "sample.max_new_tokens": 20,
    })
    assert run([*args, f"--run.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert train_lines[0]["step"] == 1 and train_lines[-1]["step"] == 30
    for r in train_lines:
        assert {"step", "loss", "lr", "tokens_per_s", "mfu"} <= r.keys()
        assert r["tokens_per_s"] > 0
    # Bytes of English: ln(257) = 5.55 at init; a working loop gets well under 3.5 in 30 small steps.
    assert train_lines[0]["loss"] > 5.0
    assert train_lines[-1]["loss"] < 3.5
    assert [e["step"] for e in evals] == [0, 15, 30]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.5
    assert 0 < evals[-1]["val_bpb"] < evals[0]["val_bpb"]

    saved = load_config(tmp_path / "config.yaml")
    assert saved.train.max_steps == 30 and saved.model.dim == 64
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    ckpt = tmp_path / "checkpoints" / "step_000030"
    assert (ckpt / "COMPLETE").exists()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000030"
    weights = load_file(str(ckpt / "model.safetensors"))
    assert weights["embed.weight"].shape == (257, 64)
    assert all(torch.isfinite(w).all() for w in weights.values())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["tokens_seen"] == 30 * 256
    assert summary["final_val_loss"] == evals[-1]["val_loss"]
    assert "samples from step 30" in out and "Elementary, my dear" in out


@pytest.mark.slow
def test_bf16_autocast_and_pure_bf16_both_train(tmp_path, corpus_dir, capsys):
    for precision, weight_dtype in (("bf16", torch.float32), ("bf16-pure", torch.bfloat16)):
        run_dir = tmp_path / precision
        args = small_overrides(**{"train.precision": precision, "train.max_steps": 12, "train.lr": 1e-2,
                                  "log.every": 11})
        assert run([*args, f"--run.dir={run_dir}"]) == 0
        # bf16 weights cannot hold a decay of lr x wd = 1e-3 per step below ~2^-9: the run says so.
        assert ("rounds away" in capsys.readouterr().out) == (precision == "bf16-pure")  # the log is on stdout
        losses = [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
        assert losses[-1] < losses[0] - 1.0, (precision, losses)
        weights = load_file(str(run_dir / "checkpoints" / "step_000012" / "model.safetensors"))
        assert weights["embed.weight"].dtype == weight_dtype, precision


def test_each_component_decides_when_it_acts_and_the_pause_asks_them():
    """One cadence rule per component: evaluation every eval.every steps, a periodic save every checkpoint.every
    (the last step's of both come from finish()), and the step before any of them is timed to the end."""
    from types import SimpleNamespace

    from nanopt.checkpoint import Checkpointer
    from nanopt.config import parse_overrides
    from nanopt.harness import TaskSpec
    from nanopt.train import Session, TaskScorer, Validator

    cfg = load_config(None, parse_overrides(small_overrides(
        **{"train.max_steps": 12, "eval.every": 4, "checkpoint.every": 3, "eval.tasks": "t",
           "eval.tasks_every": 5})))
    ckpt, evaluator = Checkpointer.__new__(Checkpointer), Validator.__new__(Validator)  # only their cadence
    tasks = TaskScorer.__new__(TaskScorer)
    ckpt.cfg = evaluator.cfg = tasks.cfg = cfg
    tasks.spec = TaskSpec(["t"])
    steps = range(1, 13)
    assert [s for s in steps if ckpt.should_save(s)] == [3, 6, 9]
    assert [s for s in steps if evaluator.due(s)] == [4, 8]
    assert [s for s in steps if tasks.due(s)] == [5, 10]  # and the last step's, from finish()
    run = SimpleNamespace(cfg=cfg, evaluator=evaluator, ckpt=ckpt, tasks=tasks)
    assert [s for s in steps if Session.pause_follows(run, s)] == [3, 4, 5, 6, 8, 9, 10, 12]


def test_compile_follows_the_ddp_split_switch_and_a_seq_len_schedule_compiles_static_shapes():
    """train.compile_ddp_split is dynamo's optimize_ddp (the fallback for FP8 + compile + DDP); with several
    sequence lengths the model is compiled with static shapes and room for a graph per length."""
    # torch's own patch, not monkeypatch: pytest's undo deletes an attribute it did not find in the module's
    # __dict__, and a deleted torch._dynamo.config entry is gone for the session (every later DDP() raises).
    with torch._dynamo.config.patch(optimize_ddp=True, recompile_limit=8):
        model = torch.nn.Linear(4, 4)
        t = TrainConfig(compile_ddp_split=False)
        train.compiled(model, t, build_plan(t, 1))
        assert torch._dynamo.config.optimize_ddp is False and torch._dynamo.config.recompile_limit == 8
        t = TrainConfig(seq_len=64, seq_len_schedule=",".join(f"{i}:{8 * (i + 1)}" for i in range(8)))
        train.compiled(model, t, build_plan(t, 1))
        assert torch._dynamo.config.optimize_ddp is True and torch._dynamo.config.recompile_limit == 16
