"""A run's files are its own, and a full disk is a paragraph (issue 36), in real runs: a linked or dangling
metrics.jsonl is refused with nothing written outside the run, a full disk at the start, in a checkpoint save or
while logging is exit 1 and the rerun goes on, and a second trainer is refused while another holds the run."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from conftest import REPO, USERS, full_disk_for, one_paragraph, train_short, users_file
from safetensors import SafetensorError

from nanopt import rundirs
from nanopt.training import checkpoint

# ---------------------------------------------------------------- links where run files should be


@pytest.mark.slow
def test_metrics_jsonl_linked_to_a_users_file_is_refused_and_nothing_is_copied(tmp_path, capsys):
    """Before: the resume's trim read the user's lines and wrote them into the run, and training appended after them."""
    mine = users_file(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / rundirs.METRICS_FILE).symlink_to(mine)
    assert train_short(run_dir) == 2
    err = one_paragraph(capsys.readouterr().err)
    assert str(run_dir / rundirs.METRICS_FILE) in err and "symbolic link" in err and "Remove the link" in err
    assert mine.read_bytes() == USERS and (run_dir / rundirs.METRICS_FILE).is_symlink()
    assert not rundirs.checkpoints_dir(run_dir).exists() and not (run_dir / rundirs.LOCK_FILE).exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", [rundirs.METRICS_FILE, rundirs.EVALS_FILE])
def test_a_dangling_link_in_a_run_creates_nothing_outside(tmp_path, capsys, name):
    """Before: metrics.jsonl's dangling link made the logger create the user's file outside the run."""
    target = tmp_path / "outside" / "created.jsonl"
    target.parent.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to(target)
    assert train_short(run_dir) == 2
    err = one_paragraph(capsys.readouterr().err)
    assert str(run_dir / name) in err and str(target) in err and "symbolic link" in err
    assert not target.exists() and list(target.parent.iterdir()) == []


@pytest.mark.slow
def test_a_full_disk_at_the_start_of_training_is_exit_1_and_the_rerun_trains(tmp_path, monkeypatch, capsys):
    full_disk_for(monkeypatch, rundirs.LOCK_FILE)
    assert train_short(tmp_path) == 1
    err = one_paragraph(capsys.readouterr().err)
    assert str(tmp_path / rundirs.LOCK_FILE) in err and "no space left" in err and "GiB free" in err
    monkeypatch.undo()
    assert train_short(tmp_path) == 0


def _safetensors_full(real: Callable) -> Callable:
    def save_file(tensors, filename, metadata=None):
        if ".tmp_step_000004" in str(filename):  # what safetensors raises on ENOSPC (checked on a 64 KiB tmpfs)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, metadata=metadata)

    return save_file


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_save_is_exit_1_and_the_previous_checkpoint_resumes(tmp_path, monkeypatch,
                                                                                           capsys):
    """Before: a SafetensorError traceback. Now one paragraph, the half-written checkpoint removed, step 2 kept."""
    monkeypatch.setattr(checkpoint, "save_file", _safetensors_full(checkpoint.save_file))
    assert train_short(tmp_path) == 1
    err = one_paragraph(capsys.readouterr().err)
    model_file = rundirs.checkpoints_dir(tmp_path) / ".tmp_step_000004" / rundirs.MODEL_FILE
    assert f"writing {model_file}" in err and "GiB free" in err and "run the same command again" in err
    newest, skipped = checkpoint.newest_checkpoint(tmp_path)
    assert [p.name for p in checkpoint.checkpoint_dirs(rundirs.checkpoints_dir(tmp_path))] == ["step_000002"]
    assert newest.name == "step_000002" and skipped == []
    assert not (rundirs.checkpoints_dir(tmp_path) / ".tmp_step_000004").exists()
    assert not (tmp_path / rundirs.LOCK_FILE).exists()
    monkeypatch.undo()  # space freed
    assert train_short(tmp_path) == 0
    assert "resuming from" in capsys.readouterr().out
    assert [r["step"] for r in rundirs.read_metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_full_disk_while_logging_metrics_is_exit_1_and_keeps_every_whole_line(tmp_path, monkeypatch, capsys):
    logged = {"n": 0}

    def past_step_2() -> bool:
        logged["n"] += 1
        return logged["n"] > 2

    full_disk_for(monkeypatch, rundirs.METRICS_FILE, when=past_step_2)
    assert train_short(tmp_path) == 1
    err = one_paragraph(capsys.readouterr().err)
    assert str(tmp_path / rundirs.METRICS_FILE) in err and "GiB free" in err
    monkeypatch.undo()
    assert [r["step"] for r in rundirs.read_metrics(tmp_path)] == [1, 2]  # no half line left
    assert train_short(tmp_path) == 0
    assert [r["step"] for r in rundirs.read_metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4]


# ---------------------------------------------------------------- one writer at a time

HOLD = """
import sys, time
from nanopt.lock import DirLock
DirLock(sys.argv[1], heartbeat_s=0.2).acquire()
print("held", flush=True)
time.sleep(600)
"""


def hold_lock(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow
def test_a_second_trainer_is_refused_naming_the_holder_and_a_killed_one_is_recovered(tmp_path, capsys):
    holder = hold_lock(tmp_path)
    try:
        assert train_short(tmp_path) == 2
        err = capsys.readouterr().err
        assert f"in use by process {holder.pid}" in err and "lock.json" in err and "Traceback" not in err
        assert not (tmp_path / "metrics.jsonl").exists()  # nothing of the run was touched
    finally:
        holder.send_signal(signal.SIGKILL)  # `kill -9`: the lease stays on disk, its pid is dead
        holder.wait()
    assert (tmp_path / rundirs.LOCK_FILE).is_file()
    assert train_short(tmp_path) == 0
    assert not (tmp_path / rundirs.LOCK_FILE).exists()  # released at the end
