"""Scaling laws fitted to (parameters N, tokens D, loss L) points: Chinchilla's approach 2 (isoFLOP parabolas) and
approach 3 (the parametric law), each with bootstrap intervals, and what a fit predicts at a new budget.

Approach 2 (Hoffmann et al. 2022, §3.2): at each compute budget C, loss against ln N (and ln D) is a parabola whose
vertex is the loss-optimal size; N_opt ∝ C^a and D_opt ∝ C^b are straight lines through those vertices in log-log.
Approach 3 (§3.3, refitted by Besiroglu et al. 2024): L(N, D) = E + A/N^α + B/D^β, fitted by minimising a Huber loss
(δ = 1e-3) between the predicted and observed ln L, with A, B, E as exponents (A = e^a) so the prediction is one
logsumexp, by L-BFGS from the best points of a grid of starts. Intervals are percentiles of refits to points
resampled with replacement (within each budget for approach 2, so every budget keeps a parabola).
"""
from __future__ import annotations

import csv
import functools
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
from numpy.polynomial import Polynomial
from scipy.optimize import minimize, minimize_scalar
from scipy.special import huber, logsumexp, softmax

from nanopt.config import load_config
from nanopt.errors import ConfigError
from nanopt.io import read_text, write_bytes
from nanopt.lab import plots
from nanopt.lab.runs import find_runs, load_run, table
from nanopt.recipe.mfu import meta_model, param_counts, token_flops

HUBER_DELTA = 1e-3
# Hoffmann et al.'s grid of starts (α, β over 0..2, e over -1..1.5, a and b over 0..25), searched whole (numpy);
# L-BFGS refines the best few. Besiroglu et al. found the fit sensitive to the start: one start is not enough.
_GRID = np.array(np.meshgrid(np.arange(0, 26, 5.0), np.arange(0, 26, 5.0), np.arange(-1, 1.6, 0.5),
                             np.arange(0, 2.01, 0.5), np.arange(0, 2.01, 0.5), indexing="ij")).reshape(5, -1).T
_REFINED_STARTS = 8
LAW_KEYS = ("E", "A", "B", "alpha", "beta")


@dataclass(frozen=True)
class Points:
    """The runs a law is fitted to, one entry per run."""
    params: np.ndarray
    tokens: np.ndarray
    flops: np.ndarray
    loss: np.ndarray

    def take(self, index: np.ndarray) -> "Points":
        return Points(self.params[index], self.tokens[index], self.flops[index], self.loss[index])

    def budgets(self, rtol: float = 0.05) -> list[np.ndarray]:
        """Indices of the runs at each compute budget, smallest first; runs within rtol of a budget's first run share
        it (a planned grid's runs differ by their rounding to whole steps)."""
        groups: list[list[int]] = []
        for i in map(int, np.argsort(self.flops)):
            if not groups or self.flops[i] > self.flops[groups[-1][0]] * (1 + rtol):
                groups.append([])
            groups[-1].append(i)
        return [np.array(g) for g in groups]


def _vertex(x: np.ndarray, loss: np.ndarray) -> float:
    """The x of the minimum of the least-squares parabola through (x, loss); nan when it opens downward."""
    if len(np.unique(x)) < 3:  # a bootstrap draw that kept fewer than three sizes has no parabola
        return math.nan
    parabola = Polynomial.fit(x, loss, 2)  # in a scaled window: ln N is ~20, and an unscaled fit is ill-conditioned
    return float(parabola.deriv().roots()[0]) if parabola.coef[2] > 0 else math.nan


def _approach2(p: Points, budgets: list[np.ndarray]) -> dict[str, Any]:
    logc = np.log([np.mean(p.flops[g]) for g in budgets])
    out: dict[str, Any] = {"budgets": np.exp(logc).tolist()}
    for exponent, key, size in (("a", "n_opt", p.params), ("b", "d_opt", p.tokens)):
        vertices = np.array([_vertex(np.log(size[g]), p.loss[g]) for g in budgets])
        out[exponent] = np.polyfit(logc, vertices, 1)[0] if np.isfinite(vertices).all() else math.nan
        out[key] = np.exp(vertices).tolist()
    return out


def _log_terms(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """ln of the law's terms A/N^α, B/D^β, E, stacked first; θ = (a, b, e, α, β) may hold columns."""
    a, b, e, alpha, beta = theta
    return np.stack(np.broadcast_arrays(a - alpha * log_n, b - beta * log_d, e))


def _huber_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray,
                     log_l: np.ndarray) -> tuple[float, np.ndarray]:
    """Σ Huber(predicted ln L − observed ln L) and its gradient in θ = (a, b, e, α, β)."""
    z = _log_terms(theta, log_n, log_d)  # 3 × runs
    r = logsumexp(z, axis=0) - log_l
    gw = np.clip(r, -HUBER_DELTA, HUBER_DELTA) * softmax(z, axis=0)  # d Huber / d r × d pred / d z
    return float(huber(HUBER_DELTA, r).sum()), np.array([*gw.sum(axis=1), -gw[0] @ log_n, -gw[1] @ log_d])


def _approach3(p: Points, starts: Optional[np.ndarray] = None) -> np.ndarray:
    """θ = (a, b, e, α, β) minimising the Huber objective: the grid's best starts (or `starts`), each by L-BFGS."""
    log_n, log_d, log_l = np.log(p.params), np.log(p.tokens), np.log(p.loss)
    if starts is None:  # every start at once: θ's entries as grid × 1 columns, broadcast over runs
        r = logsumexp(_log_terms(_GRID.T[:, :, None], log_n, log_d), axis=0) - log_l
        starts = _GRID[np.argsort(huber(HUBER_DELTA, r).sum(axis=1))[:_REFINED_STARTS]]
    return min((minimize(_huber_objective, start, args=(log_n, log_d, log_l), jac=True, method="L-BFGS-B",
                         # the objective is ~1e-6 at the optimum: scipy's default relative tolerances stop far short
                         options={"ftol": 1e-15, "gtol": 1e-11, "maxiter": 5000}) for start in starts),
               key=lambda fit: fit.fun).x


def law(theta: np.ndarray) -> dict[str, float]:
    a, b, e, alpha, beta = theta
    return {"E": math.exp(e), "A": math.exp(a), "B": math.exp(b), "alpha": alpha, "beta": beta}


def predict_loss(fit: dict[str, float], params: float, tokens: float) -> float:
    return fit["E"] + fit["A"] / params ** fit["alpha"] + fit["B"] / tokens ** fit["beta"]


def optimum(fit: dict[str, float], flops: float,
            tokens_for: Callable[[float, float], float] = lambda n, c: c / (6 * n)) -> dict[str, float]:
    """The loss-optimal size at a budget under the law: N minimising L(N, tokens_for(N, C)). tokens_for defaults
    to C = 6ND; nanopt's own FLOPs per token (attention included) can be passed instead."""
    best = minimize_scalar(lambda ln_n: predict_loss(fit, math.exp(ln_n), tokens_for(math.exp(ln_n), flops)),
                           bounds=(math.log(1e2), math.log(1e13)), method="bounded")
    n = math.exp(best.x)
    d = tokens_for(n, flops)
    return {"flops": flops, "params": n, "tokens": d, "tokens_per_param": d / n, "loss": best.fun}


def _interval(samples: Sequence[float], level: float = 0.95) -> Optional[list[float]]:
    kept = [s for s in samples if math.isfinite(s)]
    return np.percentile(kept, [50 * (1 - level), 50 * (1 + level)]).tolist() if len(kept) > 1 else None


def fit(p: Points, bootstrap: int = 200, seed: int = 0) -> dict[str, Any]:
    """Both approaches, each figure {"value", "ci"} with its 95% bootstrap interval, the isoFLOP vertices, and the
    compute-optimal tokens per parameter at each budget."""
    budgets = p.budgets()
    two = _approach2(p, budgets)
    theta = _approach3(p)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(bootstrap):
        groups = [rng.choice(g, size=len(g)) for g in budgets]  # within each budget, so each keeps a parabola
        resampled = _approach2(p, groups)  # refits of approach 3 start at the fit
        draws.append({**law(_approach3(p.take(np.concatenate(groups)), starts=theta[None, :])),
                      "a": resampled["a"], "b": resampled["b"]})
    fitted = {**law(theta), "a": two["a"], "b": two["b"]}
    out: dict[str, Any] = {k: {"value": float(v), "ci": _interval([d[k] for d in draws])} for k, v in fitted.items()}
    alpha, beta = fitted["alpha"], fitted["beta"]
    out["approach3_a"], out["approach3_b"] = beta / (alpha + beta), alpha / (alpha + beta)
    out["isoflop"] = {"budgets": two["budgets"], "params_opt": two["n_opt"], "tokens_opt": two["d_opt"]}
    out["tokens_per_param"] = [d / n for n, d in zip(two["n_opt"], two["d_opt"])]
    out["runs"], out["budget_count"] = len(p.loss), len(budgets)
    return out


def from_csv(path: Path) -> Points:
    """Points from a CSV with a header `params,tokens,loss`, or `params,flops,loss` (then D = C / 6N); other
    columns are ignored. ConfigError naming the file, the line and the fix for anything else."""
    rows = list(csv.reader(read_text(path).splitlines()))
    header = [h.strip().lower() for h in rows[0]] if rows else []
    size = "flops" if "flops" in header and "tokens" not in header else "tokens"
    fix = (f"Give a CSV whose first line names the columns params,tokens,loss (or params,flops,loss, with D = C/6N) "
           f"and one run per line after it, each figure a positive number.")
    if not {"params", size, "loss"} <= set(header):
        raise ConfigError(f"{path}: the header {','.join(header) or '(empty file)'} lacks "
                          f"{', '.join(k for k in ('params', size, 'loss') if k not in header)}. {fix}")
    cols = [header.index(k) for k in ("params", size, "loss")]
    values = []
    for line, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        try:
            n, x, loss = (float(row[c]) for c in cols)
        except (ValueError, IndexError):
            raise ConfigError(f"{path}, line {line}: {','.join(row)!r} has no number in every one of params, "
                              f"{size} and loss. {fix}") from None
        if not all(math.isfinite(v) and v > 0 for v in (n, x, loss)):
            raise ConfigError(f"{path}, line {line}: params, {size} and loss must be positive numbers, not "
                              f"{','.join(row)!r}. {fix}")
        values.append((n, x if size == "tokens" else x / (6 * n), x if size == "flops" else 6 * n * x, loss))
    return _checked(values, str(path), fix)


# Which parameters are N (`--params`), and the summary.json figure each is read from.
PARAMS = {"params": "params", "n_6n": "flops_per_token_6n"}


def count(summary: dict[str, Any], params_key: str) -> float:
    """N of a run: all its parameters, or 6N's N (matrices, norms and head, not the lookup tables) = 6N FLOPs / 6."""
    return summary["params"] if params_key == "params" else summary["flops_per_token_6n"] / 6


def from_runs(root: Path, metric: str = "final_val_bpb", params_key: str = "params") -> Points:
    """Points from the finished runs below `root`: N, tokens_seen, tokens × flops_per_token and `metric`."""
    runs, _ = find_runs(root)
    keys = (PARAMS[params_key], "tokens_seen", "flops_per_token", metric)
    usable = [r.summary for r in runs if all(isinstance(r.summary.get(k), (int, float)) and r.summary[k] > 0
                                             for k in keys)]
    fix = (f"Give the directory of a finished ladder (`nanopt scaling plan` writes one, `nanopt sweep` runs it), "
           f"or a CSV with --csv.")
    values = [(count(s, params_key), s["tokens_seen"], s["tokens_seen"] * s["flops_per_token"], s[metric])
              for s in usable]
    return _checked(values, f"{root} ({len(usable)} of {len(runs)} finished runs have {', '.join(keys)})", fix)


def _checked(values: list[tuple[float, ...]], where: str, fix: str) -> Points:
    """Points from (N, D, C, L) rows, enough for both approaches: ≥ 2 budgets of ≥ 3 sizes, and ≥ 5 runs for the
    five-parameter law."""
    p = Points(*np.array(values, dtype=float).reshape(-1, 4).T)
    sizes = [len(np.unique(p.params[g])) for g in p.budgets()]
    if len(sizes) < 2 or min(sizes) < 3 or len(p.loss) < 5:
        raise ConfigError(f"{where}: {len(sizes)} compute budget(s) with {sizes or 'no'} distinct sizes; a fit needs "
                          f"at least 2 budgets with 3 or more model sizes each (runs within 5% of one budget's FLOPs "
                          f"share it). {fix}")
    return p


def report_text(out: dict[str, Any], predictions: Sequence[dict[str, float]] = ()) -> str:
    def fig(key: str) -> str:
        v, ci = out[key]["value"], out[key]["ci"]
        return f"{key:<6} {v:.4g}" + (f"  [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else "  [no interval]")
    lines = [f"{out['runs']} runs at {out['budget_count']} budgets; 95% bootstrap intervals in brackets.",
             "approach 3: L(N, D) = E + A/N^alpha + B/D^beta (Huber on log L, L-BFGS)",
             *(f"  {fig(k)}" for k in LAW_KEYS),
             f"  => N_opt ~ C^{out['approach3_a']:.3f}, D_opt ~ C^{out['approach3_b']:.3f}",
             "approach 2: isoFLOP parabolas", f"  {fig('a')}   (N_opt ~ C^a)", f"  {fig('b')}   (D_opt ~ C^b)",
             f"  {'budget (FLOPs)':>16} {'N_opt':>12} {'D_opt':>12} {'tokens/param':>13}"]
    iso = out["isoflop"]
    lines += [f"  {c:16.4g} {n:12.4g} {d:12.4g} {d / n:13.1f}"
              for c, n, d in zip(iso["budgets"], iso["params_opt"], iso["tokens_opt"])]
    lines += [f"predict at {p['flops']:.4g} FLOPs: N_opt {p['params']:.4g}, D_opt {p['tokens']:.4g} "
              f"({p['tokens_per_param']:.1f} tokens/param), loss {p['loss']:.4f}" for p in predictions]
    lines += [f"held out {c['run']}: N {c['params']:,.0f}, D {c['tokens']:,}: predicted {c['predicted']:.4f}, "
              f"measured {c['actual']:.4f} ({100 * c['error']:+.2f}%)" for c in out.get("checks", [])]
    return "\n".join(lines)


def plot(p: Points, out: dict[str, Any], path: Path) -> Path:
    """isoFLOP curves (loss against N at each budget, the runs and their parabola) with approach 2's optima and
    approach 3's frontier."""
    fig, ax = plots.figure(7, 4.5, margins=dict(left=0.1, right=0.97, bottom=0.12, top=0.92))
    law_fit = {k: out[k]["value"] for k in LAW_KEYS}
    for g, c in zip(p.budgets(), out["isoflop"]["budgets"]):
        x = np.log(p.params[g])
        line, = ax.plot(p.params[g], p.loss[g], "o", label=f"{c:.2g} FLOPs")
        grid = np.linspace(x.min(), x.max(), 50)
        ax.plot(np.exp(grid), Polynomial.fit(x, p.loss[g], 2)(grid), "-", color=line.get_color(), alpha=0.6)
    frontier = [optimum(law_fit, c) for c in np.geomspace(min(p.flops), max(p.flops), 30)]
    ax.plot([f["params"] for f in frontier], [f["loss"] for f in frontier], "k--", label="approach 3 optimum")
    ax.plot(out["isoflop"]["params_opt"], [predict_loss(law_fit, n, d) for n, d in
            zip(out["isoflop"]["params_opt"], out["isoflop"]["tokens_opt"])], "k*", ms=10, label="isoFLOP minima")
    ax.set(xscale="log", xlabel="parameters N", ylabel="loss", title="isoFLOP curves and the fitted frontier")
    ax.legend(fontsize=8)
    return write_bytes(path, plots.png(fig))


# ---------------------------------------------------------------- the plan: an isoFLOP grid of runs
KNOB = "model.depth"  # the model family's one size knob (config.py: width = depth × model.aspect_ratio)
MAX_DEPTH = 256


@dataclass(frozen=True)
class Rung:
    """One run of a ladder: its budget, size and everything the transfer rules set for it."""
    budget: float  # FLOPs, nanopt's own (6N + attention): tokens × flops_per_token ≈ budget
    depth: int
    params: int  # all parameters (summary.json's `params`)
    n_6n: int  # those a token passes through (6N's N)
    flops_per_token: int
    batch_tokens: int
    steps: int
    lr: float
    weight_decay: float
    warmup_steps: int

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_tokens

    @property
    def name(self) -> str:
        return f"C={self.budget:.3g},depth={self.depth}"

    def overrides(self) -> dict[str, Any]:
        return {KNOB: self.depth, "train.global_batch_tokens": self.batch_tokens, "train.max_steps": self.steps,
                "train.lr": float(f"{self.lr:.4g}"), "train.weight_decay": float(f"{self.weight_decay:.4g}"),
                "train.warmup_steps": self.warmup_steps}


def plan(config: Optional[str | Path], overrides: list[tuple[str, str]], budgets: Sequence[float],
         sizes: int) -> list[Rung]:
    """`sizes` depths per budget around the size scaling.tokens_per_param predicts optimal (D = r·N at C = F(N)·D, F
    nanopt's FLOPs per token), each run's tokens from its budget at its own F, its batch, lr, weight decay and
    warm-up by the transfer rules from the config's own values with `overrides` (the reference): docs/scaling.md."""
    ref = load_config(config, overrides)
    t, rules = ref.train, ref.scaling
    unit = t.micro_batch_size * t.seq_len  # a batch is whole micro-batches
    ref_tokens = t.max_steps * t.global_batch_tokens

    @functools.cache
    def shape(depth: int) -> tuple[int, int, int]:  # (params, n_6n, flops per token), a meta model each
        model = meta_model(load_config(config, [*overrides, (KNOB, str(depth))]).model)
        counts = param_counts(model)
        return counts.total, counts.n_6n, token_flops(model, t.seq_len, ref.mfu.causal_halving).model

    rungs = []
    for budget in sorted(budgets):
        # The predicted optimum: the depth whose compute at r tokens per parameter is closest to the budget.
        gap = lambda d: abs(math.log(shape(d)[2] * rules.tokens_per_param * shape(d)[1] / budget))
        centre = 1
        while centre < MAX_DEPTH and gap(centre + 1) < gap(centre):
            centre += 1
        first = max(1, centre - (sizes - 1) // 2)  # an even count leans one size larger
        for depth in range(first, first + sizes):
            params, n_6n, per_token = shape(depth)
            tokens = budget / per_token
            batch = t.global_batch_tokens * (tokens / ref_tokens) ** rules.batch_exponent
            batch = max(unit, unit * round(batch / unit))
            steps = max(1, round(tokens / batch))
            lr = t.lr * (batch / t.global_batch_tokens) ** rules.lr_batch_exponent
            # AdamW's timescale 1/(lr·wd), in steps, stays the reference's fraction of the run.
            wd = (t.weight_decay * t.lr * t.max_steps / (lr * steps) if rules.weight_decay == "timescale"
                  else t.weight_decay)
            warmup = min(steps - 1, round(t.warmup_steps * steps / t.max_steps))
            rungs.append(Rung(budget, depth, params, n_6n, per_token, batch, steps, lr, wd, warmup))
    return rungs


def plan_text(rungs: Sequence[Rung]) -> str:
    rows = [(f"{r.budget:.3g}", str(r.depth), f"{r.params:,}", f"{r.tokens:,}", f"{r.tokens / r.n_6n:.1f}",
             str(r.steps), f"{r.batch_tokens:,}", f"{r.lr:.3g}", f"{r.weight_decay:.3g}", str(r.warmup_steps))
            for r in rungs]
    return table(("budget", "depth", "params", "tokens", "tokens/N", "steps", "batch", "lr", "wd", "warmup"), rows)


def points_file(rungs: Sequence[Rung]) -> dict[str, Any]:
    """The ladder as `nanopt sweep --points` reads it, each rung's figures beside."""
    return {"points": [{"name": r.name, "set": r.overrides()} for r in rungs],
            "rungs": [{**asdict(r), "tokens": r.tokens} for r in rungs]}


def check(fit_out: dict[str, Any], run_dir: Path, metric: str, params_key: str = "params") -> dict[str, Any]:
    """A run left out of the fit against what the fitted law predicts for its N and D."""
    s = load_run(run_dir).summary
    if not all(isinstance(s.get(k), (int, float)) for k in (PARAMS[params_key], "tokens_seen", metric)):
        raise ConfigError(f"{run_dir}: summary.json lacks {PARAMS[params_key]}, tokens_seen or {metric}; give a "
                          f"finished run of the ladder's config.")
    n = count(s, params_key)
    predicted = predict_loss({k: fit_out[k]["value"] for k in LAW_KEYS}, n, s["tokens_seen"])
    return {"run": str(run_dir), "params": n, "tokens": s["tokens_seen"], "actual": s[metric],
            "predicted": predicted, "error": predicted / s[metric] - 1}
