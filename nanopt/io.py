"""Files never torn nor written through a link: atomic writes, JSON lines appends, the cache dir, the disk-full error
naming the file and the free space. Every open refuses what is no regular file (a FIFO would block) unread."""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

from nanopt.errors import ConfigError, DiskFull, causes

# Where O_NOFOLLOW exists (Linux, macOS), opening a symbolic link fails with ELOOP instead of opening its target.
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# O_NONBLOCK: opening a FIFO waits for its other end, and only then could fstat tell it is none of nanopt's files.
NONBLOCK = getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded")


def cache_dir() -> Path:
    """Where nanopt keeps what it can rebuild (the embedded corpus shards, XLA's compile cache)."""
    return Path(os.environ.get("NANOPT_CACHE", Path.home() / ".cache" / "nanopt"))


def fsync(path: Path) -> None:
    """Make a file durable, or a rename inside directory `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- a full disk
def is_disk_full(error: BaseException) -> bool:
    """ENOSPC (or a quota) however a writer surfaced it: an OSError, or a library's error around one or saying so."""
    return any((isinstance(e, OSError) and e.errno in FULL_ERRNOS) or any(text in str(e) for text in FULL_TEXTS)
               for e in causes(error))


def _device_of(path: Path) -> str:
    """The mount holding `path`: "DEVICE (mounted at MOUNT)" as /proc/mounts has it."""
    here = Path(os.path.abspath(path))
    mount = next(p for p in (here, *here.parents) if os.path.ismount(p))  # / is one
    with contextlib.suppress(OSError):
        for fields in map(str.split, Path("/proc/mounts").read_text().splitlines()):
            if fields[1:2] == [str(mount)]:
                return f"{fields[0]} (mounted at {mount})"
    return str(mount)


def disk_full(path: Path) -> DiskFull:
    """The DiskFull paragraph for a write to `path` that found no space: its device and the free space now."""
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    free: Optional[int] = None
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(existing).free
    return DiskFull(path, free, _device_of(existing))


def as_disk_full(error: BaseException, where: Path) -> Optional[DiskFull]:
    """`error` as DiskFull when it is a full disk (naming the file it names, else `where`); None when it is not."""
    if isinstance(error, DiskFull) or not is_disk_full(error):
        return error if isinstance(error, DiskFull) else None
    named = next((e for e in causes(error) if isinstance(e, OSError) and e.filename), None)
    return disk_full(Path(named.filename) if isinstance(named, OSError) else where)


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn a full disk met while writing `path` into DiskFull naming it (other errors pass unchanged)."""
    try:
        yield
    except Exception as e:
        if not isinstance(e, DiskFull) and is_disk_full(e):
            raise disk_full(path) from e
        raise


# ---------------------------------------------------------------- never through a link, never a FIFO
def link_refused(path: Path) -> ConfigError:
    """A symbolic link where nanopt writes a file of its own: one paragraph naming it and the fix."""
    path = Path(path)
    target = ""
    with contextlib.suppress(OSError):
        target = f" (to {os.readlink(path)})"
    return ConfigError(f"{path} is a symbolic link{target}, where nanopt writes a file of its own; it never writes "
                       f"through a link, which would change or create a file outside the directory. Remove the link "
                       f"(or, if the file it points to is this directory's own, replace the link with a copy of that "
                       f"file) and run the command again.")


def not_a_file(path: Path, mode: int) -> ConfigError:
    """Something other than a regular file (of stat mode `mode`) where nanopt expects a file: one paragraph."""
    if stat.S_ISDIR(mode):
        return ConfigError(f"{path} is a directory, where nanopt expects a file; it never reads or replaces a "
                           f"directory there. Move it aside (or remove it) and run the command again.")
    kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device")
    return ConfigError(f"{path} is not a regular file but {kind}, where nanopt expects a file; it is refused unread "
                       f"(a read from it could wait or run for ever). Move it aside (or restore the file) and run "
                       f"the command again.")


def _checked(fd: int, path: Path) -> int:
    """`fd` back in blocking mode when it is a regular file's; else closed, and ConfigError naming `path`."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise not_a_file(path, mode)
    os.set_blocking(fd, True)
    return fd


def refuse_link(path: Path) -> None:
    """ConfigError when `path` is a symbolic link (dangling or not) or anything but a regular file where nanopt
    writes a file of its own; an lstat, for a check before the work starts."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            raise link_refused(path)
        if not stat.S_ISREG(mode):
            raise not_a_file(path, mode)


def open_own(path: Path, flags: int, mode: int = 0o644) -> int:
    """os.open of a file nanopt writes that never follows a link: a link there is ConfigError, a dangling one
    included (O_CREAT would create its target); so is anything but a regular file."""
    try:
        return _checked(os.open(path, flags | NOFOLLOW | NONBLOCK, mode), path)
    except OSError as e:
        # ELOOP (Linux, macOS) or EMLINK (FreeBSD): the name is a link; EEXIST: O_EXCL met one.
        if e.errno in (errno.ELOOP, errno.EMLINK) or (e.errno == errno.EEXIST and Path(path).is_symlink()):
            raise link_refused(path) from None
        if e.errno in (errno.EISDIR, errno.ENXIO):  # ENXIO: a FIFO opened for writing that no one reads
            raise not_a_file(path, os.stat(path).st_mode) from None
        raise


def open_read(path: Path) -> int:
    """A file descriptor reading `path` (a link is followed: a user may point at one); ConfigError naming it when
    it is not a regular file."""
    return _checked(os.open(path, os.O_RDONLY | NONBLOCK), path)


def read_bytes(path: Path) -> bytes:
    """`path`'s bytes, refused unread when it is not a regular file (open_read)."""
    with os.fdopen(open_read(path), "rb") as f:
        return f.read()


def read_text(path: Path) -> str:
    """`path` as UTF-8 text (read_bytes); UnicodeDecodeError (a ValueError) for a byte that does not decode."""
    return read_bytes(path).decode("utf-8")


def open_append(path: Path) -> int:
    """A file descriptor appending to `path` (created when missing), never through a link."""
    return open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def append_bytes(fd: int, data: bytes, path: Path) -> None:
    """Append `data` with one write() (O_APPEND: concurrent writers never interleave). A full disk is DiskFull, and
    the part it wrote is cut off again when no other writer appended since: the file keeps every whole line."""
    before, written = os.fstat(fd).st_size, 0
    with writing(path):
        try:
            while written < len(data):  # a short write happens only at the disk's end; the next one raises
                written += os.write(fd, data[written:])
        except OSError:
            if written and os.fstat(fd).st_size == before + written:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, before)
            raise


# ---------------------------------------------------------------- atomic writes
def write_bytes(path: Path, *chunks: bytes) -> Path:
    """Write `path` so that it holds either its old content or all of `chunks`, even across a crash. Never through
    a link: the temp file is created anew (O_EXCL), and the rename replaces a link at `path`. A full disk is
    DiskFull naming `path`; the old content stays."""
    path = Path(path)
    # Of this writer's own: two processes replacing one file must never write into each other's temp file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    if path.is_dir() and not path.is_symlink():  # the rename would fail (IsADirectoryError) after the work
        raise not_a_file(path, stat.S_IFDIR)
    try:
        with writing(path):
            tmp.unlink(missing_ok=True)  # ours by its name: a crash of an earlier process with this pid left it
            with os.fdopen(open_own(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
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


# What a value read from a JSON file is (JSON's true and false are Python ints too).
def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite(value: Any) -> Optional[float]:
    """A finite number as a float, else None (a figure may be null, or damaged)."""
    return float(value) if is_number(value) and math.isfinite(value) else None


def clean(value: Any) -> Any:
    """JSON has no NaN/inf (json.dumps writes NaN, which strict readers refuse): null, at any depth."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    return [clean(v) for v in value] if isinstance(value, (list, tuple)) else value


def write_json(path: Path, data: Any, indent: int = 2) -> Path:
    return write_text(path, json.dumps(clean(data), indent=indent) + "\n")


def json_line(record: dict[str, Any]) -> bytes:
    """One JSON-lines record (NaN and inf as null)."""
    return (json.dumps(clean(record)) + "\n").encode()


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (append_bytes), never through a link (ConfigError naming it)."""
    with os.fdopen(open_append(path), "ab") as f:
        append_bytes(f.fileno(), json_line(record), path)


def read_json(path: Path) -> Any:
    """A JSON file a user pointed at; ConfigError naming it when unreadable (missing, not UTF-8, not JSON)."""
    try:
        return json.loads(read_text(path))
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON: {e}.") from None
