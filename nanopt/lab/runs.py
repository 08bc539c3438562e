"""Finished runs below a directory, grouped by setting over seeds, described, Welch-tested and ranked; the table
renderer. Torch-free; scipy.stats (0.7 s to import) is imported where needed, so the sweep driver starts at once."""
from __future__ import annotations

import bisect
import json
import math
import os
import statistics
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from nanopt.config import NEUTRAL_KEYS, canonical  # runs differing only in these and the seed repeat one setting
from nanopt.errors import ConfigError
from nanopt.io import clean, finite, is_int, is_number
from nanopt.rundirs import (CHECKPOINTS_DIR, CONFIG_FILE, EVALS_FILE, METRICS_FILE, PROFILE_FILE, SUMMARY_FILE, flatten,
                            format_value, is_run, read_config, read_metrics, read_records, read_summary, walk_runs)
from nanopt.schema import Field, read

SEED_KEY = "run.seed"
# Runs differing only in these are seeds of one setting; init and data seeds are each null = run.seed.
SEED_KEYS = (SEED_KEY, "run.init_seed", "run.data_seed")
# Summary fields that split groups too: the same config on another machine or world size is another race.
HARDWARE_KEYS = ("hardware", "world_size")
NAME_KEYS = 3  # a group is named by at most this many keys; more (other configs) are named by directory
MISSING = "<missing>"  # a key one run's config lacks (written by another nanopt version)
# The figures a group of seeds is summarised by (those its runs have), each lower-is-better: label, format.
GROUP_FIGURES: dict[str, tuple[str, str]] = {
    "train_seconds_to_target": ("time to target (s)", ".2f"),
    "step_to_target": ("steps to target", ".1f"),
    "tokens_to_target": ("tokens to target", ",.0f"),
    "final_val_loss": ("final val loss", ".4f"),
    "final_val_bpb": ("final val bpb", ".4f"),
}
# The leaderboard's columns between a run's target and its hardware: header: (summary key, format).
LEADERBOARD = {"to target (s)": ("train_seconds_to_target", ".1f"), "steps": ("step_to_target", "d"),
               "tokens": ("tokens_to_target", ","), "final val": ("final_val_loss", ".4f"),
               "val bpb": ("final_val_bpb", ".4f"), "test bpb": ("test_bpb", ".4f"),
               "train (s)": ("train_seconds", ".1f"), "tokens seen": ("tokens_seen", ","), "params": ("params", ",")}
# Where a group's spread comes from (spread()), as `nanopt runs` says it.
SOURCES = {"init": "init only", "data": "data order only", "both": "both init and data order",
           "init_only": "init alone", "data_only": "data order alone"}
FIXED = {"init_only": "data_seed", "data_only": "init_seed"}  # the seed each part of a "both" group holds fixed
CONFIDENCE = 0.95
RECORD_ALPHA, POWER = 0.01, 0.8  # how many seeds: to show a difference at p < 0.01 four times in five
MAX_SEEDS = 10_000
TARGETS = (("target_val_bpb", "bpb"), ("target_val_loss", "nats"))  # the first a run has is its target
TASK_PREFIX = "task:"  # downstream scores as figures: "task:<task>/<metric>" (evals.jsonl, harness.py)


# ---------------------------------------------------------------- reading finished runs
# What the profiler writes (profiling.py), with the entries `compare` computes with.
PROFILE = Field(dict, what="a profile summary (an object)", fields={
    "profiled_steps": Field(int, required=True, lo=0), "first_step": Field(int, null=True),
    "last_step": Field(int, null=True), "step_ms_mean": Field(float, required=True),
    "label_ms": Field(dict, items=Field(float)),
    "top_ops": Field(list, items=Field(dict, fields={k: Field(str if k == "name" else float, required=True)
                                                     for k in ("name", "calls", "self_ms")}))})


def read_profile(run_dir: Path) -> Optional[dict[str, Any]]:
    """profile_summary.json, None when the run was not profiled; ConfigError naming it when it is damaged."""
    return read(Path(run_dir) / PROFILE_FILE, PROFILE, "The file is damaged: remove it (the run's other figures "
                "stay usable) or profile the run again.")


@dataclass
class FinishedRun:
    """A finished run directory. `records` and `profile` are read on first use: listing many runs reads neither,
    and a damaged one stops only a command that needs it."""

    dir: Path
    config: dict[str, Any]  # flattened: {"optim.name": "muon", ...}; {} when config.yaml is missing
    summary: dict[str, Any]
    name: str = ""  # how reports call it: the path below the directory searched

    @cached_property
    def records(self) -> list[dict[str, Any]]:
        return [r for r in read_metrics(self.dir) if is_int(r.get("step"))]

    @cached_property
    def profile(self) -> Optional[dict[str, Any]]:
        return read_profile(self.dir)

    @cached_property
    def tasks(self) -> dict[str, tuple[float, bool]]:
        """Downstream scores at the run's last step, from evals.jsonl (training's and `nanopt eval`'s; the newest
        per task and metric): {"task:<task>/<metric>": (value, higher is better)}."""
        return {f"{TASK_PREFIX}{r['task']}/{metric}": (float(value), isinstance(hib := r.get("higher_is_better"), dict)
                                                       and hib.get(metric) is True)
                for r in read_records(self.dir / EVALS_FILE) if r.get("step") == self.summary.get("steps")
                and isinstance(r.get("task"), str) and isinstance(r.get("scores"), dict)
                for metric, value in r["scores"].items() if is_number(value)}

    def figure(self, key: str) -> Any:
        return self.tasks.get(key, (None,))[0] if key.startswith(TASK_PREFIX) else self.summary.get(key)

    @property
    def seeds(self) -> tuple[Any, Any]:
        """(init seed, data seed) the run trained with: what makes it another sample of its setting."""
        return tuple(self.config.get(SEED_KEY) if self.config.get(k) is None else self.config[k] for k in SEED_KEYS[1:])

    def setting(self) -> tuple[tuple[str, str], ...]:
        """Sorted (key, value) pairs: the config without the seeds and neutral keys, plus the hardware."""
        if not self.config:  # no config.yaml: nothing to match on, so the run stands alone
            return (("run.dir", str(self.dir)),)
        items = {k: v for k, v in self.config.items() if k not in SEED_KEYS and k not in NEUTRAL_KEYS}
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
    # As this version holds each value (a list older versions wrote as text), so old and new runs still group.
    config = {k: canonical(k, v) for k, v in flatten(read_config(path) or {}).items()}
    return FinishedRun(path, config, summary, name or path.name)


def find_runs(root: Path) -> tuple[list[FinishedRun], list[str]]:
    """Every finished run at or below `root`, by path, and a line for each run left out (unfinished, damaged)."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory; give the directory that holds the runs (default runs/) "
                          f"or a sweep's directory (runs/<sweep>).")
    runs, skipped = [], []
    for path in walk_runs(root):
        name = path.relative_to(root).as_posix() if path != root else path.name
        try:
            runs.append(load_run(path, name))
        except ConfigError as e:
            skipped.append(str(e) if (path / SUMMARY_FILE).is_file() else f"{path}: not finished (no {SUMMARY_FILE})")
    return runs, skipped


@dataclass
class Repeat:
    """A run with the setting and seeds of an earlier one (a sweep copied): statistics count the pair once."""

    run: FinishedRun  # left out
    first: FinishedRun  # counted

    def describe(self) -> str:
        init, data = self.run.seeds
        return (f"{self.run.dir} repeats {self.first.dir} (the same setting, init seed {format_value(init)} and "
                f"data seed {format_value(data)}): counted once, as {self.first.name}")


def split_repeats(runs: list[FinishedRun]) -> tuple[list[FinishedRun], list[Repeat]]:
    """Each (setting, init and data seed) once, the first by path kept, and the repeats: two copies counted as two
    seeds would halve the standard error and make any difference look significant."""
    keys = [(run.setting(), *map(format_value, run.seeds)) for run in runs]
    first = dict(zip(keys[::-1], runs[::-1]))  # the last write of a key wins: the first run by path
    pairs = list(zip(keys, runs))
    return [r for k, r in pairs if first[k] is r], [Repeat(r, first[k]) for k, r in pairs if first[k] is not r]


@dataclass
class Group:
    """Runs with one setting, each seed once, named by group_runs."""

    name: str
    runs: list[FinishedRun] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)  # the varying keys' values, as in the name
    repeats: list[Repeat] = field(default_factory=list)  # runs left out as repeats of one in `runs`


def group_runs(runs: list[FinishedRun]) -> list[Group]:
    """Runs grouped by setting, in order, repeats counted once (each group lists its own); named by the keys that
    differ between groups (`optim.name=muon`), or `all`; where more than NAME_KEYS differ, _names_by_directory."""
    kept, repeats = split_repeats(runs)
    by_setting: dict[tuple, list[FinishedRun]] = {}
    for run in kept:
        by_setting.setdefault(run.setting(), []).append(run)
    # Config keys in the config's order (run, model, data, train, optim, ...), as the first run wrote them.
    order = {k: i for i, k in enumerate(dict.fromkeys(k for r in kept for k in r.config))}
    keys = _differing(list(by_setting), order)
    names = _names_by_directory(by_setting, order) if len(keys) > NAME_KEYS else {
        s: _key_name("", {k: dict(s).get(k, MISSING) for k in keys}) or ("all", {}) for s in by_setting}
    return [Group(names[setting][0], members, names[setting][1], [r for r in repeats if r.first.setting() == setting])
            for setting, members in by_setting.items()]


def _differing(settings: list[tuple], order: dict[str, int]) -> list[str]:
    dicts = [dict(s) for s in settings]
    keys = [k for k in dict.fromkeys(k for d in dicts for k in d) if len({d.get(k, MISSING) for d in dicts}) > 1]
    return sorted(keys, key=lambda k: order.get(k, len(order)))


def _key_name(directory: str, values: dict[str, str]) -> Optional[tuple[str, dict[str, str]]]:
    name = f"{directory}/" * bool(directory) + ",".join(f"{k}={v}" for k, v in values.items())
    return (name, values) if values else None


def _names_by_directory(by_setting: dict[tuple, list[FinishedRun]],
                        order: dict[str, int]) -> dict[tuple, tuple[str, dict[str, str]]]:
    """(name, values) per setting: the directory holding a group's runs and the keys that differ between the groups
    there (`tiny-sweep/optim.name=muon`: a sweep's points by their grid); the directory alone when it holds one
    setting; else, or where two names clash, the group's first run's name."""
    where = {s: _directory(members) for s, members in by_setting.items()}
    names = {}
    for s, members in by_setting.items():
        keys = _differing([t for t in by_setting if where[t] == where[s]], order)
        named = _key_name(where[s], {k: dict(s).get(k, MISSING) for k in keys}) if len(keys) <= NAME_KEYS else None
        names[s] = named or ((where[s], {}) if not keys and where[s] else (members[0].name, {}))
    taken = [name for name, _ in names.values()]
    return {s: (by_setting[s][0].name, {}) if taken.count(name) > 1 else (name, values)
            for s, (name, values) in names.items()}


def _directory(runs: list[FinishedRun]) -> str:
    shared = os.path.commonpath([PurePosixPath(r.name).parent.as_posix() for r in runs])
    return "" if shared in ("", ".") else shared


# ---------------------------------------------------------------- statistics over seeds
def describe(values: list[float]) -> dict[str, Any]:
    """n, mean, sample sd and the 95% Student-t interval of the mean (None below 2 values)."""
    from scipy import stats  # heavy: see the module docstring

    n = len(values)
    mean, sd = statistics.fmean(values) if n else None, statistics.stdev(values) if n >= 2 else None
    ci = None if sd is None else [mean] * 2 if sd == 0 else [  # scipy returns nan for a zero scale
        float(v) for v in stats.t.interval(CONFIDENCE, n - 1, loc=mean, scale=stats.sem(values))]
    return {"n": n, "mean": mean, "sd": sd, "ci95": ci}


def values_of(runs: list[FinishedRun], metric: str) -> list[float]:
    return [value for r in runs if (value := finite(r.figure(metric))) is not None]


def figure_stats(runs: list[FinishedRun]) -> dict[str, dict[str, Any]]:
    tasks = sorted({k for r in runs for k in r.tasks})
    return {m: describe(v) for m in [*GROUP_FIGURES, *tasks] if (v := values_of(runs, m))}


def spread(runs: list[FinishedRun]) -> dict[str, Any]:
    """Where a group's spread comes from: "init" (one `data_seed`), "data" (one `init_seed`), "both", or None (one
    run). For "both", the most runs (2+) sharing a data seed (`init_only`) and an init seed (`data_only`), with
    their figures: read together, they say which source dominates."""
    if len(runs) < 2:
        return {"from": None}
    out: dict[str, Any] = {"from": "both"}
    for source, varied, fixed, i in (("init", "init_only", "data_seed", 1), ("data", "data_only", "init_seed", 0)):
        by_fixed: dict[str, list[FinishedRun]] = {}
        for r in runs:
            by_fixed.setdefault(format_value(r.seeds[i]), []).append(r)
        if len(by_fixed) == 1:  # every run shares this seed: the spread is the other's alone
            return {"from": source, fixed: runs[0].seeds[i]}
        subset = max(by_fixed.values(), key=len)
        if len(subset) >= 2:
            out[varied] = {fixed: subset[0].seeds[i], "runs": [r.name for r in subset], "stats": figure_stats(subset)}
    return out


def group_stats(group: Group) -> dict[str, Any]:
    return {"name": group.name, "values": group.values, "n": len(group.runs),
            "seeds": [r.config.get(SEED_KEY) for r in group.runs],
            "seed_pairs": [list(r.seeds) for r in group.runs], "runs": [r.name for r in group.runs],
            "stats": figure_stats(group.runs), "spread": spread(group.runs)}


def welch(a: list[float], b: list[float], metric: str, alpha: float, names: tuple[str, str] = ("A", "B"),
          lower_is_better: bool = True) -> dict[str, Any]:
    """Is A better than B (a lower mean; a higher one for a task score)? Welch's one-sided t-test and the two-sided
    95% interval of mean(A) - mean(B); `testable` False, with the reason, where the test cannot be done."""
    from scipy import stats  # heavy: see the module docstring

    out: dict[str, Any] = {
        "metric": metric, "lower_is_better": lower_is_better, "alpha": alpha, "test": "Welch's t-test, one-sided",
        "alternative": "mean(A) < mean(B)" if lower_is_better else "mean(A) > mean(B)",
        "a": {"name": names[0], **describe(a)}, "b": {"name": names[1], **describe(b)},
        "difference": statistics.fmean(a) - statistics.fmean(b) if a and b else None,
        "difference_ci95": None, "t": None, "df": None, "p": None, "testable": False, "a_beats_b": None,
    }
    if len(a) < 2 or len(b) < 2:
        return {**out, "reason": f"n is too small to test: A has {len(a)} and B has {len(b)} run(s) with {metric}; "
                f"Welch's t-test needs at least 2 per group (more seeds: nanopt sweep ... --seeds N)"}
    if out["a"]["sd"] == out["b"]["sd"] == 0:
        return {**out, "reason": "no spread within either group (every run gave the same value): the t-test is "
                "undefined"}
    one_sided = stats.ttest_ind(a, b, equal_var=False, alternative="less" if lower_is_better else "greater")
    low, high = stats.ttest_ind(a, b, equal_var=False).confidence_interval(CONFIDENCE)
    out.update(t=float(one_sided.statistic), df=float(one_sided.df), p=float(one_sided.pvalue),
               difference_ci95=[float(low), float(high)], testable=True, a_beats_b=bool(one_sided.pvalue < alpha))
    return out


def seeds_needed(sd_a: float, sd_b: float, difference: float, alpha: float = RECORD_ALPHA,
                 power: float = POWER) -> Optional[int]:
    """The least n seeds per group at which Welch's one-sided test at `alpha` detects a true `difference` of means
    with probability `power` (noncentral t, Welch-Satterthwaite df; per-seed sds sd_a, sd_b). None when the
    difference is 0 or more than MAX_SEEDS would be needed."""
    from scipy import stats  # heavy: see the module docstring

    if difference == 0 or not (sd_a > 0 or sd_b > 0):
        return None if difference == 0 else 2  # no spread: any difference shows (the t-test needs 2 a side)

    def enough(n: int) -> bool:
        va, vb = sd_a ** 2 / n, sd_b ** 2 / n
        df = (va + vb) ** 2 / ((va ** 2 + vb ** 2) / (n - 1))
        return stats.nct.sf(stats.t.ppf(1 - alpha, df), df, abs(difference) / math.sqrt(va + vb)) >= power

    # The power grows with n (a smaller standard error, more df): the least n by bisection, not one n at a time.
    n = bisect.bisect_left(range(2, MAX_SEEDS + 1), True, key=enough) + 2
    return n if n <= MAX_SEEDS else None


def resolve(spec: str, groups: list[Group], root: Path) -> Group:
    """A --compare side: a group by exact name, a directory of one setting's seeds, or a unique part of a name."""
    names = [g.name for g in groups]
    if spec in names:
        return groups[names.index(spec)]
    if Path(spec).is_dir():
        found = group_runs(find_runs(Path(spec))[0])
        if len(found) != 1:
            listing = "; ".join(f"{g.name} ({len(g.runs)} runs)" for g in found) or "no finished runs"
            raise ConfigError(f"--compare {spec}: the directory holds {len(found)} settings, not one ({listing}). "
                              f"Give a group name or a directory whose runs differ only in their seed.")
        return replace(found[0], name=spec)
    matches = [g for g in groups if spec in g.name]
    if len(matches) == 1:
        return matches[0]
    listing = "\n  ".join(names)
    if matches:
        raise ConfigError(f"--compare {spec}: matches {len(matches)} groups ({', '.join(g.name for g in matches)}); "
                          f"give more of the name. The groups in {root}:\n  {listing}")
    raise ConfigError(f"--compare {spec}: no group name contains {spec!r} and it is not a directory. Give a group "
                      f"name (or part of one) or a run directory. The groups in {root}:\n  {listing}")


def _target(r: dict[str, Any]) -> str:
    """The run's target with its unit (runs may race to a loss or to bits per byte)."""
    return next((f"{r[k]:.3f} {unit}" for k, unit in TARGETS if r.get(k) is not None), "-")


def leaderboard(runs: list[FinishedRun]) -> list[dict[str, Any]]:
    """One row per run (named by its directory below DIR), fastest to target first, then by final val loss."""
    rows = [{**r.summary, **{k: v for k, (v, _) in r.tasks.items()}, "run": r.name} for r in runs]
    return sorted(rows, key=lambda r: (0, _target(r), r["train_seconds_to_target"])
                  if r.get("train_seconds_to_target") is not None
                  else (1, r.get("final_val_loss") is None, r.get("final_val_loss") or 0))


def runs_report(root: Path, compare: Optional[tuple[str, str]] = None, metric: str = "final_val_loss",
                alpha: float = 0.05, effect: Optional[float] = None) -> dict[str, Any]:
    """`nanopt runs` (which checks the flags' bounds): the finished runs below `root`, each (setting, seed) once:
    per-group statistics, the leaderboard, and with `compare` whether group A beats B on `metric` at `alpha`."""
    found, skipped = find_runs(root)
    runs, repeats = split_repeats(found)
    groups = group_runs(runs)
    comparison = None
    if compare:
        a, b = (resolve(spec, groups, root) for spec in compare)
        repeats += [r for g in (a, b) for r in g.repeats]  # a directory given to --compare may hold its own
        va, vb = values_of(a.runs, metric), values_of(b.runs, metric)
        if not va and not vb:
            present = sorted({k for r in a.runs + b.runs for k, v in r.summary.items() if is_number(v)}
                             | {k for r in a.runs + b.runs for k in r.tasks})
            raise ConfigError(f"--metric {metric}: neither {a.name} nor {b.name} has it in {SUMMARY_FILE}. "
                              f"Their numeric figures: {', '.join(present)}.")
        higher = any(r.tasks.get(metric, (None, False))[1] for r in a.runs + b.runs)
        comparison = welch(va, vb, metric, alpha, (a.name, b.name), not higher)
        if len(va) >= 2 and len(vb) >= 2:  # the seeds per group a claim needs, for the observed difference and `effect`
            sds, observed = (comparison["a"]["sd"], comparison["b"]["sd"]), comparison["difference"]
            seeds = comparison["seeds"] = {"alpha": RECORD_ALPHA, "power": POWER, "sd_a": sds[0], "sd_b": sds[1],
                                           "observed_difference": observed,
                                           "seeds_for_observed": seeds_needed(*sds, observed)}
            if effect is not None:
                seeds.update(difference=effect, seeds_for_difference=seeds_needed(*sds, effect))
    return {"dir": str(root), "groups": [group_stats(g) for g in groups], "runs": leaderboard(runs),
            "comparison": comparison, "skipped": skipped,
            "warnings": list(dict.fromkeys(r.describe() for r in repeats))}  # each once


# ---------------------------------------------------------------- text
def table(header: tuple[str, ...] | list[str], rows: list, markdown: bool = False) -> str:
    """Rows under a header: padded columns and a dashed rule, or Markdown."""
    if markdown:
        return "\n".join("| " + " | ".join(row) + " |" for row in [header, ["---"] * len(header), *rows])
    widths = [max(map(len, column)) for column in zip(header, *rows)]
    return "\n".join("  ".join(text.ljust(w) for text, w in zip(row, widths)).rstrip()
                     for row in [header, ["-" * w for w in widths], *rows])


def cell(value: Any, spec: str, sign: bool = False) -> str:
    return "-" if value is None else format(value, ("+" if sign else "") + spec)


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(clean(report), indent=2)


def _figure(metric: str) -> tuple[str, str]:
    return GROUP_FIGURES.get(metric, (metric, ".4g"))


def _groups_text(summaries: list[dict[str, Any]]) -> str:
    rows = []
    for g in summaries:
        for i, (metric, s) in enumerate(g["stats"].items()):
            label, spec = _figure(metric)
            ci = "-" if s["ci95"] is None else f"[{format(s['ci95'][0], spec)}, {format(s['ci95'][1], spec)}]"
            rows.append((g["name"] if i == 0 else "", str(g["n"]) if i == 0 else "", label.removeprefix(TASK_PREFIX),
                         str(s["n"]), format(s["mean"], spec), cell(s["sd"], spec), ci))
        if not g["stats"]:  # a group whose runs have none of the figures
            rows.append((g["name"], str(g["n"]), "-", "0", "-", "-", "-"))
    return table(("group", "runs", "figure", "n", "mean", "sd", "95% CI"), rows)


def _spread_text(s: dict[str, Any]) -> list[str]:
    """One group's spread(): its source, then for "both" each source's sd alone, per figure."""
    fixed = {"init": f" (data seed {s.get('data_seed')} fixed)", "data": f" (init seed {s.get('init_seed')} fixed)"}
    lines = [f"spread from {SOURCES[s['from']]}{fixed.get(s['from'], '')}"]
    parts = {k: s[k] for k in FIXED if k in s}
    for metric in dict.fromkeys(m for part in parts.values() for m in part["stats"]):
        sds = [f"{SOURCES[k]} {cell(p['stats'][metric]['sd'], _figure(metric)[1])} ({len(p['runs'])} runs, "
               f"{FIXED[k].replace('_', ' ')} {p[FIXED[k]]})" for k, p in parts.items() if metric in p["stats"]]
        lines.append(f"  {_figure(metric)[0]} sd: {'; '.join(sds)}")
    return lines


def _spread_lines(summaries: list[dict[str, Any]]) -> list[str]:
    """Each group's spread (groups of several runs); one "every group" when all read the same (a run.seed sweep)."""
    said = {g["name"]: _spread_text(g["spread"]) for g in summaries if g["spread"]["from"]}
    if len(said) > 1 and len({tuple(lines) for lines in said.values()}) == 1:
        said = {"every group of several runs": next(iter(said.values()))}
    return [line for name, (first, *rest) in said.items() for line in (f"{name}: {first}", *rest)]


def _comparison_text(c: dict[str, Any]) -> str:
    label, spec = _figure(c["metric"])
    better = "lower" if c["lower_is_better"] else "higher"
    lines = [f"A = {c['a']['name']}", f"B = {c['b']['name']}", f"{label} ({c['metric']}), {better} is better:"]
    lines += [f"  {side}: n={s['n']}, mean {cell(s['mean'], spec)}, sd {cell(s['sd'], spec)}"
              for side, s in (("A", c["a"]), ("B", c["b"]))]
    if c["difference"] is not None:
        ci = "" if c["difference_ci95"] is None else \
            f", 95% CI [{format(c['difference_ci95'][0], spec)}, {format(c['difference_ci95'][1], spec)}] (Welch)"
        lines.append(f"  mean(A) - mean(B) = {format(c['difference'], spec)}{ci}")
    if not c["testable"]:
        lines.append(f"  no test: {c['reason']}.")
        return "\n".join(lines)
    lines.append(f"  {c['test']} (H1: {c['alternative']}): t = {c['t']:.3f}, df = {c['df']:.1f}, p = {c['p']:.3g}")
    verdict = "A beats B" if c["a_beats_b"] else "A does not beat B"
    lines.append(f"  {verdict} at alpha = {c['alpha']:g} (p {'<' if c['a_beats_b'] else '>='} {c['alpha']:g}).")
    if s := c.get("seeds"):
        needed = {n: f"{n} seeds per group" if n else f"more than {MAX_SEEDS:,} seeds per group (or no difference)"
                  for n in (s["seeds_for_observed"], s.get("seeds_for_difference"))}
        lines += [f"  seeds to show a difference at p < {s['alpha']:g} with {s['power']:.0%} power (Welch, the "
                  f"measured sds {format(s['sd_a'], spec)} and {format(s['sd_b'], spec)}):",
                  f"    the observed {format(s['observed_difference'], spec)}: {needed[s['seeds_for_observed']]}"]
        if "difference" in s:
            lines.append(f"    a difference of {format(s['difference'], spec)}: {needed[s['seeds_for_difference']]}")
    return "\n".join(lines)


def _leaderboard_text(rows: list[dict[str, Any]]) -> str:
    tasks = sorted({k for r in rows for k in r if k.startswith(TASK_PREFIX)})
    header = ("run", "target", *LEADERBOARD, "hardware", *(k.removeprefix(TASK_PREFIX) for k in tasks))
    return table(header, [(r["run"], _target(r), *(cell(r.get(k), spec) for k, spec in LEADERBOARD.values()),
                           f"{r.get('world_size', '?')}x {r.get('hardware') or r.get('device') or '?'}",
                           *(cell(r.get(k), ".4f") for k in tasks)) for r in rows])


def runs_text(report: dict[str, Any], per_run: bool = False) -> str:
    """runs_report() for a terminal: the groups' statistics when some group has several seeds (unless
    `per_run`), else the leaderboard; then the comparison, warnings and skipped runs."""
    groups, runs = report["groups"], report["runs"]
    if not runs:
        lines = [f"no finished runs in {report['dir']} (a run writes {SUMMARY_FILE} when it ends)"]
    elif any(g["n"] > 1 for g in groups) and not per_run:
        lines = [f"{len(runs)} runs in {len(groups)} group(s) of seeds, named by the config keys that differ between "
                 f"groups (or directories)", "n: runs with the figure; 95% CI of the mean (Student t)",
                 _groups_text(groups), *_spread_lines(groups)]
    else:
        lines = [_leaderboard_text(runs)]
    if report["comparison"] is not None:
        lines += ["", _comparison_text(report["comparison"])]
    return "\n".join(lines + [f"warning: {w}" for w in report["warnings"]]
                     + [f"skipped {s}" for s in report["skipped"]])
