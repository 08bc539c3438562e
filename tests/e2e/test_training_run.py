"""Whole training runs on the embedded corpus: the loss falls and the run directory is complete, bf16 and pure bf16
both train (and a CPU without bf16 hardware says what bf16 costs), and the loop logs a numeric MFU on CPU."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import small_overrides
from safetensors.torch import load_file

from nanopt.config import load_config
from nanopt.distributed import runtime
from nanopt.main import run


@pytest.mark.slow
def test_tiny_run_learns_and_writes_a_complete_run_directory(tmp_path, corpus_dir, capsys, monkeypatch):
    """Also bf16 autocast on a CPU without bf16 hardware (its flags say AVX2 here, whatever this CPU
    is): the run warns once with the measured slowdown and the fix, keeps the user's precision, records the kind."""
    monkeypatch.setattr(runtime, "cpu_isa", lambda: ("AVX2", False))
    args = small_overrides(**{
        "train.precision": "bf16", "train.max_steps": 30, "train.lr": 1e-2, "train.warmup_steps": 3, "log.every": 5,
        "eval.every": 15, "sample.num_samples": 1, "sample.max_new_tokens": 20,
    })
    assert run([*args, f"--run.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "rounds away" not in out and out.count("has no bf16 hardware") == 1
    assert "slower in bf16 than in fp32" in out and "--train.precision=fp32" in out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert train_lines[0]["step"] == 1 and train_lines[-1]["step"] == 30
    assert [r["step"] for r in train_lines] == [1, 5, 10, 15, 20, 25, 30]  # step 1, then every log.every
    for r in train_lines:
        assert {"step", "loss", "lr", "tokens_per_s", "mfu"} <= r.keys()
        assert r["tokens_per_s"] > 0
    # A numeric MFU on CPU, against a measured peak, from the first step past the warm-up.
    assert "MEASURED" in out and train_lines[0]["mfu"] is None
    for r in train_lines[1:]:
        assert isinstance(r["mfu"], float) and 0 < r["mfu_6n"] < r["mfu"], r
        assert r["hfu"] == r["mfu"], r  # the small config's micro-batch is one loss chunk: nothing recomputed
        assert r["peak_memory_gib"] > 0, r
    # Bytes of English: ln(257) = 5.55 at init; a working loop gets well under 3.5 in 30 small steps.
    assert train_lines[0]["loss"] > 5.0
    assert train_lines[-1]["loss"] < 3.5
    assert [e["step"] for e in evals] == [0, 15, 30]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.5
    assert 0 < evals[-1]["val_bpb"] < evals[0]["val_bpb"]

    saved = load_config(tmp_path / "config.yaml")
    assert saved.train.max_steps == 30 and saved.model.dim == 64 and saved.train.precision == "bf16"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    ckpt = tmp_path / "checkpoints" / "step_000030"
    assert (ckpt / "COMPLETE").exists()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000030"
    weights = load_file(str(ckpt / "model.safetensors"))
    assert weights["embed.weight"].shape == (257, 64) and weights["embed.weight"].dtype == torch.float32
    assert all(torch.isfinite(w).all() for w in weights.values())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["tokens_seen"] == 30 * 256
    assert summary["final_val_loss"] == evals[-1]["val_loss"]
    assert "MEASURED" in summary["mfu_peak_source"] and summary["mfu_peak_flops_per_device"] > 0
    assert "(AVX2, bf16 emulated" in summary["hardware"]
    assert train_lines[-1]["loss"] < train_lines[0]["loss"] - 1.0
    assert "samples from step 30" in out and "Elementary, my dear" in out


@pytest.mark.slow
def test_pure_bf16_trains(tmp_path, corpus_dir, capsys, monkeypatch):
    """On a CPU with bf16 hardware (AMX, whatever this CPU is): no warning about it, and bf16 weights."""
    monkeypatch.setattr(runtime, "cpu_isa", lambda: ("AMX", True))
    args = small_overrides(**{"train.precision": "bf16-pure", "train.max_steps": 12, "train.lr": 1e-2, "log.every": 11})
    assert run([*args, f"--run.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out  # the log is on stdout
    # bf16 weights cannot hold a decay of lr x wd = 1e-3 per step below ~2^-9: the run says so.
    assert "rounds away" in out and "has no bf16 hardware" not in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "(AMX, bf16 native" in summary["hardware"]
    assert load_config(tmp_path / "config.yaml").train.precision == "bf16-pure"  # never changed silently
    losses = [json.loads(x)["loss"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert losses[-1] < losses[0] - 1.0, losses
    weights = load_file(str(tmp_path / "checkpoints" / "step_000012" / "model.safetensors"))
    assert weights["embed.weight"].dtype == torch.bfloat16
