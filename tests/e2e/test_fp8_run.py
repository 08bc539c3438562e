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
from conftest import REPO, small_overrides, torchrun_started
from safetensors.torch import load_file

from nanopt import cli
from nanopt.main import run

pytest.importorskip("torchao.float8", reason="the fp8 extra (torchao) is not installed")

STEPS = 8
# One layer: every run here is about fp8's state, and the compiled one's graph compiles in about half the time. fp32:
# emulated FP8 needs no bf16, which a CPU without bf16 hardware emulates ~85x slower (test_fp8.py's run is in bf16).
ARGS = small_overrides(**{"train.fp8": "tensorwise", "train.fp8_filter": "all", "train.max_steps": STEPS,
                          "train.precision": "fp32",
                          "checkpoint.every": 2, "log.tensorboard": "false", "model.n_layers": 1})


def losses(run_dir: Path) -> list[tuple[int, float]]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def weights(run_dir: Path) -> bytes:
    return (run_dir / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_an_fp8_run_learns_resumes_bit_exactly_exports_plain_weights_compiles_and_keeps_ddp_replicas_identical(
        tmp_path):
    """One fp8 run, the reference for all of it: killed in step 5 it resumes to its bits, compiled it gives the same
    losses, its checkpoint is a plain model's; two ranks (a torchrun meanwhile) end with identical replicas. The
    run to kill goes in a process of its own while this one compiles."""
    reference, resumed, compiled, ddp = (tmp_path / name for name in ("reference", "resumed", "compiled", "ddp"))
    ddp_finished = torchrun_started(2, [*ARGS, f"--run.dir={ddp}", "--train.max_steps=4"])
    assert run([*ARGS, f"--run.dir={reference}"]) == 0
    curve = losses(reference)
    assert curve[-1][1] < curve[0][1] - 0.5  # it learns
    env = {**os.environ, "NANOPT_TEST_HOOK": "kill-in-step:5", "OMP_NUM_THREADS": "1"}
    killed = subprocess.Popen([sys.executable, "-m", "nanopt.main", *ARGS, f"--run.dir={resumed}"], cwd=REPO,
                              env=env, stdout=subprocess.DEVNULL, stderr=(err := (tmp_path / "killed.err").open("w")))

    assert run([*ARGS, f"--run.dir={compiled}", "--train.compile=true"]) == 0
    for (_, a), (_, b) in zip(curve, losses(compiled), strict=True):
        assert b == pytest.approx(a, rel=2e-3)

    with err:
        assert killed.wait(timeout=300) == -signal.SIGKILL, (tmp_path / "killed.err").read_text()[-2000:]
    assert run([*ARGS, f"--run.dir={resumed}"]) == 0
    assert weights(resumed) == weights(reference) and losses(resumed) == curve

    assert cli.run(["export", str(reference), "--out", str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(t.dtype == torch.float32 and "scale" not in k for k, t in exported.items())
    assert run([*ARGS, f"--run.dir={reference}", f"--train.max_steps={STEPS + 2}", "--train.fp8=none",
                "--checkpoint.allow_changes=train.fp8,train.max_steps"]) == 0  # a later flag wins
    assert json.loads((reference / "summary.json").read_text())["fp8"] == "none"

    proc = ddp_finished()
    assert proc.returncode == 0, proc.stderr[-3000:]
    digests = json.loads((ddp / "summary.json").read_text())["weights_sha256_per_rank"]
    assert len(digests) == 2 and digests[0] == digests[1]
