"""A run's files are its own, and a full disk is a paragraph (issue 36): nanopt never writes through a symbolic link
(appends refuse one, exit 2; atomic writes replace one), a lock that a crash or a full disk left is recovered, ENOSPC
anywhere in saving (lock, checkpoint, metrics, prepare) is one paragraph naming the file and the free space with exit
1 and nothing written before it lost, and one `nanopt prepare` at a time writes a directory."""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch
from safetensors import SafetensorError

from conftest import small_overrides
from nanopt import checkpoint, cli, io, prepare, rundirs, shards
from nanopt.config import load_config, parse_overrides, to_yaml
from nanopt.errors import ConfigError, DiskFull
from nanopt.lock import DirLock
from nanopt.main import run
from nanopt.metrics import MetricsLogger
from nanopt.model import build_model
from test_prepare_ownership import _config as _prepare_config  # the byte tokenizer over local JSON lines

ARGS = small_overrides(**{"train.precision": "fp32", "train.max_steps": 4, "checkpoint.every": 2,
                          "log.tensorboard": "false"})
USERS = b'{"step": 1, "loss": 9.0, "mine": "a line of the user\'s own"}\nnot even JSON\n'


def train_here(run_dir: Path, *extra: str) -> int:
    return run([*ARGS, f"--run.dir={run_dir}", *extra])


def users_file(tmp_path: Path) -> Path:
    """A file of the user's, outside any run directory."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    path = outside / "mine.jsonl"
    path.write_bytes(USERS)
    return path


def linked_run(tmp_path: Path, name: str, dangling: bool) -> tuple[Path, Path]:
    """A run directory whose file `name` is a link to a user's file outside it (deleted first when dangling)."""
    mine = users_file(tmp_path)
    if dangling:
        mine.unlink()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to(mine)
    return run_dir, mine


def one_paragraph(err: str) -> str:
    assert "Traceback" not in err and err.strip().count("\n") == 0, err
    return err


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def full_disk_for(monkeypatch, name: str, call: str = "write", when: Callable[[], bool] = lambda: True) -> None:
    """os.write (or os.fsync) raises ENOSPC for a file whose name holds `name` (its temp files too), as a full disk
    does; the first write still gets half of its bytes onto the disk (a short write), as at the disk's real end."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to tell which file a descriptor is")
    real = getattr(os, call)
    cut = set()

    def full(fd: int, *args):
        if name in Path(fd_path(fd)).name and when():
            if call == "write" and fd not in cut:
                cut.add(fd)
                return real(fd, args[0][: max(1, len(args[0]) // 2)])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, *args)

    monkeypatch.setattr(os, call, full)


# ---------------------------------------------------------------- links where run files should be


@pytest.mark.slow
def test_metrics_jsonl_linked_to_a_users_file_is_refused_and_nothing_is_copied(tmp_path, capsys):
    """Before: the resume's trim read the user's lines and wrote them into the run, and training appended after them."""
    mine = users_file(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / rundirs.METRICS_FILE).symlink_to(mine)
    assert train_here(run_dir) == 2
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
    assert train_here(run_dir) == 2
    err = one_paragraph(capsys.readouterr().err)
    assert str(run_dir / name) in err and str(target) in err and "symbolic link" in err
    assert not target.exists() and list(target.parent.iterdir()) == []


@pytest.mark.parametrize("dangling", [False, True])
def test_evals_jsonl_as_a_link_is_never_appended_through(tmp_path, dangling):
    """Before: `nanopt eval`, `--core` and `--watch` appended to the user's file, or created one outside."""
    run_dir, mine = linked_run(tmp_path, rundirs.EVALS_FILE, dangling)
    with pytest.raises(ConfigError, match="symbolic link") as e:
        io.append_jsonl(run_dir / rundirs.EVALS_FILE, {"step": 2, "val_loss": 1.0})
    assert str(run_dir / rundirs.EVALS_FILE) in str(e.value) and "Remove the link" in str(e.value)
    assert (not mine.exists()) if dangling else mine.read_bytes() == USERS


@pytest.mark.parametrize("flags", [[], ["--tasks", "nanopt_mc"]])
def test_nanopt_eval_refuses_a_linked_evals_file_before_it_evaluates(tmp_path, capsys, flags):
    """The refusal comes before the model is loaded or scored, not at the append after the work."""
    mine = users_file(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / rundirs.CONFIG_FILE).write_text("not even a config: never read\n")
    (run_dir / rundirs.EVALS_FILE).symlink_to(mine)
    for path in (run_dir, run_dir / "checkpoints" / "step_000002"):
        assert cli.run(["eval", str(path), *flags]) == 2
        err = one_paragraph(capsys.readouterr().err)
        assert str(run_dir / rundirs.EVALS_FILE) in err and "symbolic link" in err
    assert mine.read_bytes() == USERS


def test_the_metrics_logger_and_the_trim_refuse_a_link(tmp_path):
    mine = users_file(tmp_path)
    (tmp_path / rundirs.METRICS_FILE).symlink_to(mine)
    with pytest.raises(ConfigError, match="symbolic link"):
        MetricsLogger(tmp_path, enabled=True).trim(0)
    with pytest.raises(ConfigError, match="symbolic link"):
        MetricsLogger(tmp_path, enabled=True, tensorboard=False).open()
    assert mine.read_bytes() == USERS


@pytest.mark.parametrize("dangling", [False, True])
def test_a_lock_file_that_is_a_link_is_named_and_left_alone(tmp_path, dangling):
    """Before: the lease was read through the link ("cannot be read") or, dangling, "other processes keep taking it"."""
    run_dir, mine = linked_run(tmp_path, rundirs.LOCK_FILE, dangling)
    lock = DirLock(run_dir)
    for ask in (lock.acquire, lock.holder):
        with pytest.raises(ConfigError, match="symbolic link") as e:
            ask()
        assert str(run_dir / rundirs.LOCK_FILE) in str(e.value)
    assert (run_dir / rundirs.LOCK_FILE).is_symlink() and ((not mine.exists()) if dangling else
                                                             mine.read_bytes() == USERS)


def test_an_atomic_write_replaces_a_link_and_never_writes_through_its_temp_file(tmp_path):
    """The rename replaces a link at the name; before, a link planted at the temp file's (predictable) name was
    followed, and the user's file overwritten."""
    mine = users_file(tmp_path)
    summary = tmp_path / rundirs.SUMMARY_FILE
    summary.symlink_to(mine)
    io.write_json(summary, {"steps": 4})
    assert not summary.is_symlink() and json.loads(summary.read_text()) == {"steps": 4}
    assert mine.read_bytes() == USERS
    tmp = summary.with_name(f".{summary.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.symlink_to(mine)
    io.write_json(summary, {"steps": 5})
    assert json.loads(summary.read_text()) == {"steps": 5} and mine.read_bytes() == USERS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", rundirs.SUMMARY_FILE]


def test_a_checkpoint_save_removes_links_in_its_way_never_what_they_point_to(tmp_path):
    """Before: a link at .tmp_step_NNNNNN made rmtree raise (a traceback) and one at step_NNNNNN the same."""
    mine = tmp_path / "outside"
    mine.mkdir()
    (mine / "precious").write_text("the user's")
    root = tmp_path / "run" / rundirs.CHECKPOINTS_DIR
    root.mkdir(parents=True)
    (root / ".tmp_step_000002").symlink_to(mine)
    (root / "step_000002").symlink_to(mine)
    cfg = load_config(None, parse_overrides(ARGS))
    model = build_model(cfg.model, "cpu")
    final = checkpoint.save(root, 2, model, torch.optim.AdamW(model.parameters()), {}, keep=3)
    assert not final.is_symlink() and checkpoint.verify_checkpoint(final) is None
    assert [p.name for p in mine.iterdir()] == ["precious"] and (mine / "precious").read_text() == "the user's"


# ---------------------------------------------------------------- the lock recovers from a crash or a full disk


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_full_disk_at_the_start_leaves_no_lock_and_the_next_start_takes_it(tmp_path, monkeypatch):
    """Before: a 0-byte lock.json stayed, and every re-run refused with "a process whose lock file cannot be read"."""
    full_disk_for(monkeypatch, rundirs.LOCK_FILE)
    with pytest.raises(DiskFull) as e:
        DirLock(tmp_path).acquire()
    message = str(e.value)
    assert str(tmp_path / rundirs.LOCK_FILE) in message and "no space left" in message and "GiB free" in message
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC
    assert not (tmp_path / rundirs.LOCK_FILE).exists()
    monkeypatch.undo()  # space freed
    lock = DirLock(tmp_path).acquire()
    assert lock.holder().token == lock.token
    lock.release()


@pytest.mark.slow
def test_a_full_disk_at_the_start_of_training_is_exit_1_and_the_rerun_trains(tmp_path, monkeypatch, capsys):
    full_disk_for(monkeypatch, rundirs.LOCK_FILE)
    assert train_here(tmp_path) == 1
    err = one_paragraph(capsys.readouterr().err)
    assert str(tmp_path / rundirs.LOCK_FILE) in err and "no space left" in err and "GiB free" in err
    monkeypatch.undo()
    assert train_here(tmp_path) == 0


def test_a_lock_cut_short_naming_a_dead_pid_on_this_host_is_taken_over_at_once(tmp_path):
    """Before: any unreadable lock was "held" until 120 s after it was written."""
    cut = f'{{"host": "{socket.gethostname()}", "pid": {_dead_pid()}, "started": 17'
    (tmp_path / rundirs.LOCK_FILE).write_text(cut)
    lock = DirLock(tmp_path).acquire()
    assert lock.holder().token == lock.token
    lock.release()


@pytest.mark.parametrize("content", ["", f'{{"host": "{socket.gethostname()}", "pid": {os.getpid()}, "sta'],
                         ids=["empty", "cut-short-live-pid"])
def test_an_unreadable_lock_is_held_while_young_and_stale_after_the_expiry(tmp_path, content):
    """An empty lock, or one cut short whose pid lives: being written, for all anyone knows, until it is older than
    the lease's expiry (the settled semantics); then taken over."""
    path = tmp_path / rundirs.LOCK_FILE
    path.write_text(content)
    with pytest.raises(ConfigError, match="lock file cannot be read") as e:
        DirLock(tmp_path, expires_s=60).acquire()
    assert "empty or cut short" in str(e.value) and str(path) in str(e.value)
    os.utime(path, (time.time() - 61, time.time() - 61))
    lock = DirLock(tmp_path, expires_s=60).acquire()
    assert lock.holder().token == lock.token
    lock.release()


# ---------------------------------------------------------------- a full disk while saving


def test_a_short_write_on_a_full_disk_is_cut_off_and_the_earlier_lines_stay_whole(tmp_path, monkeypatch):
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
    assert train_here(tmp_path) == 1
    err = one_paragraph(capsys.readouterr().err)
    model_file = rundirs.checkpoints_dir(tmp_path) / ".tmp_step_000004" / rundirs.MODEL_FILE
    assert f"writing {model_file}" in err and "GiB free" in err and "run the same command again" in err
    newest, skipped = checkpoint.newest_checkpoint(tmp_path)
    assert [p.name for p in checkpoint.checkpoint_dirs(rundirs.checkpoints_dir(tmp_path))] == ["step_000002"]
    assert newest.name == "step_000002" and skipped == []
    assert not (rundirs.checkpoints_dir(tmp_path) / ".tmp_step_000004").exists()
    assert not (tmp_path / rundirs.LOCK_FILE).exists()
    monkeypatch.undo()  # space freed
    assert train_here(tmp_path) == 0
    assert "resuming from" in capsys.readouterr().out
    assert [r["step"] for r in rundirs.read_metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4]


def test_a_full_disk_in_torch_save_is_disk_full_naming_the_file(tmp_path, monkeypatch):
    """torch.save's own writer reports ENOSPC as a bare RuntimeError ("unexpected pos"); written through a file
    object, the OSError is its context, and the save removes its temp directory."""
    cfg = load_config(None, parse_overrides(ARGS))
    model = build_model(cfg.model, "cpu")
    opt = torch.optim.AdamW(model.parameters())
    root = tmp_path / rundirs.CHECKPOINTS_DIR
    checkpoint.save(root, 2, model, opt, {}, keep=3)
    real = torch.save

    def full(obj, f, *args, **kwargs):
        if isinstance(f, (str, Path)):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(DiskFull) as e:
        checkpoint.save(root, 4, model, opt, {}, keep=3)
    monkeypatch.setattr(checkpoint.torch, "save", real)
    assert f"writing {root / '.tmp_step_000004' / rundirs.OPTIMIZER_FILE}" in str(e.value)
    assert sorted(p.name for p in root.iterdir()) == [rundirs.LATEST_FILE, "step_000002"]
    assert checkpoint.verify_checkpoint(root / "step_000002") is None


@pytest.mark.slow
def test_a_full_disk_while_logging_metrics_is_exit_1_and_keeps_every_whole_line(tmp_path, monkeypatch, capsys):
    logged = {"n": 0}

    def past_step_2() -> bool:
        logged["n"] += 1
        return logged["n"] > 2

    full_disk_for(monkeypatch, rundirs.METRICS_FILE, when=past_step_2)
    assert train_here(tmp_path) == 1
    err = one_paragraph(capsys.readouterr().err)
    assert str(tmp_path / rundirs.METRICS_FILE) in err and "GiB free" in err
    monkeypatch.undo()
    assert [r["step"] for r in rundirs.read_metrics(tmp_path)] == [1, 2]  # no half line left
    assert train_here(tmp_path) == 0
    assert [r["step"] for r in rundirs.read_metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4]


# ---------------------------------------------------------------- nanopt prepare



def _cli_prepare(cfg, tmp_path: Path, capsys) -> tuple[int, str]:
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(to_yaml(cfg))
    code = cli.run(["prepare", "--config", str(cfg_file), "--no-progress"])
    return code, capsys.readouterr().err


@pytest.fixture
def no_waits(monkeypatch) -> list[float]:
    """prepare's retry waits, recorded instead of slept."""
    waits: list[float] = []
    monkeypatch.setattr(prepare.time, "sleep", waits.append)
    return waits


def test_prepare_into_a_file_is_exit_2_at_once(tmp_path, capsys, no_waits):
    """Before: the FileExistsError was taken for a flaky source and retried for minutes."""
    cfg = _prepare_config(tmp_path)
    (tmp_path / "shards").write_text("a file, not a directory")
    code, err = _cli_prepare(cfg, tmp_path, capsys)
    assert code == 2 and no_waits == []
    err = one_paragraph(err)
    assert str(tmp_path / "shards") in err and "is a file" in err and "`data.source`" in err
    assert (tmp_path / "shards").read_text() == "a file, not a directory"


def test_a_second_prepare_into_one_directory_is_exit_2_naming_the_holder(tmp_path, capsys, no_waits):
    """Before: both exited 0, leaving doubled .doclens files and document counts."""
    cfg = _prepare_config(tmp_path)
    with DirLock(tmp_path / "shards", what="data"):  # a prepare running in this process, as the lease says
        code, err = _cli_prepare(cfg, tmp_path, capsys)
        assert code == 2
        err = one_paragraph(err)
        assert f"in use by process {os.getpid()} on host {socket.gethostname()}" in err
        assert str(tmp_path / "shards" / rundirs.LOCK_FILE) in err
        assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [rundirs.LOCK_FILE]  # nothing written
    code, _ = _cli_prepare(cfg, tmp_path, capsys)
    assert code == 0 and not (tmp_path / "shards" / rundirs.LOCK_FILE).exists()
    stats = json.loads((tmp_path / "shards" / prepare.STATS).read_text())
    whole = prepare.prepare(_prepare_config(tmp_path, "whole"), progress=False)
    assert stats["splits"] == whole["splits"]


def test_a_full_disk_in_prepare_is_exit_1_at_once_and_the_rerun_ends_identical(tmp_path, monkeypatch, capsys, no_waits):
    """Before: ENOSPC was taken for a flaky source: retried 5 times over 15 minutes, then "the source kept failing"."""
    cfg = _prepare_config(tmp_path)
    full_disk_for(monkeypatch, "train_000002.bin", call="fsync")
    code, err = _cli_prepare(cfg, tmp_path, capsys)
    assert code == 1 and no_waits == []
    err = one_paragraph(err)
    out = tmp_path / "shards"
    assert f"writing {out / 'train_000002.bin'}" in err and "GiB free" in err and "run the same command again" in err
    assert [s["file"] for s in shards.read_manifest(out)["shards"]] == ["train_000000.bin", "train_000001.bin"]
    assert not any(".tmp" in p.name for p in out.iterdir()) and not (out / rundirs.LOCK_FILE).exists()
    monkeypatch.undo()
    assert _cli_prepare(cfg, tmp_path, capsys)[0] == 0
    prepare.prepare(_prepare_config(tmp_path, "whole"), progress=False)
    whole = tmp_path / "whole"
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == {p.name: p.read_bytes() for p in whole.glob("*.bin")}
    assert json.loads((out / prepare.STATS).read_text())["splits"] == json.loads((whole / prepare.STATS).read_text())[
        "splits"]


def test_an_output_file_prepare_cannot_write_is_exit_2_at_once(tmp_path, monkeypatch, capsys, no_waits):
    """Before: a PermissionError on a shard was taken for a flaky source and retried for minutes, then exit 1."""
    cfg = _prepare_config(tmp_path)
    real = shards.write_shard

    def read_only(path, *args):
        if Path(path).name == "train_000001.bin":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args)

    monkeypatch.setattr(shards, "write_shard", read_only)
    code, err = _cli_prepare(cfg, tmp_path, capsys)
    assert code == 2 and no_waits == []
    err = one_paragraph(err)
    out = tmp_path / "shards"
    assert f"cannot write {out / 'train_000001.bin'} (Permission denied)" in err and "run the same command" in err
    assert [s["file"] for s in shards.read_manifest(out)["shards"]] == ["train_000000.bin"]


def test_a_doclens_file_that_is_a_link_is_refused_and_the_users_file_untouched(tmp_path):
    """Before: the resume truncated the file the link pointed to, then appended to it."""
    cfg = _prepare_config(tmp_path)
    prepare.prepare(cfg, progress=False)
    out = tmp_path / "shards"
    doclens = out / ".doclens-train.u32"
    mine = users_file(tmp_path)
    doclens.unlink()
    doclens.symlink_to(mine)
    with pytest.raises(ConfigError, match="symbolic link") as e:
        prepare.prepare(cfg, progress=False)
    assert str(doclens) in str(e.value) and mine.read_bytes() == USERS
