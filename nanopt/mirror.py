"""Remote copies of checkpoints: each completed checkpoint is copied to an fsspec URL (gs://, s3://, a path)
in a background thread, and fetched back when the local disk has none (a recreated spot VM)."""
from __future__ import annotations

import logging
import os
import queue
import re
import shutil
import threading
from pathlib import Path
from typing import Optional

from nanopt.errors import ConfigError
from nanopt.rundirs import COMPLETE_FILE

log = logging.getLogger("nanopt")


class Mirror:
    """The remote layout matches the local one: URL/step_NNNNNN/<files> with COMPLETE uploaded last (object stores
    have no atomic rename), then URL/latest. Uploads read from hard-linked snapshots, so pruning the local
    directory never races an upload."""

    def __init__(self, url: str, keep: int, pattern: re.Pattern):
        try:
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise ConfigError(
                f"`checkpoint.mirror` is {url!r}, which fsspec cannot open ({e}). Use a local path or file://, "
                f"or install the filesystem's package (gcsfs for gs://, s3fs for s3://)."
            ) from None
        self.url, self.keep, self.pattern = url, keep, pattern
        self.root = self.root.rstrip("/")
        self.failures: list[str] = []
        self._queue: "queue.Queue[Path]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def upload(self, ckpt: Path) -> None:
        """Queue a copy of `ckpt`; returns at once."""
        staging = ckpt.parent / ".mirror-staging" / ckpt.name
        shutil.rmtree(staging, ignore_errors=True)  # a snapshot left by a crash
        staging.mkdir(parents=True)
        for f in ckpt.iterdir():
            try:
                os.link(f, staging / f.name)
            except OSError:  # a filesystem without hard links
                shutil.copy2(f, staging / f.name)
        self._queue.put(staging)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="nanopt-mirror", daemon=True)
            self._thread.start()

    def wait(self) -> None:
        """Block until every queued copy is done (or failed with a warning)."""
        if self._thread is not None:
            self._queue.join()

    def _work(self) -> None:
        while True:
            staging = self._queue.get()
            try:
                self._put(staging)
            except Exception as e:  # a remote hiccup must not kill training; the local checkpoint is intact
                self.failures.append(f"{staging.name}: {e}")
                log.warning("checkpoint mirror: copying %s to %s failed: %s", staging.name, self.url, e)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
                self._queue.task_done()

    def _put(self, staging: Path) -> None:
        remote = f"{self.root}/{staging.name}"
        if self.fs.exists(remote):
            self.fs.rm(remote, recursive=True)
        self.fs.makedirs(remote, exist_ok=True)
        names = sorted(f.name for f in staging.iterdir() if f.name != COMPLETE_FILE) + [COMPLETE_FILE]
        for name in names:
            self.fs.put_file(str(staging / name), f"{remote}/{name}")
        self.fs.pipe_file(f"{self.root}/latest", (staging.name + "\n").encode())
        for name in self.names()[:-self.keep]:
            self.fs.rm(f"{self.root}/{name}", recursive=True)
        log.info("checkpoint mirror: %s copied to %s", staging.name, self.url)

    def names(self) -> list[str]:
        """Names of the complete remote checkpoints (directories matching `pattern`, group 1 a number, with a
        COMPLETE marker), oldest first."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            m = self.pattern.match(str(entry).rstrip("/").rsplit("/", 1)[-1])
            if m and self.fs.exists(f"{self.root}/{m.group(0)}/{COMPLETE_FILE}"):
                found.append(m)
        return [m.group(0) for m in sorted(found, key=lambda m: int(m.group(1)))]

    def fetch(self, name: str, dest: Path) -> Path:
        """Download URL/<name>/* into the fresh directory `dest` (the caller verifies it and moves it into place)."""
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for entry in self.fs.ls(f"{self.root}/{name}", detail=False):
            fname = str(entry).rstrip("/").rsplit("/", 1)[-1]
            self.fs.get_file(f"{self.root}/{name}/{fname}", str(dest / fname))
        return dest
