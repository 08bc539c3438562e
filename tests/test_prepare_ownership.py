"""What `nanopt prepare` may delete and which manifests it (and training) may follow; the shard verification cache.

A data directory can be shared: prepare deletes only the shard and temp files it writes itself, and a manifest
whose entries are not shard names of its own directory is refused before any file it names is read or deleted.
The verification record (.verified.json) is a cache: a copy is verified again, a damaged record is ignored, and
progress is kept shard by shard.
"""
from __future__ import annotations

import json
import os
import shutil
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import pytest

from nanopt import cli, data, io, prepare, shards
from nanopt.config import Config, ConfigError, load_config, to_yaml

DOCS = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(40)]


def _config(tmp_path, out_name: str = "shards"):
    """The byte tokenizer over a local JSON-lines file: 5 train shards of 200 tokens, in about a second."""
    src = tmp_path / "docs.jsonl"
    if not src.exists():
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    keys = {"dataset": "json", "data_files": str(src), "shuffle_buffer": 0, "workers": 1, "batch_documents": 8,
            "shard_tokens": 200, "train_tokens": 1000}
    overrides = [("data.source", str(tmp_path / out_name))] + [(f"prepare.{k}", str(v)) for k, v in keys.items()]
    return load_config(None, overrides)


def _shard_bytes(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.bin"))}


@pytest.fixture
def prepared(tmp_path):
    """(config, output directory, the bytes of every shard) of one complete preparation."""
    cfg = _config(tmp_path)
    prepare.prepare(cfg, progress=False)
    out = tmp_path / "shards"
    assert len(shards.split_paths(out, "train")) == 5
    return cfg, out, _shard_bytes(out)


def _cli_prepare(cfg, tmp_path, capsys) -> tuple[int, str]:
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(to_yaml(cfg))
    code = cli.run(["prepare", "--config", str(cfg_file), "--no-progress"])  # the `nanopt` dispatcher: exit codes
    return code, capsys.readouterr().err


# ---------------------------------------------------------------- what prepare deletes


@pytest.mark.parametrize("name,ours", [
    ("train_000001.bin", True), ("val_000000.bin", True), ("train_1234567.bin", True),
    ("train_000001.bin.bak", False), ("train_00001.bin", False), ("train_0000001.bin", False),
    ("/tmp/train_000001.bin", False), ("../train_000001.bin", False), ("sub/train_000001.bin", False),
    ("train_000001.bin/..", False), ("other_000001.bin", False), ("train_٠٠٠٠٠١.bin", False), (7, False), (None, False),
])
def test_shard_names_are_exactly_those_prepare_writes(name, ours):
    assert shards.is_shard_name(name) is ours


def test_resume_deletes_only_shard_and_temp_files_prepare_writes(prepared, caplog):
    """A user's train_000001.bin.bak or .gz beside the shards was deleted by every resume."""
    cfg, out, whole = prepared
    users = {"train_000001.bin.bak": b"my backup", "train_000001.bin.gz": b"\x1f\x8b", "train_0000001.bin.x": b"x",
             "train_000002.bin.tmp.keep": b"k", ".train_000002.bin.tmp": b"h"}
    for name, content in users.items():
        (out / name).write_bytes(content)
    leftovers = ["train_000009.bin", "train_000003.bin.tmp", ".train_000004.bin.4242.139.tmp"]  # uncommitted, ours
    for name in leftovers:
        (out / name).write_bytes(whole["train_000000.bin"])
    with caplog.at_level("INFO", logger="nanopt"):
        assert prepare.prepare(cfg, progress=False)["this_run"]["tokens"] == 0
    assert {name: (out / name).read_bytes() for name in users} == users
    assert not any((out / name).exists() for name in leftovers)
    assert _shard_bytes(out) == whole
    assert "left" in caplog.text and "train_000001.bin.bak" in caplog.text


def test_a_temp_shard_left_by_a_crash_is_removed_on_resume(tmp_path, monkeypatch):
    """Whatever name nanopt.io gives its temp files, the one a crash leaves on the way to a shard is prepare's own."""
    real_replace = os.replace

    def crash_at_shard_2(src, dst, *args, **kwargs):
        if str(dst).endswith("train_000002.bin"):
            raise KeyboardInterrupt  # the tokens are on disk under the temp name, the rename never happened
        return real_replace(src, dst, *args, **kwargs)

    cfg = _config(tmp_path)
    out = tmp_path / "shards"
    monkeypatch.setattr(io.os, "replace", crash_at_shard_2)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare(cfg, progress=False)
    monkeypatch.setattr(io.os, "replace", real_replace)
    (left,) = [p for p in out.iterdir() if ".tmp" in p.name and "train_000002" in p.name]  # the crash left one
    left.rename(left.with_name(left.name.replace(f".{os.getpid()}.", ".1.")))  # as a resume in a new process sees it
    prepare.prepare(cfg, progress=False)
    whole = tmp_path / "whole"
    prepare.prepare(_config(tmp_path, "whole"), progress=False)
    assert _shard_bytes(out) == _shard_bytes(whole)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in whole.iterdir())  # no temp file left


# ---------------------------------------------------------------- which manifests are followed


@pytest.mark.parametrize("key,bad", [("shards", "absolute"), ("shards", "../victim.bin"),
                                     ("shards", "train_000001.bin.bak"), ("rebuild", "../victim.bin")])
def test_a_manifest_entry_naming_another_file_is_refused_and_nothing_is_deleted(prepared, tmp_path, capsys, key, bad):
    """A manifest in a shared directory could make prepare delete (and training read) any file the user can write."""
    cfg, out, whole = prepared
    victim = tmp_path / "victim.bin"
    victim.write_text("a file of the user's, outside the data directory")
    bad = str(victim) if bad == "absolute" else bad
    if bad.endswith(".bak"):
        (out / bad).write_text("a user's backup")
    path = out / shards.MANIFEST
    manifest = json.loads(path.read_text())
    if key == "shards":
        manifest["shards"][1]["file"] = bad
    else:
        manifest["rebuild"] = [dict(manifest["shards"][2], file=bad)]
    path.write_text(json.dumps(manifest))
    for check in (lambda: prepare.prepare(cfg, progress=False), lambda: shards.check_manifest(out)):
        with pytest.raises(ConfigError) as e:
            check()
        message = str(e.value)
        assert str(path) in message and f"`{key}[{1 if key == 'shards' else 0}]`" in message
        assert json.dumps(bad) in message and "not a shard name" in message and "Restore" in message
    code, err = _cli_prepare(cfg, tmp_path, capsys)
    assert code == 2 and "Traceback" not in err and str(path) in err
    assert victim.exists() and _shard_bytes(out) == whole
    assert not bad.endswith(".bak") or (out / bad).exists()


@pytest.mark.parametrize("content", [
    b"[1, 2]", b'"shards"', b'{"shards": {}, "state": {}}', b'{"shards": [], "state": []}',
    b'{"shards": ["train_000000.bin"], "state": {}}', b'{"shards": [], "rebuild": 3, "state": {}}',
    b'{"shards": [{"file": "train_000000.bin", "split": "train", "tokens": "many"}], "state": {}}',
    b'{"shards": [{"file": "train_000000.bin", "split": "train", "tokens": 5, "crc32": "x"}], "state": {}}',
    b'{"shards": [], "state": {}, "x": "\xff\xfe"}', b"[" * 100_000,
])
def test_a_wrong_typed_manifest_is_one_paragraph_not_a_traceback(tmp_path, capsys, content):
    out = tmp_path / "shards"
    out.mkdir()
    (out / shards.MANIFEST).write_bytes(content)
    with pytest.raises(ConfigError) as e:
        shards.check_manifest(out)  # what training calls before it reads a shard
    assert str(out / shards.MANIFEST) in str(e.value) and "cannot be used" in str(e.value) and "Restore" in str(e.value)
    code, err = _cli_prepare(_config(tmp_path), tmp_path, capsys)
    assert code == 2 and "Traceback" not in err and "cannot be used" in err


# ---------------------------------------------------------------- the verification record


def _shards(directory, n: int = 2) -> list:
    """n small train shards written 10 s ago (old enough to be recorded: see the racy rule in verify_shards)."""
    paths = [shards.write_shard(directory / f"train_{i:06d}.bin", (np.arange(100) + i) % 257, 257) for i in range(n)]
    for path in paths:
        os.utime(path, ns=(time.time_ns() - 10**10,) * 2)
    return paths


def _cfg() -> Config:
    cfg = Config()
    cfg.train.seq_len = 8
    return cfg


def _damage_keeping_size_and_mtime(path) -> None:
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[shards.HEADER_BYTES + 5] ^= 0xFF
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def passes(monkeypatch) -> list[str]:
    """The names of the shards read whole for their checksum, in order."""
    seen: list[str] = []
    real_open = shards.open_shard
    monkeypatch.setattr(shards, "open_shard", lambda p, verify=True: (verify and seen.append(p.name),
                                                                     real_open(p, verify))[1])
    return seen


def test_a_copied_shard_is_verified_again_though_it_keeps_size_and_mtime(tmp_path, passes):
    """cp -a / rsync -a / tar carry mtimes and the record along: a shard damaged in transit was never read."""
    src, copy = tmp_path / "src", tmp_path / "copy"
    src.mkdir()
    _shards(src)
    data.open_split(src, "train", _cfg())
    data.open_split(src, "train", _cfg())
    assert passes == ["train_000000.bin", "train_000001.bin"]  # recorded, then trusted
    shutil.copytree(src, copy)  # copy2: times preserved, .verified.json included
    _damage_keeping_size_and_mtime(copy / "train_000001.bin")
    with pytest.raises(ConfigError, match="train_000001.bin fails its checksum"):
        data.open_split(copy, "train", _cfg())
    assert passes[2:] == ["train_000000.bin", "train_000001.bin"]


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'"stamps"', b"\xff\xfe{}", b"[" * 100_000,
                                     b'{"train_000000.bin": "abc"}', b'{"train_000000.bin": [1, "x", 3]}'])
def test_a_damaged_verification_record_is_ignored_with_a_warning(tmp_path, passes, caplog, content):
    _shards(tmp_path)
    (tmp_path / shards.VERIFIED).write_bytes(content)
    with caplog.at_level("WARNING", logger="nanopt"):
        data.open_split(tmp_path, "train", _cfg())
    assert passes == ["train_000000.bin", "train_000001.bin"]
    assert shards.VERIFIED in caplog.text and "verified again" in caplog.text
    assert sorted(json.loads((tmp_path / shards.VERIFIED).read_text())) == passes  # written afresh


def test_stamps_are_recorded_shard_by_shard(tmp_path):
    """A first start preempted an hour into verifying 99 GB of shards kept nothing: stamps were written at the end."""
    _shards(tmp_path, 3)
    _damage_keeping_size_and_mtime(tmp_path / "train_000002.bin")
    with pytest.raises(ConfigError, match="train_000002.bin fails its checksum"):
        data.open_split(tmp_path, "train", _cfg())
    stamps = json.loads((tmp_path / shards.VERIFIED).read_text())
    assert sorted(stamps) == ["train_000000.bin", "train_000001.bin"]
    st = (tmp_path / "train_000000.bin").stat()
    assert stamps["train_000000.bin"][:4] == [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
