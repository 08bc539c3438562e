"""data.packing: bos_bestfit (nanopt/packing.py): rows start at a BOS, every token is in a row or counted as
cropped, the rows do not depend on the world size, and the plan resumes bit-exactly, in a loader and in a run."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, small_overrides
from nanopt import data, packing
from nanopt.errors import ConfigError
from nanopt.main import run

BOS = 256


def _corpus(tmp_path: Path, docs: int = 300, mean: float = 40, shards: int = 2, seed: int = 0) -> list[np.ndarray]:
    """Shards of byte documents, each a BOS then lognormal-many bytes, cut into shards mid-document."""
    rng = np.random.default_rng(seed)
    pieces = [np.concatenate([[BOS], rng.integers(0, 256, max(1, int(n)))])
              for n in rng.lognormal(np.log(mean), 0.8, docs)]
    stream = np.concatenate(pieces)
    cuts = np.array_split(stream, shards)
    paths = [data.write_shard(tmp_path / f"train_{i:06d}.bin", c, 257) for i, c in enumerate(cuts)]
    return [data.open_shard(p) for p in paths]


def _rows(loader: packing.PackedLoader, steps: int, seq_len: int | None = None) -> list[tuple[int, ...]]:
    out = []
    for _ in range(steps):
        for x, y in loader.micro_batches(seq_len=seq_len):
            assert torch.equal(x[:, 1:], y[:, :-1])
            out += [tuple(r) + (int(last),) for r, last in zip(x.tolist(), y[:, -1])]
    return out


def test_every_row_starts_with_bos_and_holds_whole_documents_but_the_last(tmp_path):
    docs = packing.Documents(_corpus(tmp_path), BOS)
    packer = packing.Packer(docs.lengths, buffer=50, seed=1)
    for _ in range(200):
        pieces = packer.row(33)
        row = np.empty(33, dtype=np.int64)
        docs.fill(row, pieces)
        assert row[0] == BOS and (row == BOS).sum() == len(pieces)  # each piece starts at its document's BOS
        assert sum(take for _, take in pieces) == 33
        assert all(take == docs.lengths[d] for d, take in pieces[:-1])  # only the last piece may be cropped
        for d, take in pieces:  # a piece is its document's first tokens, across a shard's end too
            start = int(docs.starts[d])
            assert np.array_equal(row[:take], np.concatenate([s for s in docs.shards])[start : start + take])
            row = row[take:]


def test_no_token_is_lost_silently_across_epochs(tmp_path):
    shards = _corpus(tmp_path, docs=60)
    shards[0] = np.concatenate([[7, 8, 9], shards[0]])  # tokens before the first BOS: in no document
    docs = packing.Documents(shards, BOS)
    assert docs.orphans == 3
    packer = packing.Packer(docs.lengths, buffer=20, seed=3, orphans=docs.orphans)
    total = int(docs.lengths.sum())
    for _ in range(400):  # several epochs
        packer.row(25)
        pulled = packer.epoch * total + int(docs.lengths[packer._order[: packer.cursor]].sum())
        buffered = sum(length for length, _, _ in packer.buffer)
        assert packer.placed + packer.cropped + buffered == pulled + 3 * (packer.epoch + 1)
    assert packer.epoch >= 2 and 0 < packer.cropped_share < 1


def test_a_document_longer_than_a_row_is_cropped_to_the_row(tmp_path):
    path = data.write_shard(tmp_path / "train_000000.bin", [BOS, *range(100)], 257)
    docs = packing.Documents([data.open_shard(path)], BOS)
    loader = packing.PackedLoader(docs, micro_batch=1, rank=0, world=1, accum=1, seed=0, seq_len=15, buffer=10)
    x, y = loader.micro_batches()[0]
    assert x[0].tolist() == [BOS, *range(14)] and y[0, -1] == 14
    assert loader.metrics()["cropped_share"] == pytest.approx((101 - 16) / 101)


def test_rows_are_the_same_for_one_rank_and_for_two(tmp_path):
    docs = packing.Documents(_corpus(tmp_path), BOS)
    one = packing.PackedLoader(docs, 2, 0, 1, 4, seed=5, seq_len=16, buffer=30)
    ranks = [packing.PackedLoader(docs, 2, r, 2, 2, seed=5, seq_len=16, buffer=30) for r in range(2)]
    for _ in range(6):
        a = [x for x, _ in one.micro_batches()]
        b, c = ([x for x, _ in r.micro_batches()] for r in ranks)
        # rank r's micro-step m holds global rows (m·world + r)·micro_batch onwards
        assert torch.equal(torch.cat(a), torch.cat([b[0], c[0], b[1], c[1]]))


@pytest.mark.parametrize("first_steps", [3, 40])  # mid-epoch; past an epoch boundary (100 documents)
def test_the_plan_resumes_bit_exactly_from_its_state(tmp_path, first_steps):
    docs = packing.Documents(_corpus(tmp_path, docs=100), BOS)
    make = (lambda seed: packing.PackedLoader(docs, 2, 0, 1, 2, seed=seed, seq_len=24, buffer=40))  # noqa: E731
    straight = make(9)
    want = _rows(straight, 60)
    first = make(9)
    got = _rows(first, first_steps)
    assert (first.packer.epoch > 0) == (first_steps == 40)
    resumed = make(0)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as state.json holds it
    got += _rows(resumed, 60 - first_steps)
    assert got == want
    assert resumed.state_dict() == straight.state_dict()


def test_a_new_seq_len_continues_the_plan_with_longer_rows(tmp_path):
    docs = packing.Documents(_corpus(tmp_path), BOS)
    loader = packing.PackedLoader(docs, 2, 0, 1, 1, seed=2, seq_len=16, buffer=30)
    short = _rows(loader, 3, seq_len=16)
    long = _rows(loader, 3, seq_len=32)
    assert {len(r) for r in short} == {17} and {len(r) for r in long} == {33}
    assert loader.packer.rows == 12 and loader.packer.placed == 6 * 17 + 6 * 33


def test_no_bos_in_the_data_is_a_config_error_naming_the_key_and_the_fix(tmp_path):
    path = data.write_shard(tmp_path / "train_000000.bin", np.arange(200) % 256, 257)
    with pytest.raises(ConfigError, match="data.packing.*no BOS.*token id 256.*--data.packing=windows"):
        packing.Documents([data.open_shard(path)], BOS)
    with pytest.raises(ConfigError, match="the tokenizer has none"):
        packing.Documents([data.open_shard(path)], None)


def test_a_crop_share_over_half_is_warned_once(tmp_path, caplog):
    path = data.write_shard(tmp_path / "train_000000.bin", np.tile([BOS, *range(99)], 20), 257)
    loader = packing.PackedLoader(packing.Documents([data.open_shard(path)], BOS), 2, 0, 1, 1, 0, 15, 5)
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        _rows(loader, 3)
    warnings = [r.getMessage() for r in caplog.records if "cropped" in r.getMessage()]
    assert len(warnings) == 1 and "sample_by=paragraph" in warnings[0]


# ---------------------------------------------------------------- a real run
STEPS = 8


@pytest.fixture(scope="module")
def line_corpus(tmp_path_factory, corpus_dir) -> Path:
    """The embedded corpus with every line a document (a BOS before each): short documents that pack well."""
    out = tmp_path_factory.mktemp("lines")
    text = np.asarray(data.open_shard(corpus_dir / "train_000000.bin"), dtype=np.int64)
    text = text[text != BOS]
    starts = np.flatnonzero(text == ord("\n")) + 1
    data.write_shard(out / "train_000000.bin", np.insert(text, np.append(0, starts[:-1]), BOS), 257)
    (out / "val_000000.bin").write_bytes((corpus_dir / "val_000000.bin").read_bytes())
    return out


def _args(source: Path, run_dir: Path) -> list[str]:
    return [*small_overrides(**{"train.precision": "fp32", "train.max_steps": STEPS, "checkpoint.every": 2,
                                "log.tensorboard": "false", "data.packing": "bos_bestfit"}),
            f"--data.source={source}", f"--run.dir={run_dir}"]


@pytest.mark.slow
def test_a_packed_run_killed_mid_run_resumes_to_the_same_weights(tmp_path, line_corpus, capsys):
    reference = tmp_path / "reference"
    assert run(_args(line_corpus, reference)) == 0
    summary = json.loads((reference / "summary.json").read_text())
    records = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    shares = [r["cropped_share"] for r in records if "loss" in r]
    assert len(shares) == STEPS and 0 < summary["packing_cropped_share"] == shares[-1] < 0.5

    killed = tmp_path / "killed"
    env = {**os.environ, "NANOPT_TEST_HOOK": "kill-in-step:5", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "nanopt.main", *_args(line_corpus, killed)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert run(_args(line_corpus, killed)) == 0
    assert "resuming from" in capsys.readouterr().out
    after = json.loads((killed / "summary.json").read_text())
    assert after["weights_sha256_per_rank"] == summary["weights_sha256_per_rank"]
    assert after["packing_cropped_share"] == summary["packing_cropped_share"]
