"""What can go wrong, as types and exit statuses; the one place NANOPT_DEBUG is read. No torch, no nanopt imports.

Exit statuses (python -m nanopt.main / nanopt train; modal_app.py reads them):
  0   finished
  1   failed: a crash, or a full disk (DiskFull: one paragraph; what was written before it is kept)
  2   bad input (config, override, flag, path, shard, checkpoint): one paragraph says what and how to fix
  3   training stopped (loss became NaN/inf); the last good checkpoint is kept
  75  preempted (SIGTERM/SIGINT, run.time_limit_s): a checkpoint was saved; re-run to resume (sysexits.h EX_TEMPFAIL)
"""
from __future__ import annotations

import errno
import os
import traceback
from pathlib import Path
from typing import Iterator, Optional

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_PREEMPTED = 0, 1, 2, 3, 75  # as the table above says

# torchrun exits 1 whenever any worker fails, whatever the worker's own code was. A launcher that must tell
# bad input (2) or a diverged run (3), which a retry cannot fix, from a crash or a preemption sets this to
# a file path; each worker appends "RANK CODE" to it as it exits (modal_app.py reads it).
EXIT_STATUS_ENV = "NANOPT_EXIT_STATUS_FILE"


class ConfigError(ValueError):
    """Bad user input in a config file, an override or a CLI flag; printed as one paragraph, exit 2."""


class ShardError(ValueError):
    """A token shard that cannot be trusted: wrong magic, version, size or checksum (exit 2)."""


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. the loss became NaN); the message says why and what was kept (exit 3)."""


class DiskFull(OSError):
    """No space left writing `path` (ENOSPC, a quota): exit 1, raised once the write is undone (io.disk_full)."""

    def __init__(self, path: Path, free_bytes: Optional[int], device: str):
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        self.path, self.free_bytes, self.device = Path(path), free_bytes, device

    def __reduce__(self):  # pickled (a queue, a gather) as what it was built from, not OSError's args
        return DiskFull, (self.path, self.free_bytes, self.device)

    def __str__(self) -> str:
        free = "free space unknown" if self.free_bytes is None else f"{self.free_bytes / 2**30:.2f} GiB free"
        return (f"no space left on {self.device} writing {self.path} ({free}); nothing written before it is lost: "
                f"that file keeps its earlier content, and what was saved before it (checkpoints, metrics, shards) "
                f"stays usable. Free space on that device (or point the output elsewhere) and run the same command "
                f"again to resume.")


class Preempted(Exception):
    """Raised after the checkpoint of a signalled run is safely on disk; the train command turns it into exit 75."""

    def __init__(self, signame: str, step: int, ckpt: Optional[Path]):
        self.signame, self.step, self.ckpt = signame, step, ckpt
        super().__init__(f"preempted by {signame} after step {step}; checkpoint {ckpt} is complete. The run is "
                         f"resumable: re-run the same command to continue from step {step} (exit status "
                         f"{EXIT_PREEMPTED}).")


def causes(error: BaseException) -> Iterator[BaseException]:
    """The error, then what it was raised from or during, each once (a cycle ends the walk)."""
    seen: set[int] = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def path_problem(error: OSError) -> Optional[str]:
    """An OSError about a path (a file where a directory belongs or the reverse, a link to nothing, permission
    denied, a read-only disk) as the one paragraph naming the path and the fix (cli.run: exit 2); None without one."""
    if error.filename is None:
        return None
    path = Path(os.fsdecode(error.filename))
    other = f" (and {os.fsdecode(error.filename2)})" if error.filename2 is not None else ""
    # The first name along the path that is not a directory, or a link to nothing: what blocks the way.
    blocker = next((p for p in reversed((path, *path.parents)) if os.path.lexists(p) and not p.is_dir()), None)
    code, fix = error.errno, "Choose another path (or move what is there aside) and run the command again."
    if blocker is not None and blocker != path and code in (errno.ENOTDIR, errno.ENOENT, errno.EEXIST):
        what = "a symbolic link to nothing" if not blocker.exists() else "a file"
        said = f"{blocker} is {what}, where a directory belongs, so {path} below it cannot be reached"
    elif os.path.islink(path) and not path.exists():
        said = f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
        fix = "Remove the link (or create what it points to) and run the command again."
    elif code == errno.ENOTDIR or (code == errno.EEXIST and path.exists() and not path.is_dir()):
        said = f"{path} is a file, where a directory belongs"
    elif code == errno.EISDIR or (code == errno.EEXIST and path.is_dir()):
        said = f"{path} is a directory, where a file belongs"
    elif code in (errno.EACCES, errno.EPERM):
        said = f"{path}{other}: permission denied"
        fix = "Give a path this user may read and write (or change its permissions) and run the command again."
    else:  # a read-only disk, a loop of links, ...: the system's words (a FIFO or device: nanopt.io refuses it)
        said = f"{path}{other}: {error.strerror or error}"
    return f"{said}. {fix}"


def debug_enabled() -> bool:
    """NANOPT_DEBUG=1 (or `--debug`, which the CLI turns into it): tracebacks instead of one-paragraph errors."""
    return os.environ.get("NANOPT_DEBUG", "") not in ("", "0")


def debug_traceback() -> None:
    """Under `--debug`: the handled error's traceback on stderr; the caller still prints and returns its status."""
    if debug_enabled():
        traceback.print_exc()
