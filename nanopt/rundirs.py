"""Reading run directories: one run (config, summary, metrics, profile summary), every run below a directory,
and runs grouped into settings whose members differ only in their seed.

Torch-free and imported by `nanopt runs` / `nanopt compare`, so both start in a fraction of a second. A run
directory is what training writes (README "A run directory"): config.yaml (the resolved config),
metrics.jsonl, summary.json when the run has ended, profile_summary.json when it was profiled.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

import yaml

from nanopt.errors import ConfigError
from nanopt.io import read_json

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
PROFILE_FILE = "profile_summary.json"  # nanopt.profiling.SUMMARY_FILE (that module imports torch; a test ties them)

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


@dataclass
class Run:
    """One finished run directory; `records` (metrics.jsonl) is read on first use."""

    dir: Path
    config: dict[str, Any]  # flattened: {"optim.name": "muon", ...}; {} when config.yaml is missing
    summary: dict[str, Any]
    profile: Optional[dict[str, Any]] = None
    name: str = ""  # how reports call it: the path below the directory searched

    @cached_property
    def records(self) -> list[dict[str, Any]]:
        path = self.dir / METRICS_FILE
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        out = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                # The last line of a killed run may be half written; anything earlier is damage.
                if number < len(lines):
                    raise ConfigError(f"{path}: line {number} is not JSON; the metrics file is damaged.") from None
        return out

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


def _read_summary(path: Path) -> dict[str, Any]:
    summary = read_json(path)
    if not isinstance(summary, dict):
        raise ConfigError(f"{path} is not a run summary (a JSON object); the file is damaged.")
    return summary


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path} cannot be read as YAML: {e}.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a run config (a YAML mapping); the file is damaged.")
    return flatten(data)


def is_run_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() or (path / SUMMARY_FILE).is_file()


def load_run(path: Path, name: str = "") -> Run:
    """The finished run in `path`; ConfigError saying what is missing and what to give instead."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory. Give a run directory (runs/<name>, the one holding "
                          f"config.yaml and summary.json).")
    if not is_run_dir(path):
        raise ConfigError(f"{path} is not a run directory: it holds neither {CONFIG_FILE} nor {SUMMARY_FILE}. "
                          f"Give a run directory (runs/<name>); `nanopt runs {path}` lists the runs below it.")
    if not (path / SUMMARY_FILE).is_file():
        raise ConfigError(f"{path} has no {SUMMARY_FILE}: the run has not finished (a run writes it when it "
                          f"ends). Wait for it, resume it with the same command, or give a finished run.")
    config = _read_config(path / CONFIG_FILE) if (path / CONFIG_FILE).is_file() else {}
    profile = read_json(path / PROFILE_FILE) if (path / PROFILE_FILE).is_file() else None
    return Run(path, config, _read_summary(path / SUMMARY_FILE), profile, name or path.name)


def find_runs(root: Path) -> tuple[list[Run], list[str]]:
    """Every finished run at or below `root` (a sweep's are in root/<sweep>/<point>/), sorted by path, and a
    line for each run directory that was left out (unfinished or unreadable). A run's own subdirectories
    (checkpoints/, tb/) are not searched."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory; give the directory that holds the runs (default runs/) "
                          f"or a sweep's directory (runs/<sweep>).")
    runs, skipped = [], []
    for here, subdirs, _ in os.walk(root):
        path = Path(here)
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        if not is_run_dir(path):
            continue
        subdirs[:] = []
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
class Group:
    """Runs with one setting; `name` is the keys that vary between the groups found together."""

    name: str
    runs: list[Run] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)  # the varying keys' values, as in the name

    @property
    def seeds(self) -> list[Any]:
        return [r.seed for r in self.runs]


def group_runs(runs: list[Run]) -> list[Group]:
    """Runs grouped by setting, in order of first appearance. Each group is named by the keys whose value
    differs between groups (`optim.name=muon`), or `all` when every run has the same setting."""
    by_setting: dict[tuple, list[Run]] = {}
    for run in runs:
        by_setting.setdefault(run.setting(), []).append(run)
    settings = [dict(s) for s in by_setting]
    keys = [k for k in dict.fromkeys(k for s in settings for k in s)
            if len({s.get(k, MISSING) for s in settings}) > 1]
    # Config keys in the config's order (run, model, data, train, optim, ...), as the first run wrote them.
    order = {k: i for i, k in enumerate(dict.fromkeys(k for r in runs for k in r.config))}
    keys.sort(key=lambda k: order.get(k, len(order)))
    groups = []
    for setting, members in zip(settings, by_setting.values()):
        values = {k: setting.get(k, MISSING) for k in keys}
        groups.append(Group(",".join(f"{k}={v}" for k, v in values.items()) or "all", members, values))
    return groups
