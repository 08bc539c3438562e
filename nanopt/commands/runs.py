"""`nanopt runs [DIR]`: finished runs below DIR, grouped into settings that differ only in their seed (mean,
standard deviation and a 95% Student-t interval per figure); `--compare A B` tests whether A beats B (Welch);
`--runs` (or runs that do not group) gives the leaderboard, fastest to target first. A run that repeats the
setting and seed of another (a copied sweep) is counted once, with a warning."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
from scipy import stats

from nanopt.errors import ConfigError
from nanopt.rundirs import SUMMARY_FILE, FinishedRun, Group, Repeat, find_runs, group_runs, split_repeats

# The figures a group is summarised by (those present in its runs' summaries), each lower-is-better.
FIGURES: dict[str, tuple[str, str]] = {
    "train_seconds_to_target": ("time to target (s)", ".2f"),
    "step_to_target": ("steps to target", ".1f"),
    "tokens_to_target": ("tokens to target", ",.0f"),
    "final_val_loss": ("final val loss", ".4f"),
    "final_val_bpb": ("final val bpb", ".4f"),
}
CONFIDENCE = 0.95


# ---------------------------------------------------------------- statistics


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _spec(metric: str) -> str:
    return FIGURES[metric][1] if metric in FIGURES else ".4g"


def describe(values: list[float]) -> dict[str, Any]:
    """n, mean, sample standard deviation and the 95% Student-t confidence interval of the mean (sd and
    interval are None below 2 values; identical values give a zero-width interval)."""
    n = len(values)
    out: dict[str, Any] = {"n": n, "mean": float(np.mean(values)) if n else None, "sd": None, "ci95": None}
    if n >= 2:
        out["sd"] = float(np.std(values, ddof=1))
        if out["sd"] == 0:
            out["ci95"] = [out["mean"], out["mean"]]  # scipy returns nan for a zero scale
        else:
            low, high = stats.t.interval(CONFIDENCE, n - 1, loc=out["mean"], scale=stats.sem(values))
            out["ci95"] = [float(low), float(high)]
    return out


def values_of(runs: list[FinishedRun], metric: str) -> list[float]:
    """The metric from each run that has it (a run that never reached its target has no time to target)."""
    return [float(r.summary[metric]) for r in runs if isinstance(r.summary.get(metric), (int, float))
            and not isinstance(r.summary.get(metric), bool)]


def group_stats(group: Group) -> dict[str, Any]:
    figures = {m: describe(v) for m in FIGURES if (v := values_of(group.runs, m))}
    return {"name": group.name, "values": group.values, "n": len(group.runs), "seeds": group.seeds,
            "runs": [r.name for r in group.runs], "stats": figures}


def welch(a: list[float], b: list[float], metric: str, alpha: float, names: tuple[str, str] = ("A", "B")
          ) -> dict[str, Any]:
    """Does A have a lower mean than B? Welch's t-test (unequal variances), one-sided, and the two-sided 95%
    interval of mean(A) - mean(B). `testable` is False, with the reason, where the test cannot be done."""
    out: dict[str, Any] = {
        "metric": metric, "lower_is_better": True, "alpha": alpha, "test": "Welch's t-test, one-sided",
        "alternative": "mean(A) < mean(B)",
        "a": {"name": names[0], **describe(a)}, "b": {"name": names[1], **describe(b)},
        "difference": float(np.mean(a) - np.mean(b)) if a and b else None,
        "difference_ci95": None, "t": None, "df": None, "p": None, "testable": False, "a_beats_b": None,
    }
    if len(a) < 2 or len(b) < 2:
        out["reason"] = (f"n is too small to test: A has {len(a)} and B has {len(b)} run(s) with {metric}; "
                         f"Welch's t-test needs at least 2 per group (more seeds: nanopt sweep ... --seeds N)")
        return out
    if np.var(a) == 0 and np.var(b) == 0:
        out["reason"] = "no spread within either group (every run gave the same value): the t-test is undefined"
        return out
    one_sided = stats.ttest_ind(a, b, equal_var=False, alternative="less")
    low, high = stats.ttest_ind(a, b, equal_var=False).confidence_interval(CONFIDENCE)
    out.update(t=float(one_sided.statistic), df=float(one_sided.df), p=float(one_sided.pvalue),
               difference_ci95=[float(low), float(high)], testable=True,
               a_beats_b=bool(one_sided.pvalue < alpha))
    return out


# ---------------------------------------------------------------- picking the two sides


def resolve(spec: str, groups: list[Group], root: Path) -> Group:
    """A group by exact name, a directory (its runs must be seeds of one setting), or a unique substring
    of a group name."""
    names = [g.name for g in groups]
    if spec in names:
        return groups[names.index(spec)]
    path = Path(spec)
    if path.is_dir():
        runs, _ = find_runs(path)
        found = group_runs(runs)
        if len(found) != 1:
            listing = "; ".join(f"{g.name} ({len(g.runs)} runs)" for g in found) or "no finished runs"
            raise ConfigError(f"--compare {spec}: the directory holds {len(found)} settings, not one ({listing}). "
                              f"Give a group name or a directory whose runs differ only in their seed.")
        return Group(spec, found[0].runs, found[0].values, found[0].repeats)
    matches = [g for g in groups if spec in g.name]
    if len(matches) == 1:
        return matches[0]
    listing = "\n  ".join(names)
    if matches:
        raise ConfigError(f"--compare {spec}: matches {len(matches)} groups ({', '.join(g.name for g in matches)}); "
                          f"give more of the name. The groups in {root}:\n  {listing}")
    raise ConfigError(f"--compare {spec}: no group name contains {spec!r} and it is not a directory. Give a group "
                      f"name (or part of one) or a run directory. The groups in {root}:\n  {listing}")


# ---------------------------------------------------------------- tables


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell, a dashed line under the header."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_groups(summaries: list[dict[str, Any]]) -> str:
    rows = []
    for g in summaries:
        first = True
        for metric, s in g["stats"].items():
            spec = _spec(metric)
            ci = "-" if s["ci95"] is None else f"[{format(s['ci95'][0], spec)}, {format(s['ci95'][1], spec)}]"
            rows.append((g["name"] if first else "", str(g["n"]) if first else "", FIGURES[metric][0], str(s["n"]),
                         format(s["mean"], spec), _fmt(s["sd"], spec), ci))
            first = False
        if first:  # a group whose runs have none of the figures
            rows.append((g["name"], str(g["n"]), "-", "0", "-", "-", "-"))
    return table(("group", "runs", "figure", "n", "mean", "sd", "95% CI"), rows)


def format_comparison(c: dict[str, Any]) -> str:
    spec = _spec(c["metric"])
    label = FIGURES.get(c["metric"], (c["metric"],))[0]
    lines = [f"A = {c['a']['name']}", f"B = {c['b']['name']}", f"{label} ({c['metric']}), lower is better:"]
    for side, s in (("A", c["a"]), ("B", c["b"])):
        lines.append(f"  {side}: n={s['n']}, mean {_fmt(s['mean'], spec)}, sd {_fmt(s['sd'], spec)}")
    if c["difference"] is not None:
        ci = "" if c["difference_ci95"] is None else \
            f", 95% CI [{format(c['difference_ci95'][0], spec)}, {format(c['difference_ci95'][1], spec)}] (Welch)"
        lines.append(f"  mean(A) - mean(B) = {format(c['difference'], spec)}{ci}")
    if not c["testable"]:
        lines.append(f"  no test: {c['reason']}.")
        return "\n".join(lines)
    lines.append(f"  {c['test']} (H1: mean(A) < mean(B)): t = {c['t']:.3f}, df = {c['df']:.1f}, p = {c['p']:.3g}")
    verdict = "A beats B" if c["a_beats_b"] else "A does not beat B"
    lines.append(f"  {verdict} at alpha = {c['alpha']:g} (p {'<' if c['a_beats_b'] else '>='} {c['alpha']:g}).")
    return "\n".join(lines)


def _target(r: dict[str, Any]) -> str:
    """The run's target with its unit (runs may race to a loss or to bits per byte)."""
    if r.get("target_val_bpb") is not None:
        return f"{r['target_val_bpb']:.3f} bpb"
    return "-" if r.get("target_val_loss") is None else f"{r['target_val_loss']:.3f} nats"


def leaderboard(runs: list[FinishedRun]) -> list[dict[str, Any]]:
    """One row per run, fastest to target first, then the rest by final validation loss."""
    rows = [{**r.summary, "run": r.name} for r in runs]  # the directory (below DIR) names the run
    reached = sorted((r for r in rows if r.get("train_seconds_to_target") is not None),
                     key=lambda r: (_target(r), r["train_seconds_to_target"]))
    rest = sorted((r for r in rows if r.get("train_seconds_to_target") is None),
                  key=lambda r: (r.get("final_val_loss") is None, r.get("final_val_loss") or 0))
    return reached + rest


def format_leaderboard(rows: list[dict[str, Any]]) -> str:
    header = ("run", "target", "to target (s)", "steps", "tokens", "final val", "val bpb", "test bpb",
              "train (s)", "tokens seen", "params", "hardware")
    return table(header, [(
        r["run"], _target(r), _fmt(r.get("train_seconds_to_target"), ".1f"),
        _fmt(r.get("step_to_target"), "d"), _fmt(r.get("tokens_to_target"), ","),
        _fmt(r.get("final_val_loss"), ".4f"), _fmt(r.get("final_val_bpb"), ".4f"), _fmt(r.get("test_bpb"), ".4f"),
        _fmt(r.get("train_seconds"), ".1f"), _fmt(r.get("tokens_seen"), ","), _fmt(r.get("params"), ","),
        f"{r.get('world_size', '?')}x {r.get('hardware') or r.get('device') or '?'}",
    ) for r in rows])


# ---------------------------------------------------------------- the command


def _json_safe(value: Any) -> Any:
    """NaN/inf as null: JSON has neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def repeat_warnings(repeats: list[Repeat]) -> list[str]:
    """One line per run left out as a repeat, each once (a --compare directory may repeat the listing's)."""
    return list(dict.fromkeys(r.describe() for r in repeats))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nanopt runs", description=(
        "Finished runs below DIR (recursively: a sweep's runs are in DIR/<sweep>/<point>/). Runs whose configs "
        "differ only in run.seed (and in names, paths, checkpointing, sampling) form a group: each group gets "
        "n, mean, standard deviation and a 95%% Student-t interval for time/steps/tokens to target and final "
        "val loss/bpb, and is named by the config keys that differ between groups. When no two runs group, "
        "or with --runs, one leaderboard row per run (time-to-target in training seconds). A run that repeats the "
        "setting and seed of another (a sweep copied twice) is one sample: it is counted once, with a warning."))
    p.add_argument("dir", nargs="?", default="runs")
    p.add_argument("--runs", action="store_true", help="the per-run leaderboard even when runs group")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="does A beat B? group names, unique parts of them, or directories of seeds")
    p.add_argument("--metric", default="final_val_loss",
                   help=f"{SUMMARY_FILE} figure for --compare, lower is better (default final_val_loss; "
                        "train_seconds_to_target, step_to_target, tokens_to_target, final_val_bpb, ...)")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level for --compare (default 0.05; "
                                                              "speedrun records ask for 0.01)")
    p.add_argument("--json", action="store_true", help="one JSON object (groups, runs, comparison) for tools")
    args = p.parse_args(argv)
    root = Path(args.dir)
    if not 0 < args.alpha < 1:
        raise ConfigError(f"--alpha {args.alpha}: give a significance level between 0 and 1, e.g. 0.05 or 0.01.")
    found, skipped = find_runs(root)
    runs, repeats = split_repeats(found)  # statistics and the leaderboard count each (setting, seed) once
    groups = group_runs(runs)
    summaries = [group_stats(g) for g in groups]
    comparison: Optional[dict[str, Any]] = None
    if args.compare:
        a, b = (resolve(spec, groups, root) for spec in args.compare)
        repeats += [r for g in (a, b) for r in g.repeats]  # a directory given to --compare may hold its own
        va, vb = values_of(a.runs, args.metric), values_of(b.runs, args.metric)
        if not va and not vb:
            present = sorted({k for r in a.runs + b.runs for k, v in r.summary.items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool)})
            raise ConfigError(f"--metric {args.metric}: neither {a.name} nor {b.name} has it in {SUMMARY_FILE}. "
                              f"Their numeric figures: {', '.join(present)}.")
        comparison = welch(va, vb, args.metric, args.alpha, (a.name, b.name))
    grouped = any(len(g.runs) > 1 for g in groups) and not args.runs
    warnings = repeat_warnings(repeats)

    if args.json:
        print(json.dumps(_json_safe({"dir": str(root), "groups": summaries, "runs": leaderboard(runs),
                                     "comparison": comparison, "skipped": skipped, "warnings": warnings}), indent=2))
        return 0
    if not runs:
        print(f"no finished runs in {root} (a run writes {SUMMARY_FILE} when it ends)")
    elif grouped:
        print(f"{len(runs)} runs in {len(groups)} group(s) of seeds; named by the config keys that differ "
              f"between groups; n: runs with the figure; 95% CI of the mean (Student t)")
        print(format_groups(summaries))
    else:
        print(format_leaderboard(leaderboard(runs)))
    if comparison is not None:
        print()
        print(format_comparison(comparison))
    for line in warnings:
        print(f"warning: {line}")
    for line in skipped:
        print(f"skipped {line}")
    return 0
