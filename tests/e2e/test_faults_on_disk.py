"""A run's files are its own, and a full disk is a paragraph (issue 36), in real runs: a linked or dangling
metrics.jsonl is refused with nothing written outside the run, a full disk at the start, in a checkpoint save or
while logging is exit 1 and the rerun goes on, and a second trainer is refused while another holds the run."""
from __future__ import annotations

import itertools
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, USERS, full_disk_for, linked_run, one_paragraph, train_short
from safetensors import SafetensorError

from nanopt import rundirs
from nanopt.training import checkpoint


# ---------------------------------------------------------------- links where run files should be
@pytest.mark.slow
@pytest.mark.parametrize("name, dangling", [(rundirs.METRICS_FILE, False), (rundirs.METRICS_FILE, True),
                                            (rundirs.EVALS_FILE, True)])
def test_a_run_file_linked_outside_is_refused_and_nothing_is_written_there(tmp_path, capsys, name, dangling):
    """Before: the resume's trim read the user's lines and wrote them into the run, and training appended after them;
    a dangling metrics.jsonl link made the logger create the user's file outside the run."""
    run_dir, mine = linked_run(tmp_path, name, dangling)
    assert train_short(run_dir) == 2
    err = one_paragraph(capsys.readouterr().err)
    for word in (str(run_dir / name), str(mine), "symbolic link", "Remove the link"):
        assert word in err, err
    assert (run_dir / name).is_symlink() and ((not mine.exists()) if dangling else mine.read_bytes() == USERS)
    assert list(mine.parent.iterdir()) == ([] if dangling else [mine])
    assert not (run_dir / rundirs.CHECKPOINTS_DIR).exists() and not (run_dir / rundirs.LOCK_FILE).exists()


# ---------------------------------------------------------------- a full disk
def _full_in_save(monkeypatch: pytest.MonkeyPatch) -> None:
    real = checkpoint.save_file

    def save_file(tensors, filename, metadata=None):
        if ".tmp_step_000004" in str(filename):  # what safetensors raises on ENOSPC (checked on a 64 KiB tmpfs)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", save_file)


def _full_past_step_2(monkeypatch: pytest.MonkeyPatch) -> None:
    writes = itertools.count(1)
    full_disk_for(monkeypatch, rundirs.METRICS_FILE, when=lambda: next(writes) > 2)


FULL = {  # where the disk fills up: (make it full, the words of the paragraph)
    "start": (lambda mp: full_disk_for(mp, rundirs.LOCK_FILE),
              lambda run: [str(run / rundirs.LOCK_FILE), "no space left", "GiB free"]),
    "save": (_full_in_save, lambda run: [f"writing {run / 'checkpoints' / '.tmp_step_000004' / rundirs.MODEL_FILE}",
                                         "GiB free", "run the same command again"]),
    "logging": (_full_past_step_2, lambda run: [str(run / rundirs.METRICS_FILE), "GiB free"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("where", FULL)
def test_a_full_disk_is_exit_1_in_one_paragraph_and_the_rerun_trains_on(tmp_path, monkeypatch, capsys, where):
    """Before: a SafetensorError traceback in a save. Now one paragraph; a save's half-written checkpoint is removed
    and step 2 kept; a log keeps every whole line."""
    make_full, words = FULL[where]
    make_full(monkeypatch)
    assert train_short(tmp_path) == 1
    err = one_paragraph(capsys.readouterr().err)
    for word in words(tmp_path):
        assert word in err, err
    monkeypatch.undo()  # space freed
    if where == "save":
        newest, skipped = checkpoint.newest_checkpoint(tmp_path)
        assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path)] == ["step_000002"]
        assert newest.name == "step_000002" and skipped == []
        assert not (tmp_path / "checkpoints" / ".tmp_step_000004").exists()
        assert not (tmp_path / rundirs.LOCK_FILE).exists()
    if where == "logging":
        assert [r["step"] for r in rundirs.read_metrics(tmp_path)] == [1, 2]  # no half line left
    assert train_short(tmp_path) == 0
    assert where != "save" or "resuming from" in capsys.readouterr().out
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
