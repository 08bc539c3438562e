"""Training on what `nanopt prepare` wrote: it trains, and it refuses shards that do not match the manifest."""
from __future__ import annotations

import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub; fail fast if it tried
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
from conftest import small_overrides

from nanopt.main import run


def _train(out, tokenizer_dir, run_dir, **keys) -> int:
    return run(small_overrides(**{"data.source": out, "data.tokenizer": tokenizer_dir, "model.vocab_size": 600,
                                  "run.dir": run_dir, "train.seq_len": 32, **keys}))


def test_training_refuses_shards_that_do_not_match_the_manifest_naming_them(prepared, tokenizer_dir, tmp_path,
                                                                              capsys):
    _, out, _, _ = prepared
    for i in range(1, 6):
        (out / f"train_00000{i}.bin").unlink()  # a partial copy: one train shard of six arrived
    assert _train(out, tokenizer_dir, tmp_path / "run1", **{"train.max_steps": 1, "eval.every": 0}) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "train_000001.bin is missing" in err and "train_000005.bin is missing" in err and "nanopt prepare" in err
    assert not (tmp_path / "run1" / "checkpoints").exists()  # refused before anything was trained or written


@pytest.mark.slow
def test_training_runs_on_prepared_shards(prepared, tokenizer_dir, tmp_path):
    run_dir = tmp_path / "run"
    assert _train(prepared[1], tokenizer_dir, run_dir, **{"train.max_steps": 3, "eval.every": 3}) == 0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert abs(losses[0] - math.log(600)) < 1.0  # a fresh model on this 600-id vocabulary
    assert any("val_loss" in x for x in lines)
