"""Training on what `nanopt prepare` wrote: it trains, and it refuses shards that do not match the manifest."""
from __future__ import annotations

import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub; fail fast if it tried
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
from conftest import PREPARE_DOCS, prepare_config, run_module, small_overrides, write_source

from nanopt.data import prepare


def _train_exit(out, tokenizer_dir, run_dir, capsys) -> tuple[int, str]:
    from nanopt.main import run

    code = run(small_overrides(**{"data.source": out, "data.tokenizer": tokenizer_dir, "model.vocab_size": 600,
                                  "run.dir": run_dir, "train.max_steps": 1, "eval.every": 0, "train.seq_len": 32}))
    return code, capsys.readouterr().err


def test_training_refuses_shards_that_do_not_match_the_manifest_naming_them(prepared, tokenizer_dir, tmp_path,
                                                                              capsys):
    cfg, out, _, _ = prepared
    for name in ("train_000001.bin", "train_000002.bin", "train_000003.bin", "train_000004.bin", "train_000005.bin"):
        (out / name).unlink()  # a partial copy: one train shard of six arrived
    code, err = _train_exit(out, tokenizer_dir, tmp_path / "run1", capsys)
    assert code == 2 and "Traceback" not in err
    assert "train_000001.bin is missing" in err and "train_000005.bin is missing" in err and "nanopt prepare" in err
    assert not (tmp_path / "run1" / "checkpoints").exists()  # refused before anything was trained or written


@pytest.mark.slow
def test_training_runs_on_prepared_shards(tmp_path, tokenizer_dir):
    dataset, files, _ = write_source(tmp_path / "src", "jsonl", PREPARE_DOCS)
    cfg = prepare_config(tmp_path, tokenizer_dir, dataset, files, val_tokens=300, train_tokens=2400, shard_tokens=1200)
    prepare.prepare(cfg, progress=False)
    run_dir = tmp_path / "run"
    proc = run_module(["nanopt.main", *small_overrides(**{
        "data.source": tmp_path / "shards", "data.tokenizer": tokenizer_dir, "model.vocab_size": 600,
        "run.dir": run_dir, "train.max_steps": 3, "eval.every": 3,
    })], env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert abs(losses[0] - math.log(600)) < 1.0  # a fresh model on this 600-id vocabulary
    assert any("val_loss" in x for x in lines)
