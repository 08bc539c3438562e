"""The run directory has one owner (nanopt/rundirs.py): one writer at a time, checkpoints that fall back on any
damage, no restart nobody asked for, and a finished run that stays finished."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from conftest import REPO, small_overrides
from nanopt import checkpoint, io, loading, rundirs
from nanopt.config import load_config, parse_overrides
from nanopt.errors import ConfigError, DiskFull
from nanopt.io import write_json
from nanopt.lock import LOCK_EXPIRES_ENV, LOCK_OWNER_ENV, DirLock
from nanopt.main import run
from nanopt.metrics import MetricsLogger
from nanopt.model import build_model

real_crc32 = checkpoint.crc32_of
ARGS = small_overrides(**{"train.precision": "fp32", "train.max_steps": 4, "checkpoint.every": 2,
                          "log.tensorboard": "false"})


def train_here(run_dir: Path, *extra: str) -> int:
    return run([*ARGS, f"--run.dir={run_dir}", *extra])


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
        assert train_here(tmp_path) == 2
        err = capsys.readouterr().err
        assert f"in use by process {holder.pid}" in err and "lock.json" in err and "Traceback" not in err
        assert not (tmp_path / "metrics.jsonl").exists()  # nothing of the run was touched
    finally:
        holder.send_signal(signal.SIGKILL)  # `kill -9`: the lease stays on disk, its pid is dead
        holder.wait()
    assert (tmp_path / rundirs.LOCK_FILE).is_file()
    assert train_here(tmp_path) == 0
    assert not (tmp_path / rundirs.LOCK_FILE).exists()  # released at the end


def test_a_lease_from_another_host_is_taken_over_only_once_its_heartbeat_expired(tmp_path):
    lease = {"host": "elsewhere", "pid": 1, "started": time.time(), "heartbeat": time.time(), "token": "t"}
    write_json(tmp_path / rundirs.LOCK_FILE, lease)
    with pytest.raises(ConfigError, match="host elsewhere"):
        DirLock(tmp_path, expires_s=60).acquire()
    write_json(tmp_path / rundirs.LOCK_FILE, {**lease, "heartbeat": time.time() - 61})
    lock = DirLock(tmp_path, expires_s=60).acquire()
    assert lock.holder().token == lock.token
    lock.release()
    assert not (tmp_path / rundirs.LOCK_FILE).exists()


@pytest.mark.slow
def test_the_heartbeat_renews_the_lease_and_notices_a_takeover(tmp_path):
    lock = DirLock(tmp_path, heartbeat_s=0.05).acquire()
    first = lock.holder().heartbeat
    time.sleep(0.3)
    assert lock.holder().heartbeat > first
    write_json(tmp_path / rundirs.LOCK_FILE, {"host": "h", "pid": 1, "started": 0, "heartbeat": 0, "token": "x"})
    time.sleep(0.3)
    assert lock.lost and "taken over" in lock.lost
    lock.release()
    assert (tmp_path / rundirs.LOCK_FILE).is_file()  # not ours any more: left for its holder


def test_concurrent_replacements_of_one_file_never_share_a_temp_file(tmp_path):
    """Two writers of one file (a heartbeat and a takeover; a sweep's state) each write their own temp file."""
    script = ("import sys\nfrom nanopt.io import write_text\n"
              "for i in range(300): write_text(sys.argv[1], sys.argv[2] * 5000)\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "f"), c], cwd=REPO,
                              stderr=subprocess.PIPE) for c in "ab"]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    assert (tmp_path / "f").read_text() in ("a" * 5000, "b" * 5000)
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


# ---------------------------------------------------------------- checkpoints fall back


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpts")
    cfg = load_config(None, parse_overrides(ARGS))
    model = build_model(cfg.model, "cpu")
    opt = torch.optim.AdamW(model.parameters())
    for step in (2, 4):
        checkpoint.save(root, step, model, opt, {"config": cfg.to_dict()}, keep=3)
    return root


def damaged_copy(tmp_path: Path, source: Path, marker: bytes | None) -> Path:
    """The two checkpoints copied, step 4's COMPLETE replaced by `marker` (None: made a directory)."""
    root = tmp_path / "checkpoints"
    for ckpt in source.iterdir():
        if ckpt.is_dir():
            (root / ckpt.name).mkdir(parents=True)
            for f in ckpt.iterdir():
                (root / ckpt.name / f.name).write_bytes(f.read_bytes())
    complete = root / "step_000004" / rundirs.COMPLETE_FILE
    complete.unlink()
    if marker is None:
        complete.mkdir()
    else:
        complete.write_bytes(marker)
    return root


@pytest.mark.parametrize("marker, why", [
    (b"\xff\xfe not utf-8", "cannot be read"),
    (None, "no COMPLETE marker"),  # a directory where the marker should be
    (b"[1, 2]", "not a JSON object"),
    (b'{"files": {}}', "does not list model.safetensors"),
    (b"ok", "cannot be read"),  # the pre-manifest marker no longer passes
    (b'{"files": {"model.safetensors": {"bytes": "1", "crc32": 0}}}', "does not list rng.pt"),
])
def test_any_damage_to_complete_falls_back_to_the_previous_checkpoint(tmp_path, two_checkpoints, marker, why):
    root = damaged_copy(tmp_path, two_checkpoints, marker)
    assert why in checkpoint.verify_checkpoint(root / "step_000004")
    assert checkpoint.verify_checkpoint(root / "step_000002") is None
    assert checkpoint.find_checkpoint(tmp_path) == root / "step_000002"  # eval, sample and export read this


def test_the_newest_complete_checkpoint_is_found_newest_first_reading_no_older_one(tmp_path, two_checkpoints,
                                                                                     monkeypatch):
    """newest_checkpoint (resume, eval, sample, export, Modal): the first that verifies, newest first, naming each
    newer one skipped; an older one is never read (verifying reads every byte), so its damage goes unseen."""
    root = damaged_copy(tmp_path, two_checkpoints, b"[1, 2]")  # step 4's manifest damaged, step 2 whole
    read = []
    monkeypatch.setattr(checkpoint, "crc32_of", lambda path: read.append(path) or real_crc32(path))
    found, skipped = checkpoint.newest_checkpoint(tmp_path)
    assert found == root / "step_000002" and skipped == ["step_000004: its COMPLETE manifest is not a JSON object "
                                                         "with a `files` map"]
    assert checkpoint.newest_checkpoint(tmp_path, newer_than=2) == (None, skipped)  # Modal: progress since step 2?
    complete = rundirs.COMPLETE_FILE
    (root / "step_000004" / complete).write_bytes((two_checkpoints / "step_000004" / complete).read_bytes())
    (root / "step_000002" / rundirs.MODEL_FILE).write_bytes(b"damaged")  # older: never read
    read.clear()
    assert checkpoint.newest_checkpoint(root) == (root / "step_000004", [])
    assert read and all(p.parent.name == "step_000004" for p in read)
    assert checkpoint.newest_checkpoint(root, newer_than=4) == (None, [])


def test_a_manifest_that_lists_every_file_but_a_wrong_state_step_is_incomplete(tmp_path, two_checkpoints):
    root = damaged_copy(tmp_path, two_checkpoints, (two_checkpoints / "step_000004" / "COMPLETE").read_bytes())
    (root / "step_000002").rename(root / "step_000006")  # a checkpoint under another step's name
    assert "says step 2" in checkpoint.verify_checkpoint(root / "step_000006")
    assert checkpoint.find_checkpoint(tmp_path) == root / "step_000004"


def test_a_checkpoint_config_is_validated_before_anything_is_built(tmp_path, two_checkpoints):
    root = damaged_copy(tmp_path, two_checkpoints, (two_checkpoints / "step_000004" / "COMPLETE").read_bytes())
    ckpt = root / "step_000004"
    state = json.loads((ckpt / "state.json").read_text())
    state["config"]["model"]["dim"] = 10**9  # would size a huge model
    state["config"]["model"]["n_heads"] = "four"
    (ckpt / "state.json").write_text(json.dumps(state))
    raw = (ckpt / "state.json").read_bytes()
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    manifest["files"]["state.json"] = {"bytes": len(raw), "crc32": zlib.crc32(raw)}
    (ckpt / "COMPLETE").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"state\.json.*model\.n_heads"):
        loading.load(ckpt)


def test_every_rerun_refuses_when_the_run_trained_but_no_checkpoint_remains(tmp_path, capsys):
    """A checkpoints/ directory not yet synced (or deleted) must not turn into a silent restart."""
    assert train_here(tmp_path, "--train.max_steps=2") == 0
    os.rename(tmp_path / "checkpoints", tmp_path / "elsewhere")
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    for _ in range(2):
        assert train_here(tmp_path, "--train.max_steps=3") == 2
        err = capsys.readouterr().err
        assert "shows saved training but holds no usable checkpoint" in err and "start_over" in err
        assert (tmp_path / "metrics.jsonl").read_bytes() == metrics


# ---------------------------------------------------------------- a finished run is finished


@pytest.mark.slow
def test_rerunning_a_finished_run_prints_its_summary_and_changes_nothing(tmp_path, capsys):
    assert train_here(tmp_path) == 0
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert train_here(tmp_path) == 0
    out = capsys.readouterr().out
    assert "is finished; nothing to train" in out and "4 steps" in out and "step      1/4" not in out
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files
    # Another config on the finished run is refused, naming the key.
    assert train_here(tmp_path, "--train.lr=0.001") == 2
    assert "finished run of another config" in capsys.readouterr().err


def test_a_run_stopped_at_its_target_is_finished(tmp_path, capsys):
    target = ["--train.target_val_loss=100", "--train.stop_at_target=true", "--eval.every=2", "--train.max_steps=6"]
    assert train_here(tmp_path, *target) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    # The clock saw the target at the step-0 evaluation; the loop stops at the next one.
    assert summary["stopped_at_target"] is True and summary["steps"] == 2 and summary["step_to_target"] == 0
    assert rundirs.finished(tmp_path, 6, True) == summary
    assert rundirs.finished(tmp_path, 6, False) is None  # without stop_at_target it would train on to 6
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert train_here(tmp_path, *target) == 0
    assert "is finished" in capsys.readouterr().out
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics


# ---------------------------------------------------------------- config keys that name runs


@pytest.mark.parametrize("override, message", [
    ("--run.name=..", "one directory name"),
    ("--run.name=.", "one directory name"),
    ("--run.seed=4294967296", "run.seed"),
    ("--run.seed=-1", "run.seed"),
])
def test_run_names_and_seeds_that_would_escape_or_overflow_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, parse_overrides([override]))


def test_integers_are_parsed_exactly():
    cfg = load_config(None, parse_overrides(["--run.seed=4294967295", "--train.max_steps=1_000", "--log.every=1e2"]))
    assert (cfg.run.seed, cfg.train.max_steps, cfg.log.every) == (4294967295, 1000, 100)
    big = load_config(None, parse_overrides(["--train.max_steps=9007199254740993"]))  # 2^53 + 1
    assert big.train.max_steps == 9007199254740993


def test_a_retried_attempt_of_the_same_job_takes_over_its_lease_at_once(tmp_path, monkeypatch):
    """On a Modal Volume heartbeats travel only with commits: a lease expires late, but a retry of the same
    call (same LOCK_OWNER_ENV) takes over what its killed attempt left, and another job still waits."""
    lease = {"host": "dead-container", "pid": 7, "started": time.time(), "heartbeat": time.time(), "token": "t",
             "owner": "call-1"}
    write_json(tmp_path / rundirs.LOCK_FILE, lease)
    monkeypatch.setenv(LOCK_EXPIRES_ENV, "1260")
    monkeypatch.setenv(LOCK_OWNER_ENV, "call-2")
    with pytest.raises(ConfigError, match="dead-container"):
        DirLock(tmp_path).acquire()
    monkeypatch.setenv(LOCK_OWNER_ENV, "call-1")
    lock = DirLock(tmp_path).acquire()
    assert lock.expires_s == 1260 and lock.holder().owner == "call-1"
    lock.release()


def test_a_resume_trims_only_records_past_its_step_and_keeps_lines_it_cannot_read(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff damaged\n{"step": 3}\n{"step": 2}\n{"step": 5, "lo')
    MetricsLogger(tmp_path, enabled=True).trim(2)
    # The damaged middle line is the user's to look at; the cut last line would be joined by the next append.
    assert (tmp_path / "metrics.jsonl").read_bytes() == b'{"step": 1}\n\xff damaged\n{"step": 2}\n'


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    """io.write_bytes on a full disk: the old content stays whole and its temp file is removed."""
    path = io.write_bytes(tmp_path / "state.json", b"old")

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DiskFull, match="no space left") as e:  # an OSError still, naming the file and the free space
        io.write_bytes(path, b"new")
    assert isinstance(e.value, OSError) and str(path) in str(e.value) and "GiB free" in str(e.value)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
