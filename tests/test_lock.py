"""One writer at a time (nanopt/lock.py): a lease from another host is taken over only once its heartbeat expired,
the heartbeat renews it and notices a takeover, a retry of the same job takes its lease at once, and a lock that a
crash or a full disk left (empty, cut short, naming a dead pid) is recovered; one that is a link is named."""
from __future__ import annotations

import errno
import json
import os
import socket
import time

import pytest
from conftest import USERS, dead_pid, full_disk_for, linked_run

from nanopt import rundirs
from nanopt.errors import ConfigError, DiskFull
from nanopt.io import write_json
from nanopt.lock import LOCK_EXPIRES_ENV, LOCK_OWNER_ENV, DirLock


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
    path = tmp_path / rundirs.LOCK_FILE
    assert all(words in str(e.value) for words in (str(path), "no space left", "GiB free"))
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC and not path.exists()
    monkeypatch.undo()  # space freed
    assert (lock := DirLock(tmp_path).acquire()).holder().token == lock.token
    lock.release()


def _lease(**changes: object) -> str:  # another host's process's, as DirLock writes it, with a fresh heartbeat
    return json.dumps({"host": "elsewhere", "pid": 1, "started": time.time(), "heartbeat": time.time(), "token": "t",
                       **changes})


def _aged(path, monkeypatch) -> None:
    os.utime(path, (time.time() - 61, time.time() - 61))


# (id, lock.json's content, the env, the refusal's words (None: taken at once), what makes it stale, expires_s)
TAKEOVERS = [
    # Before: any unreadable lock was "held" until 120 s after it was written.
    ("cut-short-dead-pid", lambda: f'{{"host": "{socket.gethostname()}", "pid": {dead_pid()}, "started": 17', {},
     None, None, 60),
    # An empty lock, or one cut short whose pid lives: being written, for all anyone knows, until it is older than
    # the lease's expiry (the settled semantics); then taken over.
    ("empty", lambda: "", {}, ["lock file cannot be read", "empty or cut short"], _aged, 60),
    ("cut-short-live-pid", lambda: f'{{"host": "{socket.gethostname()}", "pid": {os.getpid()}, "sta', {},
     ["lock file cannot be read", "empty or cut short"], _aged, 60),
    ("other-host", _lease, {}, ["host elsewhere"],
     lambda path, _: path.write_text(_lease(heartbeat=time.time() - 61)), 60),
    # On a Modal Volume heartbeats travel only with commits: a lease expires late, but a retry of the same call
    # (same LOCK_OWNER_ENV) takes over what its killed attempt left, and another job still waits.
    ("retry-of-the-same-job", lambda: _lease(host="dead-container", pid=7, owner="call-1"),
     {LOCK_EXPIRES_ENV: "1260", LOCK_OWNER_ENV: "call-2"}, ["dead-container"],
     lambda path, mp: mp.setenv(LOCK_OWNER_ENV, "call-1"), None),
]


@pytest.mark.parametrize("content, env, refused, stale, expires_s", [c[1:] for c in TAKEOVERS],
                         ids=[c[0] for c in TAKEOVERS])
def test_a_lease_is_taken_over_only_once_its_holder_is_gone(tmp_path, monkeypatch, content, env, refused, stale,
                                                            expires_s):
    path = tmp_path / rundirs.LOCK_FILE
    path.write_text(content())
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if refused:
        with pytest.raises(ConfigError) as e:
            DirLock(tmp_path, expires_s=expires_s).acquire()
        assert str(path) in str(e.value) and all(word in str(e.value) for word in refused), e.value
        stale(path, monkeypatch)
    lock = DirLock(tmp_path, expires_s=expires_s).acquire()
    assert lock.expires_s == float(env.get(LOCK_EXPIRES_ENV, expires_s))
    assert lock.holder().token == lock.token and lock.holder().owner == os.environ.get(LOCK_OWNER_ENV, "")
    lock.release()
    assert not path.exists()


@pytest.mark.slow
def test_the_heartbeat_renews_the_lease_and_notices_a_takeover(tmp_path):
    """Waited for up to 10 s each (a loaded machine runs the heartbeat thread late), never timed."""
    def soon(condition) -> bool:
        deadline = time.monotonic() + 10
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.02)
        return bool(condition())

    lock = DirLock(tmp_path, heartbeat_s=0.05).acquire()
    first = lock.holder().heartbeat
    assert soon(lambda: lock.holder().heartbeat > first)
    write_json(tmp_path / rundirs.LOCK_FILE, {"host": "h", "pid": 1, "started": 0, "heartbeat": 0, "token": "x"})
    assert soon(lambda: lock.lost) and "taken over" in lock.lost
    lock.release()
    assert (tmp_path / rundirs.LOCK_FILE).is_file()  # not ours any more: left for its holder
