"""Files that are never torn: atomic writes (temp file + fsync + rename), JSON lines appends, the cache dir."""
from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Any

from nanopt.errors import ConfigError


def cache_dir() -> Path:
    """Where nanopt keeps what it can rebuild (the embedded corpus shards, XLA's compile cache)."""
    return Path(os.environ.get("NANOPT_CACHE", Path.home() / ".cache" / "nanopt"))


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, *chunks: bytes) -> Path:
    """Write `path` so that it holds either its old content or all of `chunks`, even across a crash."""
    path = Path(path)
    # A name of this writer's own: two processes replacing one file (a lease's heartbeat and its takeover, a
    # sweep's state) must never write into, or rename, each other's half-written temp file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception:  # a full disk: leave no half-written temp file (a kill or Ctrl-C leaves one, as a crash does)
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    return write_bytes(path, text.encode())


def clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null rather than emit an unparseable file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: Path, data: Any, indent: int = 2) -> Path:
    if isinstance(data, dict):
        data = {k: clean(v) for k, v in data.items()}
    return write_text(path, json.dumps(data, indent=indent) + "\n")


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line with one O_APPEND write(): concurrent writers (`nanopt eval`s) never interleave."""
    line = (json.dumps({k: clean(v) for k, v in record.items()}) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_json(path: Path) -> Any:
    """A JSON file a user pointed at (a config.json, a manifest); ConfigError naming it when unreadable
    (missing, not UTF-8, not JSON: UnicodeDecodeError is a ValueError but no JSONDecodeError)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON: {e}.") from None
