"""THE run directory: every file name in it, and the questions every command asks of one (is this a run, is
it finished, what are its latest figures, which checkpoints are complete), the writer's lock, and runs found
below a directory and grouped into settings whose members differ only in their seed.

Torch-free (layer 2), so `nanopt runs`, `compare`, `plot`, sweep and Modal's driver start in a fraction of a
second. Everything here reads files another process may be writing or that may be damaged: a reader gets a
value, None, or ConfigError naming the file, never a traceback. The layout (README "A run directory"):

  config.yaml            the resolved config of the newest session
  metrics.jsonl          one JSON object per logged step (trimmed back to the checkpoint on resume)
  evals.jsonl            `nanopt eval`'s results, appended
  summary.json           written when the run ends (finished, or stopped at its target)
  profile_summary.json   when the run was profiled
  tb/                    TensorBoard events and profiler traces
  checkpoints/step_NNNNNN/  {model.safetensors, optimizer.pt, rng.pt, state.json, COMPLETE}; checkpoints/latest
  lock.json              the lease of the trainer writing it now (absent when none is)
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

import yaml

from nanopt.errors import ConfigError
from nanopt.io import read_json, write_bytes

log = logging.getLogger("nanopt")

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
# Out-of-band results (`nanopt eval`) get their own file: the trainer owns metrics.jsonl (a resume trims it
# past the checkpoint's step, and on a Modal Volume the trainer's commit of it would drop lines written by
# another container), so evaluations appended there could be lost.
EVALS_FILE = "evals.jsonl"
PROFILE_FILE = "profile_summary.json"  # nanopt.profiling.SUMMARY_FILE (that module imports torch; a test ties them)
CURVES_FILE = "curves.png"
TB_DIR = "tb"
LOCK_FILE = "lock.json"
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
SEED_KEY = "run.seed"
# Keys that name or place a run, or act after its figures are taken, so runs differing only in them (and
# the seed) are repeats of one setting. Narrower than config.SAFE_KEYS (what a resume may change):
# train.max_steps, the targets, model.attention, train.compile, runtime.*, log.every and profile.* change
# the steps, the time or the loss that `nanopt runs` compares, so they split groups.
NEUTRAL_KEYS = {
    "run.name", "run.dir", "run.time_limit_s",  # a preempted run resumes to the same result
    "data.verify_checksum", "eval.test_at_end", "log.wandb_project",
}
# checkpoint.*: saving is outside the training clock; sample.*: after summary.json; prepare.*: `nanopt
# prepare` only; mfu.*: how MFU is reported, not how fast the run is.
NEUTRAL_SECTIONS = {"checkpoint", "sample", "prepare", "mfu"}
# Summary fields that split groups too: the same config on another machine or world size is another race.
HARDWARE_KEYS = ("hardware", "world_size")
MISSING = "<missing>"  # a key one run's config lacks (written by another nanopt version)


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


# ---------------------------------------------------------------- reading one run directory


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, ValueError) as e:  # ValueError: UnicodeDecodeError, a damaged byte
        raise ConfigError(f"{path} cannot be read: {e}. The file is damaged; restore it or remove it.") from None


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
        data = yaml.safe_load(_read_text(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path} is not valid YAML{at} ({getattr(e, 'problem', None) or 'unreadable'}); the file "
                          f"is damaged: restore it, or remove the run directory.") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ConfigError(f"{path} is not a run config (a YAML mapping of sections); the file is damaged.")
    return data


def is_run(path: Path) -> bool:
    """A directory a training run has written into (or is writing into)."""
    path = Path(path)
    return any((path / name).exists() for name in (CONFIG_FILE, SUMMARY_FILE, METRICS_FILE, CHECKPOINTS_DIR))


def finished(run_dir: Path, max_steps: int, stop_at_target: bool) -> Optional[dict[str, Any]]:
    """The run's summary when it is finished for a config with these values, else None. Finished: its last
    session trained to `max_steps`, or stopped at its speedrun target with `stop_at_target` on. The one rule
    for train (a re-run does not train on), sweep and Modal (skip the point) and `eval --watch` (stop)."""
    summary = read_summary(run_dir)
    if summary is None:
        return None
    steps = summary.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool):
        raise ConfigError(f"{Path(run_dir) / SUMMARY_FILE} has no integer `steps`; the file is damaged. Remove it "
                          f"and run the run's command again to finish it anew.")
    if steps >= max_steps:
        return summary
    # `stopped_at_target`: the run ended early because the clock saw its target (summaries written before
    # that field: a target step recorded means the same).
    if stop_at_target and summary.get("stopped_at_target", summary.get("step_to_target") is not None):
        return summary
    return None


def latest_figures(run_dir: Path) -> dict[str, Any]:
    """The newest train step and loss, and val loss, from the tail of metrics.jsonl ({} before the first log)."""
    try:
        with open(Path(run_dir) / METRICS_FILE, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {}
    out: dict[str, Any] = {}
    for line in reversed(lines):
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


def trim_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics.jsonl records past `step`: a resumed run logs them again. Only a resume from a checkpoint
    of `step` calls this (the lock held), so nothing a user did not ask to redo is dropped. A line that does
    not parse is kept (it is the user's to look at), except a cut last line, which the next append would join."""
    path = Path(run_dir) / METRICS_FILE
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
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and p.is_dir()]
    return sorted(found, key=lambda p: step_of(p))


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


def verify_checkpoint(ckpt: Path, step: Optional[int] = None) -> Optional[str]:
    """None when the checkpoint is whole, else why not: any damage (the marker itself included) makes it
    incomplete; this never raises. `step`: the step it must hold (default: the one its name says; a download
    being verified has a temporary name)."""
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
    """Verified checkpoints under a checkpoints/ directory, newest first, and a line for each one skipped
    (its name and why). Read-only: a damaged checkpoint stays where it is for the user to look at."""
    good, skipped = [], []
    for ckpt in reversed(checkpoint_dirs(root)):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            good.append(ckpt)
        else:
            skipped.append(f"{ckpt.name}: {problem}")
    return good, skipped


def newest_checkpoint(path: Path) -> tuple[Optional[Path], list[str]]:
    """The newest complete checkpoint of a run directory (or of a checkpoints/ directory), and what was
    skipped on the way (newest first)."""
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
            return "a process whose lock file cannot be read (being written, or damaged)"
        age = time.time() - self.heartbeat
        return (f"process {self.pid} on host {self.host} (started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}, "
                f"last heartbeat {age:.0f} s ago{', running ' + self.command if self.command else ''})")


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
    """One writer at a time for a run (or sweep) directory: a lease file, lock.json, holding the owner's host,
    pid and a heartbeat that a thread renews every `heartbeat_s` seconds.

    A lease rather than flock because the directory may live where flock means nothing across machines (a
    Modal Volume, NFS). A lease is taken over only when its holder is gone: on this host when its pid is
    dead (a `kill -9` is recovered at once), on another host when its heartbeat is older than `expires_s`.
    Taking over renames the stale file aside first, so of two processes racing for it exactly one wins.

    Where heartbeats reach other machines late (a Modal Volume shows them at each commit) the launcher sets
    LOCK_EXPIRES_ENV above that delay, and LOCK_OWNER_ENV to a job id its retries share, so a retried
    attempt takes over the lease its dead predecessor left at once while another job still waits.
    """

    def __init__(self, directory: Path, what: str = "run", expires_s: Optional[float] = None,
                 heartbeat_s: float = 15.0):
        self.dir, self.what = Path(directory), what
        self.path = self.dir / LOCK_FILE
        self.expires_s = expires_s if expires_s is not None else float(os.environ.get(LOCK_EXPIRES_ENV) or 120.0)
        self.heartbeat_s = heartbeat_s
        self.owner = os.environ.get(LOCK_OWNER_ENV, "")
        self.token = uuid.uuid4().hex
        self.started = time.time()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost: Optional[str] = None  # set by the heartbeat when another process took the lease

    # -- reading a lease

    def holder(self) -> Optional[Holder]:
        """The lease's holder; None when there is no lease; a Holder with token "" when it is unreadable."""
        try:
            data = json.loads(self.path.read_bytes())
            return Holder(**{k: data[k] for k in ("host", "pid", "started", "heartbeat", "token")},
                          command=str(data.get("command", "")), owner=str(data.get("owner", "")))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError):
            # Half written (a crash between create and write) or damaged: as old as the file itself.
            try:
                mtime = self.path.stat().st_mtime
            except FileNotFoundError:
                return None
            return Holder("?", -1, mtime, mtime, "")

    def _expired(self, h: Holder) -> bool:
        if self.owner and h.owner == self.owner:  # an earlier attempt of this same job: its scheduler ended it
            return True
        if h.host == socket.gethostname() and h.pid > 0:
            return not _pid_alive(h.pid)
        return time.time() - h.heartbeat > self.expires_s

    # -- taking and keeping it

    def _record(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": self.started,
                           "heartbeat": time.time(), "token": self.token, "owner": self.owner,
                           "command": " ".join(sys.argv)[:300]}).encode()

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, self._record())
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def _take_over(self, stale: Holder) -> None:
        """Move a stale lease aside, if it is still the one we judged stale (another process may have taken it
        over and written its own meanwhile: that one is put back)."""
        aside = self.dir / f".{LOCK_FILE}.stale.{self.token}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = DirLock(self.dir)
        moved.path = aside
        now = moved.holder()
        if now is not None and now.token != stale.token:
            try:
                os.link(aside, self.path)  # not os.rename: never over a lease created since
            except FileExistsError:
                pass
        aside.unlink(missing_ok=True)

    def acquire(self) -> "DirLock":
        """Take the lease or raise ConfigError naming who holds it."""
        flag = "`run.dir`" if self.what == "run" else "--dir"
        if self.dir.exists() and not self.dir.is_dir():
            raise ConfigError(f"the {self.what} directory {self.dir} is a file; set {flag} to a directory (or remove "
                              f"the file).")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file in the way, no permission, a read-only mount
            raise ConfigError(f"cannot create the {self.what} directory {self.dir} ({e.strerror or e}); give a writable "
                              f"directory ({flag}).") from None
        for _ in range(5):
            try:
                created = self._create()
            except OSError as e:
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
                raise ConfigError(self._busy(held))
            self._take_over(held)
        raise ConfigError(f"could not take the lock {self.path}: other processes keep taking it. Make sure one "
                          f"process at a time writes {self.dir}.")

    def _busy(self, h: Holder) -> str:
        return (f"the {self.what} directory {self.dir} is in use by {h.describe()}; {self.path} says so, and one "
                f"writer at a time keeps its files whole. Wait for that process to end, stop it, or use another "
                f"directory. If that process is gone for good (its machine is lost), the lock expires "
                f"{self.expires_s:.0f} s after its last heartbeat, or delete {self.path} yourself.")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            held = self.holder()
            if held is None or held.token != self.token:
                self.lost = f"{self.path} was taken over by {held.describe() if held else 'nobody (it was deleted)'}"
                log.error("lost the lock of %s: %s; another process may now write it too", self.dir, self.lost)
                return
            try:
                write_bytes(self.path, self._record())
            except OSError:
                pass  # a missed heartbeat is not fatal; the lease expires only after several

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            held = self.holder()
            if held is not None and held.token == self.token:
                self.path.unlink(missing_ok=True)

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# ---------------------------------------------------------------- finished runs, found and grouped

# A run's own subdirectories: what is below them belongs to the run, never another run.
RUN_INTERNAL_DIRS = (CHECKPOINTS_DIR, TB_DIR)
# summary.json figures that reports format or do arithmetic on, by the type the trainer writes (null allowed:
# an unreached target's figures are null). Anything else in a summary is shown as it is, or filtered by type.
SUMMARY_INTEGERS = ("steps", "tokens_seen", "params", "world_size", "step_to_target", "tokens_to_target")
SUMMARY_NUMBERS = ("train_seconds", "train_seconds_to_target", "final_val_loss", "final_val_bpb", "best_val_loss",
                   "test_loss", "test_bpb", "target_val_loss", "target_val_bpb")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    kinds = {list: "an array", str: "a string", int: "a number", float: "a number"}
    return kinds.get(type(value), "not an object")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file a run appends to (metrics.jsonl, evals.jsonl); [] when there is
    none. Only the last line may be cut (a writer is appending it, or was killed while it did): it is left
    out. Any other line that is not a JSON object in UTF-8 is damage: ConfigError naming the file and line,
    never a record quietly dropped from a figure."""
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
            raise ConfigError(f"{path}: line {number} is {_json_kind(record)}, not an object (one record per line); "
                              f"the file is damaged. Remove or mend that line and run the command again.")
        out.append(record)
    return out


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records (read_records)."""
    return read_records(Path(run_dir) / METRICS_FILE)


def _profile_problem(profile: Any) -> Optional[str]:
    """Why a profile summary is not what the profiler writes (the entries `compare` computes with), or None."""
    if not isinstance(profile, dict):
        return "it is not a JSON object"
    if not _is_number(profile.get("step_ms_mean")):
        return f"`step_ms_mean` is {profile.get('step_ms_mean')!r}, not a number"
    if not _is_int(profile.get("profiled_steps")):
        return f"`profiled_steps` is {profile.get('profiled_steps')!r}, not an integer"
    for key in ("first_step", "last_step"):
        if profile.get(key) is not None and not _is_int(profile[key]):
            return f"`{key}` is {profile[key]!r}, not an integer"
    labels = profile.get("label_ms", {})
    if not isinstance(labels, dict) or not all(_is_number(v) for v in labels.values()):
        return "`label_ms` is not an object of numbers"
    ops = profile.get("top_ops", [])
    if not isinstance(ops, list):
        return "`top_ops` is not a list"
    for i, op in enumerate(ops):
        if not (isinstance(op, dict) and isinstance(op.get("name"), str)
                and all(_is_number(op.get(k)) for k in ("calls", "self_ms"))):
            return f"`top_ops[{i}]` is not an object with a string `name` and numbers `calls` and `self_ms`"
    return None


def read_profile(run_dir: Path) -> Optional[dict[str, Any]]:
    """profile_summary.json, None when the run was not profiled; ConfigError naming it when it is damaged."""
    path = Path(run_dir) / PROFILE_FILE
    if not path.is_file():
        return None
    profile = read_json(path)
    problem = _profile_problem(profile)
    if problem:
        raise ConfigError(f"{path} is not a profile summary as the profiler writes it: {problem}. The file is "
                          f"damaged; remove it (the run's other figures stay usable) or profile the run again.")
    return profile


def _summary_problem(summary: dict[str, Any]) -> Optional[str]:
    for key in SUMMARY_INTEGERS:
        if summary.get(key) is not None and not _is_int(summary[key]):
            return f"`{key}` is {summary[key]!r}, not an integer"
    for key in SUMMARY_NUMBERS:
        if summary.get(key) is not None and not _is_number(summary[key]):
            return f"`{key}` is {summary[key]!r}, not a number"
    return None


def _plain(value: Any) -> bool:
    """A value a nanopt config holds: a string, number, boolean, null, or a list of them (YAML can also give
    dates and binary, which no config key takes)."""
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


@dataclass
class FinishedRun:
    """One finished run directory (it has its summary.json). `records` (metrics.jsonl) and `profile`
    (profile_summary.json) are read on first use, so listing many runs reads neither, and a damaged one
    stops only a command that needs it."""

    dir: Path
    config: dict[str, Any]  # flattened: {"optim.name": "muon", ...}; {} when config.yaml is missing
    summary: dict[str, Any]
    name: str = ""  # how reports call it: the path below the directory searched

    @cached_property
    def records(self) -> list[dict[str, Any]]:
        return read_metrics(self.dir)

    @cached_property
    def profile(self) -> Optional[dict[str, Any]]:
        return read_profile(self.dir)

    @property
    def seed(self) -> Any:
        return self.config.get(SEED_KEY)

    def setting(self) -> tuple[tuple[str, str], ...]:
        """What the run computes, as sorted (key, value) pairs: the config without the seed and the neutral
        keys, plus the hardware. Runs with the same setting are seeds of one experiment."""
        if not self.config:  # no config.yaml: nothing to match on, so the run stands alone
            return (("run.dir", str(self.dir)),)
        items = {k: v for k, v in self.config.items()
                 if k != SEED_KEY and k not in NEUTRAL_KEYS and k.split(".")[0] not in NEUTRAL_SECTIONS}
        items.update({k: self.summary.get(k) for k in HARDWARE_KEYS})
        return tuple(sorted((k, format_value(v)) for k, v in items.items()))


def load_run(path: Path, name: str = "") -> FinishedRun:
    """The finished run in `path`; ConfigError saying what is missing or damaged and what to give instead."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory. Give a run directory (runs/<name>, the one holding "
                          f"{CONFIG_FILE} and {SUMMARY_FILE}).")
    if not is_run(path):
        raise ConfigError(f"{path} is not a run directory: it holds none of {CONFIG_FILE}, {SUMMARY_FILE}, "
                          f"{METRICS_FILE}, {CHECKPOINTS_DIR}/. Give a run directory (runs/<name>); "
                          f"`nanopt runs {path}` lists the runs below it.")
    summary = read_summary(path)
    if summary is None:
        raise ConfigError(f"{path} has no {SUMMARY_FILE}: the run has not finished (a run writes it when it "
                          f"ends). Wait for it, resume it with the same command, or give a finished run.")
    problem = _summary_problem(summary)
    if problem:
        raise ConfigError(f"{path / SUMMARY_FILE}: {problem}; the file is damaged. Remove it and run the run's "
                          f"command again to finish it anew.")
    config = flatten(read_config(path) or {})
    odd = next((k for k, v in config.items() if not _plain(v)), None)
    if odd is not None:
        raise ConfigError(f"{path / CONFIG_FILE}: `{odd}` is {config[odd]!r}, which no config key takes (a string, "
                          f"number, true/false, null or a list of them); the file is damaged.")
    return FinishedRun(path, config, summary, name or path.name)


def walk_runs(root: Path) -> list[Path]:
    """Every run directory at or below `root`, in path order. A run below a run is found too (a directory
    that is a run may also hold a sweep); a run's own checkpoints/ and tb/, and hidden directories, are not
    searched. The one walker: `nanopt runs` and `nanopt plot` both find runs with it."""
    found = []
    for here, subdirs, _ in os.walk(root):
        path = Path(here)
        run = is_run(path)
        # Sorted in place: os.walk then visits in path order, and never enters what is removed here.
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and not (run and d in RUN_INTERNAL_DIRS))
        if run:
            found.append(path)
    return found


def find_runs(root: Path) -> tuple[list[FinishedRun], list[str]]:
    """Every finished run at or below `root` (a sweep's are in root/<sweep>/<point>/), sorted by path, and a
    line for each run directory that was left out (unfinished, or a file of it damaged: the line names it)."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory; give the directory that holds the runs (default runs/) "
                          f"or a sweep's directory (runs/<sweep>).")
    runs, skipped = [], []
    for path in walk_runs(root):
        name = path.relative_to(root).as_posix() if path != root else path.name
        if not (path / SUMMARY_FILE).is_file():
            skipped.append(f"{path}: not finished (no {SUMMARY_FILE})")
            continue
        try:
            runs.append(load_run(path, name))
        except ConfigError as e:
            skipped.append(str(e))
    return runs, skipped


@dataclass
class Repeat:
    """A run with the setting and seed of an earlier one (a sweep copied, or run twice): it measures
    nothing new, so statistics count the pair once."""

    run: FinishedRun  # left out
    first: FinishedRun  # counted

    def describe(self) -> str:
        return (f"{self.run.dir} repeats {self.first.dir} (the same setting and {SEED_KEY}="
                f"{format_value(self.run.seed)}): counted once, as {self.first.name}")


def split_repeats(runs: list[FinishedRun]) -> tuple[list[FinishedRun], list[Repeat]]:
    """The runs with each (setting, seed) once, the first in the given (path) order kept, and the repeats.
    Two copies of one run are one sample, not two independent seeds: counted twice they would halve the
    standard error and make any difference look significant."""
    first: dict[tuple, FinishedRun] = {}
    kept, repeats = [], []
    for run in runs:
        key = (run.setting(), format_value(run.seed))
        if key in first:
            repeats.append(Repeat(run, first[key]))
        else:
            first[key] = run
            kept.append(run)
    return kept, repeats


@dataclass
class Group:
    """Runs with one setting, each seed once; `name` is the keys that vary between the groups found together."""

    name: str
    runs: list[FinishedRun] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)  # the varying keys' values, as in the name
    repeats: list[Repeat] = field(default_factory=list)  # runs left out as repeats of one in `runs`

    @property
    def seeds(self) -> list[Any]:
        return [r.seed for r in self.runs]


def group_runs(runs: list[FinishedRun]) -> list[Group]:
    """Runs grouped by setting, in order of first appearance, repeats of a (setting, seed) counted once (each
    group lists its own). Each group is named by the keys whose value differs between groups
    (`optim.name=muon`), or `all` when every run has the same setting."""
    kept, repeats = split_repeats(runs)
    by_setting: dict[tuple, list[FinishedRun]] = {}
    for run in kept:
        by_setting.setdefault(run.setting(), []).append(run)
    settings = [dict(s) for s in by_setting]
    keys = [k for k in dict.fromkeys(k for s in settings for k in s)
            if len({s.get(k, MISSING) for s in settings}) > 1]
    # Config keys in the config's order (run, model, data, train, optim, ...), as the first run wrote them.
    order = {k: i for i, k in enumerate(dict.fromkeys(k for r in kept for k in r.config))}
    keys.sort(key=lambda k: order.get(k, len(order)))
    groups = []
    for setting, members in zip(by_setting, by_setting.values()):
        values = {k: dict(setting).get(k, MISSING) for k in keys}
        own = [r for r in repeats if r.first.setting() == setting]
        groups.append(Group(",".join(f"{k}={v}" for k, v in values.items()) or "all", members, values, own))
    return groups
