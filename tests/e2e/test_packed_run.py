"""data.packing: bos_bestfit in real runs: killed mid-run it resumes to the same weights, reading the BOS index from the
cache."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import BOS, REPO, small_overrides

from nanopt.data import shards
from nanopt.main import run

pytestmark = pytest.mark.usefixtures("bos_cache")  # conftest: the BOS index cache is never the user's

STEPS = 6


@pytest.fixture(scope="module")
def line_corpus(tmp_path_factory, corpus_dir) -> Path:
    """The embedded corpus with every line a document (a BOS before each): short documents that pack well."""
    out = tmp_path_factory.mktemp("lines")
    text = np.asarray(shards.open_shard(corpus_dir / "train_000000.bin"), dtype=np.int64)
    text = text[text != BOS]
    starts = np.flatnonzero(text == ord("\n")) + 1
    shards.write_shard(out / "train_000000.bin", np.insert(text, np.append(0, starts[:-1]), BOS), 257)
    (out / "val_000000.bin").write_bytes((corpus_dir / "val_000000.bin").read_bytes())
    return out


def _args(source: Path, run_dir: Path) -> list[str]:
    return [*small_overrides(**{"train.precision": "fp32", "train.max_steps": STEPS, "checkpoint.every": 2,
                                "log.tensorboard": "false", "data.packing": "bos_bestfit"}),
            f"--data.source={source}", f"--run.dir={run_dir}"]


def _seen(run_dir: Path) -> tuple[list[float], str, float]:
    """(losses, weights digest, final cropped share) of a finished run; each step's share is in (0, 0.5)."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    shares = [r["cropped_share"] for r in records if "loss" in r]
    assert len(shares) == STEPS and 0 < summary["packing_cropped_share"] == shares[-1] < 0.5
    return [r["loss"] for r in records if "loss" in r], summary["weights_sha256_per_rank"], shares[-1]


@pytest.mark.slow
def test_a_packed_run_killed_mid_run_resumes_to_the_same_weights_reading_the_cache(tmp_path, line_corpus, scans,
                                                                                  capsys):
    """The first run scans for BOS; a second, killed mid-run (SIGKILL in step 5), and its resume read the index from
    the cache, see the same batches and end at the first's weights."""
    assert run(_args(line_corpus, tmp_path / "first")) == 0
    first = _seen(tmp_path / "first")
    assert len(first[0]) == STEPS and "BOS index: 0 shards from cache, 1 scanned" in capsys.readouterr().out
    killed = tmp_path / "killed"
    env = {**os.environ, "NANOPT_TEST_HOOK": "kill-in-step:5", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "nanopt.main", *_args(line_corpus, killed)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "BOS index: 1 shards from cache, 0 scanned" in proc.stdout + proc.stderr
    assert run(_args(line_corpus, killed)) == 0
    out = capsys.readouterr().out
    assert "resuming from" in out and "BOS index: 1 shards from cache, 0 scanned" in out
    assert len(scans) == 1  # the first run's; the resume read the index from the cache
    assert _seen(killed) == first
