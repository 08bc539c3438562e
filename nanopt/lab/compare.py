"""`nanopt compare`'s logic: where the difference between two finished runs comes from (what it reports:
nanopt/commands/compare.py's description)."""
from __future__ import annotations

import functools
import statistics
from typing import Any, Optional

import numpy as np

from nanopt.io import finite
from nanopt.lab.plots import series
from nanopt.lab.runs import HARDWARE_KEYS, SEED_KEYS, TASK_PREFIX, FinishedRun, cell, table
from nanopt.rundirs import format_value

# `nanopt compare`'s figures (key, label, format): speed from the metrics records, the rest from the summary.
SPEED = ("tokens_per_s", "step_ms", "mfu")
FIGURES: list[tuple[str, str, str]] = [
    ("tokens_per_s", "tokens/s (median step)", ",.0f"),
    ("step_ms", "step time, ms (median step)", ".2f"),
    ("mfu", "MFU (median step)", ".2%"),
    ("train_seconds", "training seconds", ".3f"),
    ("train_seconds_to_target", "time to target (s)", ".3f"),
    ("step_to_target", "steps to target", ",.0f"),
    ("tokens_to_target", "tokens to target", ",.0f"),
    ("final_val_loss", "final val loss", ".4f"),
    ("final_val_bpb", "final val bpb", ".4f"),
]
# The budgets val loss is compared at (unit, label, format): the largest of each that both runs reached.
BUDGETS = [("steps", "steps", ",.0f"), ("tokens", "tokens seen", ",.0f"), ("flops", "training FLOPs", ".4g"),
           ("seconds", "training seconds", ".2f")]


def figures(run: FinishedRun) -> dict[str, Optional[float]]:
    """FIGURES of one run; speed as the median over the logged steps after the MFU warm-up (start-up), which a few
    slow steps (a profiled window, a checkpoint write) do not move."""
    warmup = run.config.get("mfu.warmup_steps", 1)  # an integer: rundirs.CONFIG
    steps = [r for r in run.records if "loss" in r and r["step"] > warmup]
    speed = {key: [v for r in steps if (v := finite(r.get(key))) is not None] for key in SPEED}
    return {**{key: finite(run.summary.get(key)) for key, _, _ in FIGURES if key not in SPEED},
            **{key: statistics.median(values) if values else None for key, values in speed.items()},
            **{key: value for key, (value, _) in run.tasks.items()}}


def val_curve(run: FinishedRun, unit: str) -> tuple[list[float], list[float]]:
    """(budget spent, val loss) at each of the run's evaluations. FLOPs: tokens × the run's flops_per_token
    (summary.json). Seconds as `nanopt plot --x seconds` sums them: evaluation records carry no clock."""
    if unit != "flops":
        return series(run.records, "val_loss", unit)
    tokens, losses = series(run.records, "val_loss", "tokens")
    per_token = finite(run.summary.get("flops_per_token"))
    return ([t * per_token for t in tokens], losses) if per_token else ([], [])


def equal_budgets(a: FinishedRun, b: FinishedRun) -> list[dict[str, Any]]:
    """Per unit (BUDGETS): the largest budget both runs reached and each run's val loss there, linear between the
    two evaluations around it; None where a run has no such evaluations."""
    rows = []
    for unit, label, _ in BUDGETS:
        curves = val_curve(a, unit), val_curve(b, unit)
        budget = min(max(xs) for xs, _ in curves) if all(xs for xs, _ in curves) else None
        la, lb = (float(np.interp(budget, xs, ys)) if budget is not None and xs[0] <= budget else None
                  for xs, ys in curves)
        rows.append({"unit": unit, "label": label, "budget": budget, "a": la, "b": lb, "delta": _delta(la, lb)})
    return rows


def _delta(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else b - a


def config_changes(a: FinishedRun, b: FinishedRun) -> list[dict[str, str]]:
    """Keys whose value differs, from the settings (seeds, names and paths left out) and the seeds themselves."""
    sa, sb = ({**dict(r.setting()), **{k: format_value(r.config.get(k)) for k in SEED_KEYS}} for r in (a, b))
    return [{"key": k, "a": sa.get(k, "-"), "b": sb.get(k, "-")}  # the seeds last
            for k in sorted(dict.fromkeys([*sa, *sb]), key=lambda k: k in SEED_KEYS) if sa.get(k) != sb.get(k)]


def _per_step(profile: dict[str, Any], total: Optional[float]) -> Optional[float]:
    """Per profiled step; the values are finite where present (runs.PROFILE)."""
    return total / profile["profiled_steps"] if total is not None and profile["profiled_steps"] else None


def profile_parts(pa: dict[str, Any], pb: dict[str, Any]) -> list[dict[str, Any]]:
    """The profiled step and its shares (compute, data loader, host overhead: each share × mean step time),
    then the host time inside each label (forward, backward, ...), all in ms per step."""
    shares = [("step_ms_mean", "profiled step", 1.0, 1.0)] + [
        (k, k.removesuffix("_share").replace("_", " "), pa[k], pb[k])
        for k in pa if k.endswith("_share") and finite(pa[k]) is not None and finite(pb.get(k)) is not None]
    rows = [{"key": key, "label": label, "a_share": a, "b_share": b,
             "a_ms": a * pa["step_ms_mean"], "b_ms": b * pb["step_ms_mean"]} for key, label, a, b in shares]
    labels_a, labels_b = pa.get("label_ms") or {}, pb.get("label_ms") or {}
    rows += [{"key": f"label_ms.{key}", "label": f"host time in {key.replace('_', ' ')}", "a_share": None,
              "b_share": None, "a_ms": _per_step(pa, labels_a.get(key)), "b_ms": _per_step(pb, labels_b.get(key))}
             for key in dict.fromkeys([*labels_a, *labels_b])]
    for row in rows:
        row["delta_ms"] = _delta(row["a_ms"], row["b_ms"])
    return rows


def top_ops(pa: dict[str, Any], pb: dict[str, Any]) -> list[dict[str, Any]]:
    """Each run's top ops by self time, matched by name, in ms and calls per profiled step; largest |B - A| first.
    An op in one run's top list only (below the other's, which is not zero) comes after the matched ones."""
    ops_a, ops_b = ({op["name"]: op for op in p.get("top_ops") or []} for p in (pa, pb))
    rows = []
    for name in dict.fromkeys([*ops_a, *ops_b]):
        a, b = ops_a.get(name, {}), ops_b.get(name, {})  # _per_step(p, None) is None: not in that run's list
        a_ms, b_ms = _per_step(pa, a.get("self_ms")), _per_step(pb, b.get("self_ms"))
        rows.append({"name": name, "a_ms": a_ms, "b_ms": b_ms, "a_calls": _per_step(pa, a.get("calls")),
                     "b_calls": _per_step(pb, b.get("calls")), "delta_ms": _delta(a_ms, b_ms)})
    return sorted(rows, key=lambda r: (r["delta_ms"] is None, -abs(r["delta_ms"] if r["delta_ms"] is not None
                                                                  else max(r["a_ms"] or 0, r["b_ms"] or 0))))


def comparison(a: FinishedRun, b: FinishedRun) -> dict[str, Any]:
    """`nanopt compare`: config changes, figures with B - A and B / A, profile parts and top ops, notes."""
    fa, fb = figures(a), figures(b)
    tasks = [(k, k.removeprefix(TASK_PREFIX), ".4f") for k in sorted({*a.tasks, *b.tasks})]
    rows = [{"key": key, "label": label, "a": va, "b": vb, "delta": _delta(va, vb),
             "ratio": vb / va if va and vb is not None else None}
            for key, label, _ in FIGURES + tasks for va, vb in [(fa.get(key), fb.get(key))]
            if va is not None or vb is not None]
    out: dict[str, Any] = {"a": str(a.dir), "b": str(b.dir), "config_changes": config_changes(a, b),
                           "figures": rows, "equal_budgets": equal_budgets(a, b), "profile": None, "notes": []}
    for key in HARDWARE_KEYS:
        if a.summary.get(key) != b.summary.get(key):
            out["notes"].append(f"{key} differs ({a.summary.get(key)} vs {b.summary.get(key)}): seconds, tokens/s "
                                f"and MFU are measured on different machines")
    if a.profile and b.profile:
        about = ("mode", "profiled_steps", "first_step", "last_step")
        out["profile"] = {"a": {k: a.profile.get(k) for k in about}, "b": {k: b.profile.get(k) for k in about},
                          "parts": profile_parts(a.profile, b.profile), "top_ops": top_ops(a.profile, b.profile)}
        if a.profile.get("mode") != b.profile.get("mode"):
            out["notes"].append(f"the profiles measure compute differently ({a.profile.get('mode')} vs "
                                f"{b.profile.get('mode')}): their shares are not like for like")
    else:
        which = "neither run was" if not (a.profile or b.profile) else f"only {'A' if a.profile else 'B'} was"
        out["notes"].append(f"{which} profiled: run both with --profile.enabled=true to compare where the step "
                            f"time goes (step-time shares, top ops)")
    return out


def markdown(c: dict[str, Any]) -> str:
    spec = {**{r["key"]: ".4f" for r in c["figures"]}, **{key: s for key, _, s in FIGURES}}
    md = functools.partial(table, markdown=True)
    budget_spec = {unit: fmt for unit, _, fmt in BUDGETS}
    changes = md(["key", "A", "B"], [[f"`{ch['key']}`", ch["a"], ch["b"]] for ch in c["config_changes"]]) \
        if c["config_changes"] else "The same setting and seed (only names, paths, checkpointing or sampling differ)."
    lines = ["# nanopt compare", "", f"- A: `{c['a']}`", f"- B: `{c['b']}`", "", "## Config (B vs A)", "", changes,
             "", "## Figures", "", md(["figure", "A", "B", "Δ (B − A)", "B / A"], [
                 [r["label"], cell(r["a"], spec[r["key"]]), cell(r["b"], spec[r["key"]]),
                  cell(r["delta"], spec[r["key"]], sign=True),
                  cell(r["ratio"], ".3f") + ("x" if r["ratio"] is not None else "")] for r in c["figures"]]),
             "", "## Val loss at equal budgets (the most both runs reached)", "",
             md(["budget", "both reached", "A val loss", "B val loss", "Δ (B − A)"], [
                 [r["label"], cell(r["budget"], budget_spec[r["unit"]]), cell(r["a"], ".4f"), cell(r["b"], ".4f"),
                  cell(r["delta"], ".4f", sign=True)] for r in c["equal_budgets"]]),
             "", "Linear between evaluations; FLOPs: tokens × FLOPs per token; seconds: logged step times summed."]
    p = c["profile"]
    if p:
        lines += ["", "## Profile: where a step's time goes (ms per profiled step)", ""]
        lines += [f"- {side}: steps {p[s]['first_step']}-{p[s]['last_step']} ({p[s]['profiled_steps']} steps, "
                  f"{p[s]['mode']})" for side, s in (("A", "a"), ("B", "b"))]
        lines += ["", md(["part", "A share", "B share", "A ms/step", "B ms/step", "Δ ms/step"], [
            [r["label"], cell(r["a_share"], ".1%"), cell(r["b_share"], ".1%"), cell(r["a_ms"], ".3f"),
             cell(r["b_ms"], ".3f"), cell(r["delta_ms"], ".3f", sign=True)] for r in p["parts"]])]
        lines += ["", "## Top ops by self time (ms per profiled step, matched by name, largest |Δ| first)", "",
                  md(["op", "A ms/step", "B ms/step", "Δ ms/step", "A calls/step", "B calls/step"], [
                      [f"`{r['name']}`", cell(r["a_ms"], ".3f"), cell(r["b_ms"], ".3f"),
                       cell(r["delta_ms"], ".3f", sign=True), cell(r["a_calls"], ".1f"), cell(r["b_calls"], ".1f")]
                      for r in p["top_ops"]]),
                  "", "`-`: the op is not in that run's top list (below it, not zero)."]
    if c["notes"]:
        lines += ["", "## Notes", "", *(f"- {note}." for note in c["notes"])]
    return "\n".join(lines)
