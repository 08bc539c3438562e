"""Pictures of runs, from their files: curves.png at the end of every run, `nanopt plot`'s overlays, the profiled
run's offline profile.html, and (figure()) the scaling fit's.

matplotlib is imported inside figure() (the XLA test environment does not install it), through its object API
with the Agg canvas only: nothing here touches pyplot's global state. Inside a training run the *_quietly helpers
draw: a picture that cannot be drawn is a log line, never a failed run.
"""
from __future__ import annotations

import base64
import html
import io
import itertools
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from nanopt import rundirs
from nanopt.errors import ConfigError
from nanopt.io import finite, is_int, is_number, write_bytes, write_text
from nanopt.rundirs import CURVES_FILE, METRICS_FILE, PROFILE_FILE

log = logging.getLogger("nanopt")
# matplotlib logs "generated new fontManager" at INFO the first time it builds its font cache: noise in a run's log.
logging.getLogger("matplotlib").setLevel(logging.WARNING)

PROFILE_PAGE = "profile.html"
X_AXES = ("steps", "tokens", "seconds")
X_LABELS = {"steps": "optimizer step", "tokens": "tokens seen",
            "seconds": "training seconds (sum of logged step times)"}

Record = dict[str, Any]


# ---------------------------------------------------------------- reading runs
def stepped_records(run_dir: Path) -> list[Record]:
    return [r for r in rundirs.read_metrics(run_dir) if is_int(r.get("step"))]


def runs_to_plot(paths: list[str | Path]) -> list[Path]:
    """Run directories at or below each path, in order, each once."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise ConfigError(f"{p} is not a directory; give run directories (runs/<name>, holding {METRICS_FILE}) "
                              f"or a sweep directory that holds them.")
        runs = rundirs.walk_runs(p)
        if not runs:
            raise ConfigError(f"{p} holds no run: no run directory (one with {rundirs.CONFIG_FILE} or "
                              f"{METRICS_FILE}) in it or below it. Give a run directory (runs/<name>) or a sweep "
                              f"directory of runs.")
        found += [r for r in runs if r not in found]
    return found


def run_labels(runs: list[Path]) -> list[str]:
    """Each run named by its path relative to what all of them share (runs/a, runs/b -> a, b)."""
    resolved = [r.resolve() for r in runs]
    common = Path(os.path.commonpath(resolved))
    # A run that holds the others (or the only run) is the common path itself: called by its own name, not ".".
    return [r.name if r == common else str(r.relative_to(common)) for r in resolved]


def _seconds_axis(records: list[Record]) -> tuple[list[float], list[float]]:
    """(steps, training seconds at them): each logged step time times the steps since the previous log line.
    Not wall time, which would bill evaluations, checkpoints and the gap before a resume."""
    steps, seconds = [0.0], [0.0]
    for r in records:
        if (step_ms := finite(r.get("step_ms"))) is not None and r["step"] > steps[-1]:
            seconds.append(seconds[-1] + (r["step"] - steps[-1]) * step_ms / 1000)
            steps.append(float(r["step"]))
    return steps, seconds


def series(records: list[Record], metric: str, x: str) -> tuple[list[float], list[float]]:
    tokens_per_step = next((tokens / r["step"] for r in records
                            if (tokens := finite(r.get("tokens_seen"))) and r["step"] > 0), 0.0)
    at_steps, at_seconds = _seconds_axis(records)
    xs, ys = [], []
    for r in records:
        if (value := finite(r.get(metric))) is None:
            continue
        if x == "steps":
            xs.append(float(r["step"]))
        elif x == "tokens":  # test lines carry no tokens_seen
            xs.append(t if (t := finite(r.get("tokens_seen"))) is not None else r["step"] * tokens_per_step)
        else:  # eval records carry the training clock; step records give it summed from their step times
            xs.append(s if (s := finite(r.get("train_seconds"))) is not None
                      else float(np.interp(r["step"], at_steps, at_seconds)))
        ys.append(value)
    return xs, ys


# ---------------------------------------------------------------- matplotlib, lazily
def have_matplotlib() -> bool:
    try:  # an import, not find_spec: a matplotlib that is installed but broken counts as absent
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def figure(width: float, height: float, *grid: int, margins: dict[str, float], **kw: Any) -> tuple[Any, Any]:
    """A Figure on the Agg canvas, not registered with pyplot (no global state, no GUI, freed when dropped), and
    its axes (fig.subplots(*grid)). Margins are set by hand: constrained layout doubled the drawing time at the
    end of every run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(*grid, **kw)
    fig.subplots_adjust(**margins)
    return fig, axes


def png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _plot(ax: Any, xs: list[float], ys: list[float], label: str, eval_line: bool = False, **kw: Any) -> None:
    """A line; evaluation series (few points) get markers so a single final evaluation still shows."""
    if xs:
        ax.plot(xs, ys, label=label, marker="o" if eval_line else None, markersize=4, linewidth=1.5, **kw)


# ---------------------------------------------------------------- curves.png
def curves_png(run_dir: Path) -> Path:
    """One PNG: train and val loss against steps, tokens and training seconds; MFU, tokens/s and lr by step."""
    run_dir = Path(run_dir)
    records = stepped_records(run_dir)
    if not records:
        raise ConfigError(f"{run_dir / METRICS_FILE} has no records to plot; train the run first.")
    fig, axes = figure(15, 8, 2, 3, margins=dict(left=0.05, right=0.99, bottom=0.07, top=0.93, wspace=0.22,
                                                  hspace=0.25))
    for ax, x in zip(axes[0], X_AXES):
        _plot(ax, *series(records, "loss", x), "train loss", color="tab:blue")
        _plot(ax, *series(records, "val_loss", x), "val loss", eval_line=True, color="tab:orange")
        ax.set(xlabel=X_LABELS[x], ylabel="loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    for ax, (metric, name, scale) in zip(axes[1], (("mfu", "MFU (%)", 100), ("tokens_per_s", "tokens/s", 1),
                                                    ("lr", "learning rate", 1))):
        xs, ys = series(records, metric, "steps")
        _plot(ax, xs, [scale * v for v in ys], name, color="tab:green")
        ax.set(xlabel=X_LABELS["steps"], ylabel=name)
        ax.grid(alpha=0.3)
        if not xs:  # e.g. MFU on a device with no known peak: say so rather than leave a blank box
            ax.text(0.5, 0.5, f"no {name} values logged", ha="center", va="center", transform=ax.transAxes)
    # Any number, NaN included: a run whose loss diverged says so in its title.
    final = next((r for r in reversed(records) if is_number(r.get("val_loss"))), None)
    fig.suptitle(run_dir.resolve().name + (f"  |  final val loss {final['val_loss']:.4f} at step {final['step']}"
                                           if final else ""))
    return write_bytes(run_dir / CURVES_FILE, png(fig))


# ---------------------------------------------------------------- nanopt plot: runs overlaid
def plot_runs(paths: list[str | Path], out: Path, metric: str = "val_loss", x: str = "steps",
              force: bool = False) -> Path:
    """`nanopt plot`: a line per run at or below `paths`, in the PNG `out` (checked before any run is read; replaced
    only with `force`: the default name is the same for every plot of a metric)."""
    out = Path(out)
    if not have_matplotlib():
        raise ConfigError("nanopt plot draws with matplotlib, which is not installed; pip install matplotlib.")
    if out.suffix.lower() != ".png":
        raise ConfigError(f"-o {out} must name a .png file.")
    rundirs.refuse_inside_checkpoints(out, "-o")
    if out.is_dir():
        raise ConfigError(f"-o {out} is a directory; give a file name, e.g. -o {out / 'plot.png'}.")
    if not out.parent.is_dir():
        raise ConfigError(f"-o {out}: the directory {out.parent} does not exist; create it or write elsewhere.")
    if (out.exists() or out.is_symlink()) and not force:
        raise ConfigError(f"{out} already exists (an earlier plot?) and is kept; name another file with -o, or add "
                          f"--force to replace it.")
    runs = runs_to_plot(paths)
    per_run = [stepped_records(r) for r in runs]
    lines = [series(records, metric, x) for records in per_run]
    if not any(xs for xs, _ in lines):
        available = sorted({k for records in per_run for r in records for k, v in r.items()
                            if is_number(v) and k not in ("step", "time")})
        raise ConfigError(f"no run logged {metric!r}; pick --metric from: {', '.join(available) or '(none)'}.")
    fig, ax = figure(10, 6, margins=dict(left=0.08, right=0.98, bottom=0.09, top=0.94))
    for (xs, ys), label in zip(lines, run_labels(runs)):
        _plot(ax, xs, ys, label, eval_line=len(xs) < 30)
    ax.set(xlabel=X_LABELS[x], ylabel=metric, title=f"{metric} against {x}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return write_bytes(out, png(fig))  # an OSError (not writable, the disk full) is the CLI's paragraph naming it


# ---------------------------------------------------------------- the offline profile page
_SHARES = (("compute_share", "compute", "#4c72b0"), ("data_loader_share", "data loader", "#dd8452"),
           ("host_overhead_share", "host overhead", "#c44e52"))


def profile_png(summary: dict) -> bytes:
    """The step breakdown (one stacked bar of the three shares) above the top ops' self ms per step."""
    fig, (top, bottom) = figure(10, 6, 2, 1, height_ratios=(1, 4),
                                 margins=dict(left=0.36, right=0.97, bottom=0.09, top=0.86, hspace=0.6))
    shares = [summary[key] for key, _, _ in _SHARES]
    for (_, name, colour), share, start in zip(_SHARES, shares, itertools.accumulate(shares, initial=0.0)):
        top.barh([0], [100 * share], left=[100 * start], color=colour, label=f"{name} {100 * share:.1f}%")
    top.set(xlim=(0, 100), yticks=[], xlabel="% of profiled step time")
    top.set_title(f"steps {summary.get('first_step')}-{summary.get('last_step')}: {summary['step_ms_mean']:.1f} "
                  f"ms/step ({summary['mode']})", pad=28)
    top.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    ops = summary.get("top_ops", [])
    steps = max(1, summary.get("profiled_steps", 1))
    names = [op["name"] if len(op["name"]) <= 48 else op["name"][:47] + "…" for op in ops]  # the table has them whole
    rows = list(range(len(ops)))[::-1]  # positions, not names: two names may shorten to the same label
    bottom.barh(rows, [op["self_ms"] / steps for op in ops], color="#4c72b0")
    bottom.set(yticks=rows, yticklabels=names, xlabel="self ms per step", title="top ops by self time")
    bottom.tick_params(axis="y", labelsize=8)
    return png(fig)


def mib(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def profile_html(summary: dict, picture: Optional[bytes]) -> str:
    """A page that opens offline: inline CSS, the picture as a base64 data: URI, the top ops as a table."""
    esc = html.escape
    steps = max(1, summary.get("profiled_steps", 1))
    facts = [("profiled steps", f"{summary.get('first_step')}-{summary.get('last_step')} ({steps} steps)"),
             ("step time", f"{summary['step_ms_mean']:.2f} ms/step ({summary['mode']})"),
             *((name, f"{100 * summary[key]:.1f}%") for key, name, _ in _SHARES),
             ("peak memory", mib(summary.get("peak_memory_bytes"))),
             ("trace", str(summary.get("trace_file")))]
    fact_rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts)
    op_rows = "".join(
        f"<tr><td>{esc(op['name'])}</td><td>{op['calls']}</td><td>{op['self_ms']:.2f}</td>"
        f"<td>{op['self_ms'] / steps:.2f}</td><td>{100 * op['self_share']:.1f}%</td>"
        f"<td>{op.get('self_cpu_ms', 0.0):.2f}</td></tr>" for op in summary.get("top_ops", []))
    label_rows = "".join(f"<tr><td>{esc(k)}</td><td>{v:.2f}</td></tr>" for k, v in summary.get("label_ms", {}).items())
    image = (f'<img alt="step breakdown and top ops" src="data:image/png;base64,{base64.b64encode(picture).decode()}">'
             if picture else "<p><em>No picture: matplotlib is not installed (pip install matplotlib).</em></p>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>nanopt profile</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: left; }}
td:not(:first-child) {{ text-align: right; font-variant-numeric: tabular-nums; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>Where the profiled steps' time went</h1>
<table>{fact_rows}</table>
{image}
<h2>Top ops by self time</h2>
<table><tr><th>op</th><th>calls</th><th>self ms</th><th>self ms/step</th><th>share of step time</th>
<th>self CPU ms</th></tr>{op_rows}</table>
<h2>Host time inside each range (ms)</h2>
<table>{label_rows}</table>
<p>From {PROFILE_FILE}. This page needs no network: TensorBoard's PyTorch Profiler tab loads Google
Charts from gstatic and shows nothing on an offline machine. The full trace (above) also opens offline in
Chrome's chrome://tracing.</p>
</body></html>
"""


def profile_page(summary: dict, out: Path) -> Path:
    """profile.html for a profile summary (without matplotlib: no picture, a line saying so)."""
    return write_text(Path(out), profile_html(summary, profile_png(summary) if have_matplotlib() else None))


# ---------------------------------------------------------------- inside a training run: never fatal
def _quietly(what: str, needs_matplotlib: bool, draw: Callable[[], Path]) -> Optional[Path]:
    if needs_matplotlib and not have_matplotlib():
        log.info("%s skipped: matplotlib is not installed", what)
        return None
    try:
        return draw()
    except Exception as e:  # a picture must never fail a run that trained
        log.warning("%s could not be drawn (%r); the run itself is fine", what, e)
        return None


def curves_quietly(run_dir: Path) -> Optional[Path]:
    return _quietly(CURVES_FILE, True, lambda: curves_png(run_dir))


def profile_page_quietly(summary: dict, run_dir: Path) -> Optional[Path]:
    return _quietly(PROFILE_PAGE, False, lambda: profile_page(summary, Path(run_dir) / PROFILE_PAGE))
