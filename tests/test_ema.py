"""The averaged weights (nanopt/training/ema.py): the update from train.ema_start, the exact swap, the whole tensors
a checkpoint holds; in a run: training untouched, evaluations that name it, its file from ema_start on."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import small_overrides
from safetensors.torch import load_file

from nanopt import rundirs
from nanopt.main import run
from nanopt.training import checkpoint
from nanopt.training.ema import EMA


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(dtype)


def _set(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def test_the_average_starts_at_ema_start_follows_the_decay_and_round_trips_whole():
    model = _model()
    ema = EMA(model, decay=0.75, start=2)
    ema.begin(0)
    ema.update(1)
    assert not ema.started and ema.state_dict() == {"decay": 0.75, "start": 2, "started": False}
    for step, value in ((2, 4.0), (3, 8.0), (4, 0.0)):  # step 2's weights are its first value: 4, 5, 3.75
        _set(model, value)
        ema.update(step)
    assert all(torch.equal(a, torch.full_like(a, 3.75)) and a.dtype == torch.float32 for a in ema.averaged)
    # A resumed run at or past ema_start begins from its weights (ema_start 0: the initial weights), in a copy.
    ema = EMA(model := _model(), 0.9, start=0)
    ema.begin(0)
    assert ema.started and all(torch.equal(a, p) for a, p in zip(ema.averaged, model.parameters()))
    assert all(a.data_ptr() != p.data_ptr() for a, p in zip(ema.averaged, model.parameters()))
    whole = ema.full_weights()  # the whole average round-trips
    assert set(whole) == {n for n, _ in model.named_parameters()} and not ema.full_weights(keep=False)
    other = EMA(_model(), 0.9, start=0)
    _set(other.model, 3.0)  # the loaded average, not the other model's own weights
    other.load_tensors(lambda tensors: [t.copy_(whole[n]) for n, t in tensors.items()])
    assert all(torch.equal(a, b) for a, b in zip(ema.averaged, other.averaged))
    with pytest.raises(ValueError, match="decay"):
        EMA(model, 1.0, start=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swapping_in_and_back_is_exact_and_leaves_the_average_alone(dtype):
    model = _model(dtype)
    ema = EMA(model, 0.5, start=0)
    ema.begin(0)
    with torch.no_grad():
        for a in ema.averaged:
            a.add_(0.123456789)  # not representable in bf16: the swap must not round the average
    own, average = [p.detach().clone() for p in model.parameters()], [a.clone() for a in ema.averaged]
    with ema.swapped() as weights:
        assert weights == "ema" and all(torch.equal(p, a.to(dtype)) for p, a in zip(model.parameters(), average))
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), own))
    assert all(torch.equal(a, b) for a, b in zip(ema.averaged, average))
    with EMA(model, 0.5, start=10).swapped() as weights:  # before ema_start the model keeps its own, and says so
        assert weights == "model"
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), own))


ARGS = small_overrides(**{"train.precision": "fp32", "train.max_steps": 4, "checkpoint.every": 1,
                          "checkpoint.keep": 4, "eval.every": 2, "log.tensorboard": "false"})
MODEL = rundirs.MODEL_FILE
EMA_ARGS = ["--train.ema_decay=0.5", "--train.ema_start=3", "--eval.weights=ema"]


def _ckpt(run_dir: Path, step: int, name: str = "") -> Path:
    return run_dir / rundirs.CHECKPOINTS_DIR / f"step_{step:06d}" / name


def test_a_run_with_averaged_weights_trains_the_same_and_its_records_name_them(tmp_path):
    plain, averaged = tmp_path / "plain", tmp_path / "averaged"
    assert run([*ARGS, f"--run.dir={plain}"]) == 0
    assert run([*ARGS, *EMA_ARGS, f"--run.dir={averaged}"]) == 0
    # Keeping and swapping the average never changes the training: the same weights, byte for byte.
    for step in (2, 4):
        assert _ckpt(plain, step, MODEL).read_bytes() == _ckpt(averaged, step, MODEL).read_bytes()
    # ema_start 3: no average in step 2's checkpoint; from step 3 one, listed in the manifest and verified.
    assert not _ckpt(averaged, 2, rundirs.EMA_FILE).exists()
    for step in (3, 4):
        assert checkpoint.verify_checkpoint(_ckpt(averaged, step)) is None
        assert checkpoint.weights_crc32(_ckpt(averaged, step), rundirs.EMA_FILE) is not None
    w3, w4, ema = (load_file(_ckpt(averaged, s, f)) for s, f in ((3, MODEL), (4, MODEL), (4, rundirs.EMA_FILE)))
    assert ema.keys() == w4.keys()
    for name in ema:  # 0.5 x step 3's weights + 0.5 x step 4's
        torch.testing.assert_close(ema[name], (w3[name] + w4[name]) / 2)
    records = rundirs.read_records(averaged / rundirs.METRICS_FILE)
    named = [(r["step"], r["weights"]) for r in records if "val_loss" in r or "test_loss" in r]
    assert named == [(0, "model"), (2, "model"), (4, "ema"), (4, "ema")]  # before ema_start: the model's
    assert {r.get("weights") for r in rundirs.read_records(plain / rundirs.METRICS_FILE)
            if "val_loss" in r} == {"model"}  # every validation record names its weights
    summary = json.loads((averaged / rundirs.SUMMARY_FILE).read_text())
    assert summary["eval_weights"] == "ema" and summary["final_val_loss"] == records[-2]["val_loss"]
    # the averaged weights were evaluated, not the model's
    assert summary["final_val_loss"] != json.loads((plain / rundirs.SUMMARY_FILE).read_text())["final_val_loss"]
