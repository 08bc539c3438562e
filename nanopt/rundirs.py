"""THE run directory: every file name in it, what every command asks of one (is it a run, finished, its
latest figures and records, its complete checkpoints), the runs below a directory, and the writer's lock.
Torch-free. Its files may be being written or damaged: a reader gets a value, None, or ConfigError naming the
file, never a traceback. The layout:

  config.yaml            the resolved config of the newest session
  metrics.jsonl          one JSON object per logged step (trimmed back to the checkpoint on resume)
  evals.jsonl            `nanopt eval`'s results, appended
  summary.json           written when the run ends (finished, or stopped at its target)
  profile_summary.json   when the run was profiled
  tb/                    TensorBoard events and profiler traces
  checkpoints/step_NNNNNN/  {model.safetensors, optimizer.pt, rng.pt, state.json, COMPLETE}; checkpoints/latest
  lock.json              the lease of the trainer writing it now (absent when none is)

Its files are the run's own: the appended ones (APPENDED_FILES, the lease) are opened so that a symbolic link is never
followed (a link there is ConfigError naming it), and the replaced ones are written to a new temp file and renamed
over the name, which replaces a link rather than writing its target (nanopt.io).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import socket
import sys
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from nanopt.errors import ConfigError
from nanopt.io import disk_full, is_disk_full, open_own, read_json, refuse_link, write_bytes

log = logging.getLogger("nanopt")

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
# `nanopt eval`'s own file: the trainer owns metrics.jsonl (a resume trims it, and on a Modal Volume the
# trainer's commit of it would drop lines another container wrote), so evaluations there could be lost.
EVALS_FILE = "evals.jsonl"
PROFILE_FILE = "profile_summary.json"  # nanopt.profiling.SUMMARY_FILE (that module imports torch; a test ties them)
CURVES_FILE = "curves.png"
TB_DIR = "tb"
LOCK_FILE = "lock.json"
WATCH_LOCK_FILE = "watch.lock.json"  # `nanopt eval --watch`'s lease, beside the trainer's: one watcher per run


def is_lease(name: str) -> bool:
    """Whether a file name is a lease (the trainer's, a watcher's) or one a takeover moved aside: not run data."""
    return name in (LOCK_FILE, WATCH_LOCK_FILE) or name.startswith((f".{LOCK_FILE}.stale.",
                                                                     f".{WATCH_LOCK_FILE}.stale."))
LOCK_OWNER_ENV = "NANOPT_LOCK_OWNER"
LOCK_EXPIRES_ENV = "NANOPT_LOCK_EXPIRES_S"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"  # checkpoints/latest: the newest checkpoint's name, written after its rename
STEP_DIR = re.compile(r"^step_(\d{6,})$")
# The files of one checkpoint; COMPLETE, written last, is the manifest of the others' sizes and crc32s.
MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE, COMPLETE_FILE = (
    "model.safetensors", "optimizer.pt", "rng.pt", "state.json", "COMPLETE")
CHECKPOINT_FILES = (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE)
# What every checkpoint's manifest must list; optimizer.pt is absent from a weights-only one (resume refuses it).
REQUIRED_FILES = (MODEL_FILE, RNG_FILE, STATE_FILE)
# The files a run appends to: a link at one of them is refused before the run writes anything.
APPENDED_FILES = (METRICS_FILE, EVALS_FILE)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 0.003}} -> {"train.lr": 0.003}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def format_value(value: Any) -> str:
    """A config value as an override would write it: muon, 0.003, true, null."""
    return value if isinstance(value, str) else json.dumps(value)


# What a value read from a run's JSON files is (JSON's true and false are Python ints too).
def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite(value: Any) -> Optional[float]:
    """A finite number as a float, else None (a figure may be null, or damaged)."""
    return float(value) if is_number(value) and math.isfinite(value) else None


# ---------------------------------------------------------------- reading one run directory
def read_summary(run_dir: Path) -> Optional[dict[str, Any]]:
    """summary.json as a dict, None when there is none yet; ConfigError naming it when it is damaged."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        return None
    summary = read_json(path)
    if not isinstance(summary, dict):
        raise ConfigError(f"{path} is not a run summary (a JSON object); the file is damaged. Remove it and run "
                          f"the run's command again to finish it anew.")
    return summary


def read_config(run_dir: Path) -> Optional[dict[str, Any]]:
    """config.yaml as a nested dict, None when there is none; ConfigError naming it when it is damaged."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: UnicodeDecodeError, a damaged byte
        raise ConfigError(f"{path} cannot be read: {e}. The file is damaged; restore it or remove it.") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path} is not valid YAML{at} ({getattr(e, 'problem', None) or 'unreadable'}); the file "
                          f"is damaged: restore it, or remove the run directory.") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ConfigError(f"{path} is not a run config (a YAML mapping of sections); the file is damaged.")
    return data


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file a run appends to (metrics.jsonl, evals.jsonl); [] when there is
    none. A cut last line (being appended, or its writer killed) is left out; any other line that is not a JSON
    object is damage: ConfigError naming the file and line, never a record quietly dropped from a figure."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({e.strerror or e}).") from None
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))  # bytes to json.loads would also take UTF-16 and -32
        except ValueError as e:  # UnicodeDecodeError or JSONDecodeError
            if number == last:
                continue
            what = "is not UTF-8 text" if isinstance(e, UnicodeDecodeError) else "is not JSON"
            raise ConfigError(f"{path}: line {number} {what}; the file is damaged. Remove or mend that line "
                              f"and run the command again.") from None
        if not isinstance(record, dict):
            kind = {list: "an array", str: "a string", int: "a number", float: "a number"}.get(type(record))
            raise ConfigError(f"{path}: line {number} is {kind or json.dumps(record)}, not an object (one record per "
                              f"line); the file is damaged. Remove or mend that line and run the command again.")
        out.append(record)
    return out


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records (read_records)."""
    return read_records(Path(run_dir) / METRICS_FILE)


def is_run(path: Path) -> bool:
    """A directory a training run has written into (or is writing into)."""
    path = Path(path)
    return any((path / name).exists() for name in (CONFIG_FILE, SUMMARY_FILE, METRICS_FILE, CHECKPOINTS_DIR))


def walk_runs(root: Path) -> list[Path]:
    """Every run directory at or below `root` (a run may hold a sweep), in path order; hidden ones left out."""
    found = []
    for here, subdirs, _ in os.walk(root):
        path = Path(here)
        run = is_run(path)
        # Sorted in place: os.walk then visits in path order, and never enters what is removed here. Below a
        # run's own checkpoints/ and tb/ is the run's, never another run.
        own = (CHECKPOINTS_DIR, TB_DIR) if run else ()
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and d not in own)
        if run:
            found.append(path)
    return found


def finished(run_dir: Path, max_steps: int, stop_at_target: bool) -> Optional[dict[str, Any]]:
    """The run's summary when its last session trained to `max_steps`, or stopped at its target with
    `stop_at_target` on; else None. The one rule for train (no training on), sweep, Modal and `eval --watch`."""
    summary = read_summary(run_dir)
    if summary is None:
        return None
    steps = summary.get("steps")
    if not is_int(steps):
        raise ConfigError(f"{Path(run_dir) / SUMMARY_FILE} has no integer `steps`; the file is damaged. Remove it "
                          f"and run the run's command again to finish it anew.")
    if steps >= max_steps:
        return summary
    # `stopped_at_target`: the run ended early because the clock saw its target.
    if stop_at_target and summary.get("stopped_at_target"):
        return summary
    return None


def tail_lines(path: Path, nbytes: int) -> list[str]:
    """The lines of a file's last `nbytes` (the first may be cut); [] when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - nbytes))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def latest_figures(run_dir: Path) -> dict[str, Any]:
    """The newest train step and loss, and val loss, from the tail of metrics.jsonl ({} before the first log)."""
    out: dict[str, Any] = {}
    for line in reversed(tail_lines(Path(run_dir) / METRICS_FILE, 8192)):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # the first, cut line of the tail, or one being written
        if not isinstance(record, dict):
            continue
        if isinstance(record.get("loss"), (int, float)) and "loss" not in out:
            out.update(step=record.get("step"), loss=record["loss"])
        if isinstance(record.get("val_loss"), (int, float)) and "val_loss" not in out:
            out["val_loss"] = record["val_loss"]
        if "loss" in out and "val_loss" in out:
            break
    return out


def refuse_links(run_dir: Path, names: tuple[str, ...] = APPENDED_FILES) -> None:
    """ConfigError naming the first of the run's files `names` that is a symbolic link (checked before any write)."""
    for name in names:
        refuse_link(Path(run_dir) / name)


def trim_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics.jsonl records past `step`, which a run resumed from that checkpoint logs again (the lock
    held). A line that does not parse is kept for the user, except a cut last line the next append would join."""
    path = Path(run_dir) / METRICS_FILE
    refuse_link(path)  # else a user's file it points to would be read, and its lines copied into the run
    if not path.is_file():
        return
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line.decode("utf-8"))
        except ValueError:
            if number < len(lines):
                kept.append(line)
            continue
        record_step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(record_step, int) or record_step <= step:
            kept.append(line)
    write_bytes(path, b"".join(line + b"\n" for line in kept))


# ---------------------------------------------------------------- checkpoints
def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:06d}"


def step_of(ckpt: Path) -> Optional[int]:
    """step_000042 -> 42; None for any other name."""
    match = STEP_DIR.match(Path(ckpt).name)
    return int(match.group(1)) if match else None


def checkpoint_dirs(root: Path) -> list[Path]:
    """The step_NNNNNN directories under a checkpoints/ directory, oldest first, whole or not."""
    root = Path(root)
    found = [p for p in root.iterdir() if step_of(p) is not None and p.is_dir()] if root.is_dir() else []
    return sorted(found, key=step_of)


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def read_state(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's state.json; ConfigError naming it when it is not a JSON object with an integer step."""
    state = read_json(Path(ckpt) / STATE_FILE)
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ConfigError(f"{Path(ckpt) / STATE_FILE} is not a checkpoint state (a JSON object with an integer "
                          f"`step`); the checkpoint is damaged: use an earlier one.")
    return state


def _manifest_problem(ckpt: Path) -> tuple[Optional[str], dict[str, Any]]:
    """(why COMPLETE is not a usable manifest, its file entries)."""
    marker = ckpt / COMPLETE_FILE
    if not marker.is_file():
        return "it has no COMPLETE marker (its write was interrupted)", {}
    try:
        manifest = json.loads(marker.read_bytes())
    except (OSError, ValueError) as e:
        return f"its COMPLETE manifest cannot be read ({e.__class__.__name__})", {}
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return "its COMPLETE manifest is not a JSON object with a `files` map", {}
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
        return f"its COMPLETE manifest does not list {', '.join(missing)}", {}
    for name, entry in files.items():
        if name not in CHECKPOINT_FILES:
            return f"its COMPLETE manifest lists {name!r}, which is no checkpoint file", {}
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), int) for k in ("bytes", "crc32")):
            return f"its COMPLETE manifest's entry for {name} has no integer bytes and crc32", {}
    return None, files


def weights_crc32(ckpt: Optional[Path]) -> Optional[int]:
    """Which weights a checkpoint holds: its model file's crc32 as its COMPLETE manifest lists it (loading has
    checked the file against it); None for a Hugging Face directory, a live model or an unusable manifest."""
    if ckpt is None:
        return None
    problem, files = _manifest_problem(Path(ckpt))
    return None if problem else files[MODEL_FILE]["crc32"]


def evaluation_key(record: dict[str, Any]) -> tuple:
    """What makes two evals.jsonl records one evaluation: who made it, of which weights (step, and the checkpoint's
    weights_crc32 where known), and what was measured: a task with its limit and shots, or a split with its
    batches and precision. A record without a field has None there."""
    measured = record.get("task") or next((k for k in ("val_loss", "test_loss") if k in record), None)
    return tuple(record.get(k) for k in ("source", "step", "weights_crc32", "limit", "num_fewshot", "eval_batches",
                                         "precision")) + (measured,)


def recorded(run_dir: Path) -> set[tuple]:
    """The evaluations evals.jsonl holds (evaluation_key); a failure's record is none (the task may be retried)."""
    return {evaluation_key(r) for r in read_records(Path(run_dir) / EVALS_FILE) if "error" not in r}


def verify_checkpoint(ckpt: Path, step: Optional[int] = None) -> Optional[str]:
    """None when the checkpoint is whole, else why not (never raises). `step`: the step it must hold (default:
    the one its name says; a download being verified has a temporary name)."""
    ckpt = Path(ckpt)
    step = step_of(ckpt) if step is None else step
    if step is None or not ckpt.is_dir():
        return "it is not a step_NNNNNN directory"
    problem, files = _manifest_problem(ckpt)
    if problem:
        return problem
    try:
        for name, expected in files.items():
            path = ckpt / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != expected["bytes"]:
                return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
            if crc32_of(path) != expected["crc32"]:
                return f"{name} fails its crc32 checksum (the file is corrupt)"
        state = read_state(ckpt)
    except OSError as e:
        return f"it cannot be read ({e})"
    except ConfigError:
        return "its state.json is not a JSON object with an integer step"
    if state["step"] != step:
        return f"its state.json says step {state['step']}, its name step {step}"
    return None


def usable_checkpoints(root: Path) -> tuple[list[Path], list[str]]:
    """Verified checkpoints under a checkpoints/ directory, newest first, and "name: why" for each one skipped."""
    good, skipped = [], []
    for ckpt in reversed(checkpoint_dirs(root)):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            good.append(ckpt)
        else:
            skipped.append(f"{ckpt.name}: {problem}")
    return good, skipped


def newest_checkpoint(path: Path) -> tuple[Optional[Path], list[str]]:
    """The newest complete checkpoint of a run (or checkpoints/) directory, and what was skipped."""
    path = Path(path)
    root = checkpoints_dir(path) if (path / CHECKPOINTS_DIR).is_dir() else path
    good, skipped = usable_checkpoints(root)
    return (good[0] if good else None), skipped


# ---------------------------------------------------------------- one writer at a time
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


def _cut_holder(data: bytes, mtime: float) -> Holder:
    """What an unreadable lease still tells (a write cut short keeps its first fields, host and pid): its holder,
    token "", as old as the file itself."""
    host = re.search(rb'"host": "([^"\\]*)"', data)
    pid = re.search(rb'"pid": (\d{1,10})[,}]', data)
    return Holder(host.group(1).decode(errors="replace") if host else "?", int(pid.group(1)) if pid else -1,
                  mtime, mtime, "")


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
    """One writer at a time for a run (or sweep) directory: a lease file with the owner's host, pid and a
    heartbeat a thread renews every `heartbeat_s` seconds (flock means nothing across machines: a Modal Volume,
    NFS). It is taken over only when its holder is gone: on this host when its pid is dead (a `kill -9` is
    recovered at once), elsewhere when its heartbeat is older than `expires_s`. Taking over renames the stale
    file aside first, so of two racing processes exactly one wins. Where heartbeats arrive late (a Modal Volume
    shows them at each commit) the launcher sets LOCK_EXPIRES_ENV above that delay, and LOCK_OWNER_ENV to a job
    id its retries share, so a retry takes over its dead predecessor's lease at once."""

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
        ConfigError when it is a symbolic link (never read, or replaced, through one)."""
        path = path or self.path
        data = b""
        try:
            fd = open_own(path, os.O_RDONLY)
            try:
                data = os.read(fd, 1 << 16)
            finally:
                os.close(fd)
            record = json.loads(data)
            return Holder(**{k: record[k] for k in ("host", "pid", "started", "heartbeat", "token")},
                          command=str(record.get("command", "")), owner=str(record.get("owner", "")))
        except FileNotFoundError:
            return None
        except ConfigError:  # a link (ConfigError is a ValueError too): never taken for a damaged lease
            raise
        except (OSError, ValueError, TypeError, KeyError):
            # Cut short (a crash or a full disk between create and write), or damaged: as old as the file itself.
            try:
                mtime = path.stat().st_mtime
            except FileNotFoundError:
                return None
            return _cut_holder(data, mtime)

    def _expired(self, h: Holder) -> bool:
        """Stale: an earlier attempt of this job; on this host, a dead pid; a live pid's readable lease never; else
        (another host, or an unreadable lease whose pid is unknown or alive) a heartbeat older than expires_s."""
        if self.owner and h.owner == self.owner:  # an earlier attempt of this same job: its scheduler ended it
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
            record = self._record()
            written = 0
            while written < len(record):
                written += os.write(fd, record[written:])
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)  # ours: created above with O_EXCL
            raise
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
        flag = self.setting
        if self.dir.exists() and not self.dir.is_dir():
            raise ConfigError(f"the {self.what} directory {self.dir} is a file; set {flag} to a directory (or remove "
                              f"the file).")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file in the way, no permission, a read-only mount, a full disk
            if is_disk_full(e):
                raise disk_full(self.dir) from None
            raise ConfigError(f"cannot create the {self.what} directory {self.dir} ({e.strerror or e}); give a "
                              f"writable directory ({flag}).") from None
        for _ in range(5):
            try:
                created = self._create()
            except OSError as e:
                if is_disk_full(e):
                    raise disk_full(self.path) from None
                raise ConfigError(f"cannot write the lock {self.path} ({e.strerror or e}); the {self.what} directory "
                                  f"must be writable.") from None
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
                held = self.holder()
                if held is not None and held.token == self.token:
                    self.path.unlink(missing_ok=True)

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

