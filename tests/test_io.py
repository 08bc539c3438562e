"""Atomic writes and JSON lines (nanopt/io.py): links, two writers of one file, a full disk, and what is no regular
file: each refused or survived without losing the old file or an earlier line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from conftest import REPO, USERS, full_disk_for, linked_run, users_file

from nanopt import io, rundirs
from nanopt.errors import ConfigError, DiskFull


@pytest.mark.parametrize("dangling", [False, True])
def test_evals_jsonl_as_a_link_is_never_appended_through(tmp_path, dangling):
    """Before: `nanopt eval`, `--core` and `--watch` appended to the user's file, or created one outside."""
    run_dir, mine = linked_run(tmp_path, rundirs.EVALS_FILE, dangling)
    with pytest.raises(ConfigError, match="symbolic link") as e:
        io.append_jsonl(run_dir / rundirs.EVALS_FILE, {"step": 2, "val_loss": 1.0})
    assert str(run_dir / rundirs.EVALS_FILE) in str(e.value) and "Remove the link" in str(e.value)
    assert (not mine.exists()) if dangling else mine.read_bytes() == USERS


def test_an_atomic_write_replaces_a_link_never_writes_through_its_temp_file_nor_onto_a_directory(tmp_path):
    """The rename replaces a link at the name; before, a link planted at the temp file's (predictable) name was
    followed, and the user's file overwritten."""
    mine = users_file(tmp_path)
    (summary := tmp_path / rundirs.SUMMARY_FILE).symlink_to(mine)
    io.write_json(summary, {"steps": 4})
    assert not summary.is_symlink() and json.loads(summary.read_text()) == {"steps": 4} and mine.read_bytes() == USERS
    summary.with_name(f".{summary.name}.{os.getpid()}.{threading.get_ident()}.tmp").symlink_to(mine)
    io.write_json(summary, {"steps": 5})
    assert json.loads(summary.read_text()) == {"steps": 5} and mine.read_bytes() == USERS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", rundirs.SUMMARY_FILE]
    # Onto a directory: before, the rename failed with IsADirectoryError (a traceback, exit 1) once the work was done
    # (a sweep with a directory at sweep.json, a run with one at summary.json after training).
    (tmp_path / "outside" / "summary.json").mkdir()
    (tmp_path / "outside" / "summary.json" / "kept").write_text("someone's")
    with pytest.raises(ConfigError, match=r"summary\.json is a directory.*Move it aside"):
        io.write_json(tmp_path / "outside" / "summary.json", {"steps": 1})
    assert sorted(p.name for p in (tmp_path / "outside").rglob("*")) == ["kept", "mine.jsonl", "summary.json"]


def test_a_full_disk_cuts_a_short_write_off_and_leaves_earlier_lines_and_the_old_file_whole(tmp_path, monkeypatch):
    """Before: the OSError escaped raw and half a line stayed, which the next append would have joined."""
    path = tmp_path / rundirs.EVALS_FILE
    io.append_jsonl(path, {"step": 1})
    full_disk_for(monkeypatch, rundirs.EVALS_FILE)
    with pytest.raises(DiskFull) as e:
        io.append_jsonl(path, {"step": 2, "note": "x" * 200})
    assert str(path) in str(e.value) and "GiB free" in str(e.value)
    monkeypatch.undo()
    assert path.read_bytes() == b'{"step": 1}\n'
    io.append_jsonl(path, {"step": 2})
    assert rundirs.read_records(path) == [{"step": 1}, {"step": 2}]
    # An atomic write (io.write_bytes) that fails: the old content stays whole and its temp file is removed.
    path = io.write_bytes(tmp_path / "state.json", b"old")
    full_disk_for(monkeypatch, "state.json", call="fsync")
    with pytest.raises(DiskFull, match="no space left") as e:  # an OSError still, naming the file and the free space
        io.write_bytes(path, b"new")
    assert isinstance(e.value, OSError) and str(path) in str(e.value) and "GiB free" in str(e.value)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == [rundirs.EVALS_FILE,
                                                                                         "state.json"]


def test_concurrent_replacements_of_one_file_never_share_a_temp_file(tmp_path):
    # two writers of one file: a heartbeat and a takeover; a sweep's state
    script = ("import sys\nfrom nanopt.io import write_text\n"
              "for i in range(300): write_text(sys.argv[1], sys.argv[2] * 5000)\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "f"), c], cwd=REPO,
                              stderr=subprocess.PIPE) for c in "ab"]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    assert (tmp_path / "f").read_text() in ("a" * 5000, "b" * 5000)
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


@pytest.mark.parametrize("make, kind", [  # one rule: what is no regular file is refused unread
    (lambda p: os.mkfifo(p) or p, "is not a regular file but a named pipe (FIFO)"),
    (lambda p: p.symlink_to("/dev/zero") or p, "is not a regular file but a device"),
    (lambda p: p.mkdir() or p, "is a directory"),
])
@pytest.mark.parametrize("use", ["read_bytes", "read_json", "open_own_read", "open_append", "refuse_link"])
def test_every_open_refuses_what_is_not_a_regular_file_before_a_byte_moves(tmp_path, make, kind, use):
    """A read of a FIFO waited for a writer for ever (lock.json, a shard, a manifest), one of /dev/zero never ended;
    an O_WRONLY open of a FIFO waited for a reader. Each open here is O_NONBLOCK, then fstat."""
    path = make(tmp_path / "lock.json")
    if use not in ("read_bytes", "read_json") and path.is_symlink():
        kind = "is a symbolic link"  # where nanopt writes, a link is refused as a link, before what it points to
    call = {"read_bytes": io.read_bytes, "read_json": io.read_json, "refuse_link": io.refuse_link,
            "open_own_read": lambda p: io.open_own(p, os.O_RDONLY), "open_append": io.open_append}[use]
    with pytest.raises(ConfigError) as e:
        call(path)
    assert str(e.value).startswith(f"{path} {kind}") and "run the command again" in str(e.value), e.value


def test_a_regular_file_reads_whole_and_blocking(tmp_path):
    path = io.write_bytes(tmp_path / "f", b"x" * 100_000)
    assert io.read_bytes(path) == b"x" * 100_000 and io.read_text(path) == "x" * 100_000
    assert os.get_blocking(fd := io.open_read(path))
    os.close(fd)
