"""One writer at a time (nanopt/lock.py): a lease from another host is taken over only once its heartbeat expired,
the heartbeat renews it and notices a takeover, a retry of the same job takes its lease at once, and a lock that a
crash or a full disk left (empty, cut short, naming a dead pid) is recovered; one that is a link is named."""
from __future__ import annotations

import errno
import os
import socket
import time

import pytest
from conftest import USERS, dead_pid, full_disk_for, linked_run

from nanopt import rundirs
from nanopt.errors import ConfigError, DiskFull
from nanopt.io import write_json
from nanopt.lock import LOCK_EXPIRES_ENV, LOCK_OWNER_ENV, DirLock

# ---------------------------------------------------------------- a lock that a crash or a full disk left


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


def test_a_lock_cut_short_naming_a_dead_pid_on_this_host_is_taken_over_at_once(tmp_path):
    """Before: any unreadable lock was "held" until 120 s after it was written."""
    cut = f'{{"host": "{socket.gethostname()}", "pid": {dead_pid()}, "started": 17'
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


# ---------------------------------------------------------------- leases and heartbeats


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
