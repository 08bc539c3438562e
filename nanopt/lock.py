"""One writer at a time: the lease a trainer, sweep, `nanopt prepare` or watcher holds in its directory (torch-free)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from nanopt.errors import ConfigError
from nanopt.io import open_own, write_bytes, writing
from nanopt.rundirs import LOCK_FILE
from nanopt.schema import Field, parse, problem

log = logging.getLogger("nanopt")

LOCK_OWNER_ENV, LOCK_EXPIRES_ENV = "NANOPT_LOCK_OWNER", "NANOPT_LOCK_EXPIRES_S"


@dataclass
class Holder:
    """Who holds a lock: host, pid, when it started and its last heartbeat (time.time())."""
    host: str
    pid: int
    started: float
    heartbeat: float
    token: str
    command: str = ""
    owner: str = ""  # LOCK_OWNER_ENV of the holder: a job id that its scheduler's retries share

    def describe(self) -> str:
        if not self.token:
            who = f"process {self.pid} on host {self.host}" if self.pid > 0 else "a process"
            return (f"{who} whose lock file cannot be read (empty or cut short: being written, or left by a crash or "
                    f"a full disk; last written {time.time() - self.heartbeat:.0f} s ago)")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (f"process {self.pid} on host {self.host} (started {started}, last heartbeat "
                f"{time.time() - self.heartbeat:.0f} s ago{', running ' + self.command if self.command else ''})")


# The lease as _record writes it.
LEASE = Field(dict, fields={**{k: Field(str, required=True) for k in ("host", "token")},
                            **{k: Field(float, required=True) for k in ("started", "heartbeat")},
                            "pid": Field(int, required=True), "command": Field(str), "owner": Field(str)})


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    try:  # a killed process its parent has not reaped yet (a zombie) still answers kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS): trust kill()
        return True


class DirLock:
    """One writer at a time for a directory: a lease file with the owner's host, pid and a heartbeat a thread renews
    (flock means nothing across machines: a Modal Volume, NFS), taken over only when its holder is gone: on this host
    a dead pid, elsewhere a heartbeat older than `expires_s` (LOCK_EXPIRES_ENV where heartbeats arrive late), or an
    earlier attempt of this job (LOCK_OWNER_ENV). The stale file is renamed aside first: of two racers one wins."""

    def __init__(self, directory: Path, what: str = "run", expires_s: Optional[float] = None,
                 heartbeat_s: float = 15.0, filename: str = LOCK_FILE, setting: str = ""):
        self.dir, self.what, self.filename = Path(directory), what, filename
        self.setting = setting or ("`run.dir`" if what == "run" else "--dir")  # where the user names the directory
        self.path = self.dir / filename
        self.expires_s = expires_s if expires_s is not None else float(os.environ.get(LOCK_EXPIRES_ENV) or 120.0)
        self.heartbeat_s = heartbeat_s
        self.owner = os.environ.get(LOCK_OWNER_ENV, "")
        self.token = uuid.uuid4().hex
        self.started = time.time()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost: Optional[str] = None  # set by the heartbeat when another process took the lease

    def holder(self, path: Optional[Path] = None) -> Optional[Holder]:
        """The holder of the lease (or of the one at `path`); None when there is none; token "" when unreadable;
        ConfigError when it is a symbolic link or a FIFO (never taken for a damaged lease)."""
        path = path or self.path
        try:
            with os.fdopen(open_own(path, os.O_RDONLY), "rb") as f:
                data, mtime = f.read(1 << 16), os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None
        except OSError:  # unreadable (no permission): a lease that tells nothing, as old as the file
            try:
                data, mtime = b"", path.stat().st_mtime
            except FileNotFoundError:
                return None
        record, why = parse(data)
        if why is None and problem(record, LEASE) is None:
            return Holder(**{k: record[k] for k in LEASE.fields if k in record})
        # Cut short (a crash or a full disk between create and write) or damaged: what it still tells (a cut write
        # keeps host and pid), token "", as old as the file.
        host, pid = re.search(rb'"host": "([^"\\]*)"', data), re.search(rb'"pid": (\d{1,10})[,}]', data)
        return Holder(host.group(1).decode(errors="replace") if host else "?", int(pid.group(1)) if pid else -1,
                      mtime, mtime, "")

    def _expired(self, h: Holder) -> bool:
        """Stale: an earlier attempt of this job; on this host, a dead pid; a live pid's readable lease never; else
        (another host, or an unreadable lease whose pid is unknown or alive) a heartbeat older than expires_s."""
        if self.owner and h.owner == self.owner:
            return True
        if h.host == socket.gethostname() and h.pid > 0:
            if not _pid_alive(h.pid):
                return True
            if h.token:
                return False
        return time.time() - h.heartbeat > self.expires_s

    def _record(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": self.started,
                           "heartbeat": time.time(), "token": self.token, "owner": self.owner,
                           "command": " ".join(sys.argv)[:300]}).encode()

    def _create(self) -> bool:
        """Create the lease (O_EXCL: of racing processes one does); False when one exists. A failed write (a full
        disk) removes the file it created, so no empty lease is left for every later start to trip over."""
        try:
            fd = open_own(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return False
        try:
            record, written = self._record(), 0
            while written < len(record):  # os.write: a short write happens only at the disk's end
                written += os.write(fd, record[written:])
            os.fsync(fd)
        except BaseException:
            self.path.unlink(missing_ok=True)  # ours: created above with O_EXCL
            raise
        finally:
            os.close(fd)
        return True

    def _take_over(self, stale: Holder) -> None:
        """Move a stale lease aside; one another process wrote since we judged it stale is put back."""
        aside = self.dir / f".{self.filename}.stale.{self.token}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        now = self.holder(aside)
        if now is not None and now.token != stale.token:
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)  # not os.rename: never over a lease created since
        aside.unlink(missing_ok=True)

    def acquire(self) -> "DirLock":
        """Take the lease or raise ConfigError naming who holds it (DiskFull when there is no space to write it)."""
        if self.dir.exists() and not self.dir.is_dir():
            raise ConfigError(f"the {self.what} directory {self.dir} is a file; set {self.setting} to a directory (or "
                              f"remove the file).")
        # Any other OSError (no permission, a read-only mount) names its path: cli.run's one paragraph.
        with writing(self.dir):
            self.dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            with writing(self.path):
                created = self._create()
            if created:
                self._thread = threading.Thread(target=self._beat, name="nanopt-lease", daemon=True)
                self._thread.start()
                return self
            held = self.holder()
            if held is None:
                continue
            if not self._expired(held):
                raise ConfigError(f"the {self.what} directory {self.dir} is in use by {held.describe()}; {self.path} "
                                  f"says so, and one writer at a time keeps its files whole. Wait for that process to "
                                  f"end, stop it, or use another directory. If that process is gone for good (its "
                                  f"machine is lost), the lock expires {self.expires_s:.0f} s after its last "
                                  f"heartbeat, or delete {self.path} yourself.")
            self._take_over(held)
        raise ConfigError(f"could not take the lock {self.path}: other processes keep taking it. Make sure one "
                          f"process at a time writes {self.dir}.")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                held = self.holder()
            except ConfigError as e:  # replaced by a symbolic link
                self.lost = str(e)
                log.error("lost the lock of %s: %s", self.dir, e)
                return
            if held is None or held.token != self.token:
                self.lost = f"{self.path} was taken over by {held.describe() if held else 'nobody (it was deleted)'}"
                log.error("lost the lock of %s: %s; another process may now write it too", self.dir, self.lost)
                return
            with contextlib.suppress(OSError):  # a missed heartbeat is not fatal; the lease outlives several
                write_bytes(self.path, self._record())

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            with contextlib.suppress(ConfigError):  # a link in its place is not ours to remove
                if (held := self.holder()) is not None and held.token == self.token:
                    self.path.unlink(missing_ok=True)

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

