"""train.fp8 runs on CPU (emulated): a run learns, resumes bit-exactly and exports plain weights, two ranks keep
identical replicas, and compiled matches eager."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, small_overrides, torchrun
from nanopt import cli
from nanopt.main import run

pytest.importorskip("torchao.float8", reason="the fp8 extra (torchao) is not installed")

# ---------------------------------------------------------------- a run: learns, resumes, exports, DDP, compile

STEPS = 8
ARGS = small_overrides(**{"train.fp8": "tensorwise", "train.fp8_filter": "all", "train.max_steps": STEPS,
                          "checkpoint.every": 2, "log.tensorboard": "false"})


def losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def weights(run_dir: Path) -> bytes:
    return (run_dir / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_an_fp8_run_learns_resumes_bit_exactly_and_exports_plain_weights(tmp_path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert run([*ARGS, f"--run.dir={reference}"]) == 0
    curve = [loss for _, loss in losses(reference)]
    assert curve[-1] < curve[0] - 0.5  # it learns
    env = {**os.environ, "NANOPT_TEST_HOOK": "kill-in-step:5", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "nanopt.main", *ARGS, f"--run.dir={resumed}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert run([*ARGS, f"--run.dir={resumed}"]) == 0
    assert weights(resumed) == weights(reference) and losses(resumed) == losses(reference)

    # The checkpoint is a plain model's: export writes ordinary weights, and a bf16 run resumes from it.
    assert cli.run(["export", str(reference), "--out", str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(t.dtype == torch.float32 and "scale" not in k for k, t in exported.items())
    plain = small_overrides(**{"run.dir": reference, "train.max_steps": STEPS + 2, "train.fp8": "none",
                               "train.fp8_filter": "all", "checkpoint.allow_changes": "train.fp8,train.max_steps"})
    assert run(plain) == 0
    assert json.loads((reference / "summary.json").read_text())["fp8"] == "none"


@pytest.mark.slow
def test_fp8_under_ddp_keeps_the_replicas_identical(tmp_path):
    proc = torchrun(2, [*ARGS, f"--run.dir={tmp_path}", "--train.max_steps=4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    digests = json.loads((tmp_path / "summary.json").read_text())["weights_sha256_per_rank"]
    assert len(digests) == 2 and digests[0] == digests[1]


@pytest.mark.slow
def test_fp8_compiles_and_matches_eager(tmp_path):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    assert run([*ARGS, f"--run.dir={eager}", "--train.max_steps=3"]) == 0
    assert run([*ARGS, f"--run.dir={compiled}", "--train.max_steps=3", "--train.compile=true"]) == 0
    for (_, a), (_, b) in zip(losses(eager), losses(compiled)):
        assert b == pytest.approx(a, rel=2e-3)
