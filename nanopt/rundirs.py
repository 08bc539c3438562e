"""THE run directory: every file name in it, what every command asks of one (is it a run, finished, its latest
figures and records), the runs below a directory; torch-free (the checkpoint format is checkpoint.py's, the lease
lock.py's). Its files may be damaged or being written: a reader gets a value, None, or ConfigError naming the
file, never a traceback. Appended files are never opened through a link, replaced ones are renamed over (nanopt.io).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from nanopt.errors import ConfigError
from nanopt.io import open_read
from nanopt.schema import Field, damaged, parse, problem, raw, read

CONFIG_FILE = "config.yaml"  # the resolved config of the newest session
SUMMARY_FILE = "summary.json"  # written when the run ends (finished, or stopped at its target)
METRICS_FILE = "metrics.jsonl"  # one object per logged step, trimmed back to the checkpoint on resume
# `nanopt eval`'s own file: the trainer owns metrics.jsonl (a resume trims it, and on a Modal Volume the
# trainer's commit of it would drop lines another container wrote), so evaluations there could be lost.
EVALS_FILE = "evals.jsonl"
PROFILE_FILE = "profile_summary.json"
CURVES_FILE = "curves.png"
TB_DIR = "tb"  # TensorBoard events and profiler traces
LOCK_FILE = "lock.json"  # the lease of the trainer writing it now
WATCH_LOCK_FILE = "watch.lock.json"  # `nanopt eval --watch`'s lease, beside the trainer's: one watcher per run


def is_lease(name: str) -> bool:
    """Whether a file name is a lease (the trainer's, a watcher's) or one a takeover moved aside: not run data."""
    return any(name == lease or name.startswith(f".{lease}.stale.") for lease in (LOCK_FILE, WATCH_LOCK_FILE))


CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"  # checkpoints/latest: the newest checkpoint's name, written after its rename
STEP_DIR = re.compile(r"^step_(\d{6,})$")
# The files of one checkpoint; COMPLETE, written last, is the manifest of the others' sizes and crc32s.
MODEL_FILE, RNG_FILE, STATE_FILE, COMPLETE_FILE = "model.safetensors", "rng.pt", "state.json", "COMPLETE"
EMA_FILE = "ema.safetensors"  # the averaged weights (train.ema_decay), when the run keeps them
# What a resume loads (every rank's DCP shards); DCP_METADATA is absent from a weights-only checkpoint (an average's).
DCP_DIR, DCP_METADATA = "dcp", "dcp/.metadata"
# The files a run appends to: a link at one of them is refused before the run writes anything.
APPENDED_FILES = (METRICS_FILE, EVALS_FILE)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 0.003}} -> {"train.lr": 0.003}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def format_value(value: Any) -> str:
    """A config value as an override would write it: muon, 0.003, true, null."""
    return value if isinstance(value, str) else json.dumps(value)


# ---------------------------------------------------------------- reading one run directory
# The shapes of the run's files (schema's): the summary's figures that reports do arithmetic on (null: an unreached
# target's), a config of sections of plain values, one object per line.
SUMMARY = Field(dict, what="a run summary (an object)", fields={
    "stopped_at_target": Field(bool, null=True),
    **{k: Field(int, null=True) for k in ("steps", "tokens_seen", "params", "world_size", "step_to_target",
                                          "tokens_to_target")},
    **{k: Field(float, null=True) for k in ("train_seconds", "train_seconds_to_target", "final_val_loss",
                                            "final_val_bpb", "best_val_loss", "test_loss", "test_bpb",
                                            "target_val_loss", "target_val_bpb")}})
FINISHED = Field(dict, what=SUMMARY.what, fields={**SUMMARY.fields, "steps": Field(int, required=True)})
SUMMARY_FIX = "The file is damaged: remove it and run the run's command again to finish it anew."


def _plain(value: Any) -> bool:
    return all(map(_plain, value)) if isinstance(value, list) else isinstance(value, (str, int, float, type(None)))


CONFIG = Field(dict, what="a run config (a mapping of sections)", fields={
    "train": Field(dict, required=True, fields={"max_steps": Field(int, required=True, lo=1),
                                                "stop_at_target": Field(bool)}),
    "mfu": Field(dict, fields={"warmup_steps": Field(int, lo=0)}),
}, items=Field(dict, what="a section (a mapping of keys)", items=Field(
    object, test=_plain, what="a string, number, true/false, null or a list of them (what a config key takes)")))
CONFIG_FIX = "The file is damaged: restore it, or remove the run directory."
RECORD = Field(dict, what="an object (one record per line)")
RECORD_FIX = "The file is damaged: remove or mend that line and run the command again."


def read_summary(run_dir: Path, shape: Field = SUMMARY) -> Optional[dict[str, Any]]:
    """summary.json as a dict, None when there is none yet; ConfigError naming it when it is damaged."""
    return read(Path(run_dir) / SUMMARY_FILE, shape, SUMMARY_FIX)


def read_config(run_dir: Path) -> Optional[dict[str, Any]]:
    """config.yaml as a nested dict, None when there is none; ConfigError naming it when it is damaged."""
    return read(Path(run_dir) / CONFIG_FILE, CONFIG, CONFIG_FIX)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file a run appends to; [] when there is none. A cut last line (being
    appended, or its writer killed) is left out; any other line that is no object is ConfigError naming it."""
    lines, out = (raw(path) or b"").rstrip().splitlines(), []  # rstrip: the last line is the last that is not blank
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record, why = parse(line, f"line {number}")
        if why is not None and number == len(lines):
            continue  # cut short: being appended, or its writer was killed
        if why := why or problem(record, RECORD, f"line {number}"):
            raise damaged(path, why, RECORD_FIX)
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
        run = is_run(Path(here))
        # Sorted in place: os.walk visits in path order and never enters what is removed (a run's own dirs).
        subdirs[:] = sorted(d for d in subdirs if not (d.startswith(".") or run and d in (CHECKPOINTS_DIR, TB_DIR)))
        found += [Path(here)] if run else []
    return found


def finished(run_dir: Path, max_steps: int, stop_at_target: bool) -> Optional[dict[str, Any]]:
    """The run's summary when its last session trained to `max_steps`, or stopped at its target with
    `stop_at_target` on; else None. The one rule for train (no training on), sweep, Modal and `eval --watch`."""
    summary = read_summary(run_dir, FINISHED)  # `stopped_at_target`: the clock saw its target and ended the run
    done = summary and (summary["steps"] >= max_steps or stop_at_target and summary.get("stopped_at_target"))
    return summary if done else None


def tail_lines(path: Path, nbytes: int) -> list[str]:
    """The lines of a file's last `nbytes` (the first may be cut); [] when it cannot be read (or is no file)."""
    try:
        with os.fdopen(open_read(path), "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - nbytes))
            return f.read().decode(errors="replace").splitlines()
    except (OSError, ConfigError):
        return []


def latest_figures(run_dir: Path) -> dict[str, Any]:
    """The newest train step and loss, and val loss, from the tail of metrics.jsonl ({} before the first log)."""
    out: dict[str, Any] = {}
    for line in reversed(tail_lines(Path(run_dir) / METRICS_FILE, 8192)):
        record = parse(line.encode())[0]  # None for the tail's first, cut line, or one being written
        if not isinstance(record, dict):
            continue
        if isinstance(record.get("loss"), (int, float)) and "loss" not in out:
            out.update(step=record.get("step"), loss=record["loss"])
        if isinstance(record.get("val_loss"), (int, float)):
            out.setdefault("val_loss", record["val_loss"])
    return out


# ---------------------------------------------------------------- checkpoint and evaluation names
def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:06d}"


def refuse_inside_checkpoints(out: Path, flag: str = "--out") -> None:
    """ConfigError when the output path `out` is (or is below) a step_NNNNNN or .tmp_ directory of a run's
    checkpoints/: the run replaces, prunes or removes it as its own, so what nanopt wrote there would be lost."""
    out = Path(out).resolve()  # a link into a run's checkpoints/ is inside them too
    for here in (out, *out.parents):
        if here.parent.name == CHECKPOINTS_DIR and (STEP_DIR.match(here.name) or here.name.startswith(".tmp_")):
            run = here.parent.parent
            raise ConfigError(f"{flag} {out} is inside {here}, a checkpoint of the run {run}, which the run "
                              f"replaces or deletes as its own (a later save of that step, or pruning by "
                              f"checkpoint.keep), so what is written there would be lost; write outside the run's "
                              f"{CHECKPOINTS_DIR}/, e.g. {flag} {run.parent / (run.name + '-out')}.")


def evaluation_key(record: dict[str, Any]) -> tuple:
    """What makes two evals.jsonl records one evaluation: who made it, of which weights (step, weights_crc32), and
    what was measured (a task with its limit and shots, or a split with its batches and precision)."""
    measured = record.get("task") or next((k for k in ("val_loss", "test_loss") if k in record), None)
    key = tuple(record.get(k) for k in ("source", "step", "weights_crc32", "limit", "num_fewshot", "eval_batches",
                                        "precision")) + (measured,)
    # A damaged line's list or object (unhashable) as its JSON text: it matches no evaluation, which is then made.
    return tuple(v if v is None or isinstance(v, (str, int, float)) else json.dumps(v, sort_keys=True) for v in key)


def recorded(run_dir: Path) -> set[tuple]:
    """The evaluations evals.jsonl holds (evaluation_key); a failure's record is none (the task may be retried)."""
    return {evaluation_key(r) for r in read_records(Path(run_dir) / EVALS_FILE) if "error" not in r}


