"""µP transfer: the best learning rate across 8x width, under the standard parametrization (sp) and µP (mup).

Each width is the model family at `--depth` layers with 16-wide heads (model.depth, model.aspect_ratio = width /
depth; docs/scaling.md), trained with AdamW for `--steps` steps on the config's data (default the embedded
Shakespeare of configs/tiny.yaml) at every lr of a factor-2 grid, for each seed: one whole `python -m nanopt.main`
process per run, `--parallel` at a time, each on one thread. mup's base width is the narrowest, where mup is sp bit for
bit (tests/test_mup.py), so that width's runs serve both. A run that diverges (exit 3) scores inf.

Per parametrization and width it reports the best lr: for each seed the grid's argmin of the final val bits per byte,
refined by a parabola in log2(lr) through it and its neighbours; the geometric mean over seeds and the seeds'
range (the spread). Then how far the best lr moves from the narrowest width to the widest, in factor-2 grid steps,
and a plot (--plot) of val bpb against lr, one curve per width, a panel per parametrization.

    python bench/mup_transfer.py --json mup.json --plot mup.png      # 4 widths x 9 lrs x 3 seeds, sp and mup
    python bench/mup_transfer.py --seeds 5 --json mup.json           # --json keeps finished runs: only new ones run
    python bench/mup_transfer.py --smoke

Size: 189 runs (widths 32-256 x 9 lrs x 3 seeds x sp and mup, the base width's shared), 200 steps of 1024 tokens
(205k tokens: val bpb ~3.7 at a good lr, well past the bytes' unigram ~4.4). Measured one at a time on 2 cores that
other work kept at load ~3.5 (Intel Xeon with AMX; fp32): a run takes ~7 s at width 32, 9 s at 64, ~17 s at 128 and
37 s at 256 (~5 s of each is the process's start, data and evaluation), so one seed's 63 runs take ~1,200 s of one
core (9 lrs × (7 + 2 × (9 + 17 + 37)) s) and the whole bench, 2 at a time, about 3 × 1,200 / 2 s ≈ 30 minutes.
--smoke: 2 widths x 2 lrs x 1 seed at 2 steps (6 runs), 35 s on the same loaded machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import _common as C  # importing _common puts REPO on sys.path: nanopt from this checkout

from nanopt import rundirs  # noqa: E402
from nanopt.config import comma_list  # noqa: E402

PARAMETRIZATIONS = ("sp", "mup")
WIDTHS = "32,64,128,256"
LRS = ",".join(f"2^{e}" for e in range(-12, -3))  # 2.4e-4 .. 6.25e-2
HEAD_DIM = 16  # heads of 16: width 32 has 2 heads, 256 has 16
TOKENS = 1024  # per optimizer step: 16 rows of 64
DIVERGED = 3  # nanopt's exit code for a diverged run


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = C.parser(__file__, __doc__)
    p.add_argument("--config", default=str(C.REPO / "configs" / "tiny.yaml"))
    p.add_argument("--widths", default=WIDTHS, help=f"comma list (default {WIDTHS}); the first is mup's base")
    p.add_argument("--lrs", default=LRS, help="comma list of peak lrs, 2^E or a number (default 2^-12 .. 2^-4)")
    p.add_argument("--depth", type=int, default=2, help="layers of every width (default 2)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of every run (default 200)")
    p.add_argument("--seeds", type=int, default=3, help="run.seed 0 .. N-1 (default 3)")
    p.add_argument("--parallel", type=int, default=2, help="runs at once, one thread each (default 2)")
    p.add_argument("--json", type=Path, default=None, help="every run's val bpb; runs it already holds are reused")
    p.add_argument("--plot", type=Path, default=None, help="write the lr curves here (PNG)")
    p.add_argument("--smoke", action="store_true", help=f"{C.SMOKE_HELP}: widths 32,64, lrs 2^-8,2^-6, 1 seed, "
                   "2 steps")
    a = p.parse_args(argv)
    if a.smoke:
        a.widths, a.lrs, a.seeds, a.steps = "32,64", "2^-8,2^-6", 1, 2
    try:
        a.width_list = [int(w) for w in comma_list(a.widths)]
        a.lr_list = sorted(2.0 ** float(x[2:]) if x.startswith("2^") else float(x) for x in comma_list(a.lrs))
    except ValueError:
        C.bad_input(__file__, f"--widths {a.widths!r} and --lrs {a.lrs!r} are comma lists of integers and of numbers "
                    f"(2^-8 or 0.004), e.g. --widths 32,64,128,256 --lrs 2^-10,2^-8,2^-6.")
    if min(a.depth, a.steps, a.seeds, a.parallel) < 1 or len(a.width_list) < 2 or any(
            w % (HEAD_DIM * a.depth) for w in a.width_list):
        C.bad_input(__file__, f"--depth, --steps, --seeds and --parallel are at least 1, and --widths names 2 or more "
                    f"widths, each a multiple of {HEAD_DIM} × depth = {HEAD_DIM * a.depth} (whole heads of "
                    f"{HEAD_DIM}); got --widths {a.widths}, --depth {a.depth}.")
    return a


def overrides(a: argparse.Namespace, parametrization: str, width: int, lr: float) -> list[str]:
    """One run's keys: the family at this width, AdamW at this lr on every kind (µP scales the hidden ones)."""
    base = a.width_list[0]
    mup = [f"--model.parametrization={parametrization}"] + ([f"--model.mup_base_dim={base}"]
                                                            if parametrization == "mup" else [])
    return [f"--model.depth={a.depth}", f"--model.aspect_ratio={width // a.depth}",
            f"--model.depth_head_dim={HEAD_DIM}", *mup, "--optim.name=adamw", f"--train.lr={lr!r}",
            *(f"--optim.{kind}_lr=null" for kind in ("matrix", "embedding", "head", "scalar")),
            f"--train.max_steps={a.steps}", "--train.seq_len=64", "--train.micro_batch_size=16",
            f"--train.global_batch_tokens={TOKENS}", f"--train.warmup_steps={max(1, a.steps // 10)}",
            f"--eval.every={a.steps}", "--eval.batches=8", "--eval.test_at_end=false", "--runtime.threads=1"]


def run_once(config: str, args: list[str], seed: int, run_dir: Path) -> float:
    """One whole run; its final val bpb, inf when it diverged."""
    cmd = [sys.executable, "-m", "nanopt.main", "--config", config, f"--run.dir={run_dir}", f"--run.seed={seed}",
           "--checkpoint.resume=false", "--log.tensorboard=false", "--log.curves=false", "--sample.num_samples=0",
           *args]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}  # the runs share the cores
    proc = subprocess.run(cmd, cwd=C.REPO, capture_output=True, text=True, env=env)
    try:
        if proc.returncode == DIVERGED:
            return math.inf
        if proc.returncode:
            sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
        bpb = (rundirs.read_summary(run_dir) or {}).get("final_val_bpb")
        return math.inf if bpb is None or not math.isfinite(bpb) else float(bpb)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def run_key(parametrization: str, width: int, lr: float, seed: int) -> str:
    return f"{parametrization} {width} {lr!r} {seed}"


def settings(a: argparse.Namespace) -> dict:
    """What a run's score depends on besides its key: a --json made with other settings is not reused."""
    return {"config": a.config, "depth": a.depth, "steps": a.steps, "base": a.width_list[0]}


def load_done(a: argparse.Namespace) -> dict[str, float]:
    if a.json is None or not a.json.is_file():
        return {}
    try:
        held = json.loads(a.json.read_text())
        same, runs = held["settings"] == settings(a), {k: float(v) for k, v in held["runs"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        C.bad_input(__file__, f"--json {a.json} is not a file this bench wrote ({e}); give a new path.")
    if not same:
        C.bad_input(__file__, f"--json {a.json} holds runs of other settings ({held['settings']}); give a new path.")
    return runs


def run_all(a: argparse.Namespace, done: dict[str, float], work: Path) -> dict[str, float]:
    """Every (parametrization, width, lr, seed) run not in `done`; mup at the base width is sp's run."""
    base = a.width_list[0]
    todo = [(p, w, lr, s) for s in range(a.seeds) for w in a.width_list for lr in a.lr_list for p in PARAMETRIZATIONS
            if not (p == "mup" and w == base) and run_key(p, w, lr, s) not in done]
    runs = dict(done)

    def one(i: int) -> None:
        p, w, lr, s = todo[i]
        bpb = run_once(a.config, overrides(a, p, w, lr), s, work / str(i))
        runs[run_key(p, w, lr, s)] = bpb
        C.progress(f"[{len(runs) - len(done)}/{len(todo)}] {p} width {w} lr {lr:.3g} seed {s}: val bpb {bpb:.4f}")
        if a.json:
            a.json.write_text(json.dumps({"settings": settings(a), "runs": runs}, indent=1))

    with ThreadPoolExecutor(a.parallel) as pool:  # each thread only waits on its process
        list(pool.map(one, range(len(todo))))  # re-raises the first failure's SystemExit here
    for w in a.width_list:
        for lr in a.lr_list:
            for s in range(a.seeds):
                runs.setdefault(run_key("mup", w, lr, s), runs[run_key("sp", w, lr, s)])  # the base width: shared
    return runs


def best_log2_lr(lrs: list[float], bpbs: list[float]) -> float:
    """log2 of the lr of least bpb on the grid, moved to the vertex of the parabola through it and its two
    neighbours (within half a grid step either way) when both are finite."""
    xs = [math.log2(lr) for lr in lrs]
    i = min(range(len(bpbs)), key=bpbs.__getitem__)
    if 0 < i < len(xs) - 1 and math.isfinite(bpbs[i - 1]) and math.isfinite(bpbs[i + 1]):
        curvature = bpbs[i - 1] - 2 * bpbs[i] + bpbs[i + 1]
        if curvature > 0:
            step = (xs[i + 1] - xs[i - 1]) / 2
            return xs[i] + max(-0.5, min(0.5, 0.5 * (bpbs[i - 1] - bpbs[i + 1]) / curvature)) * step
    return xs[i]


def optima(a: argparse.Namespace, runs: dict[str, float]) -> dict[str, dict[int, dict]]:
    """Per parametrization and width: each seed's best log2 lr, their mean, range, and the best mean bpb."""
    out: dict[str, dict[int, dict]] = {}
    for p in PARAMETRIZATIONS:
        out[p] = {}
        for w in a.width_list:
            curves = [[runs[run_key(p, w, lr, s)] for lr in a.lr_list] for s in range(a.seeds)]
            seeds = [best_log2_lr(a.lr_list, c) for c in curves]
            mean = [statistics.mean(col) for col in zip(*curves)]
            out[p][w] = {"seeds": seeds, "log2": statistics.mean(seeds), "low": min(seeds), "high": max(seeds),
                         "curve": mean, "best_bpb": min(mean)}
    return out


def report(a: argparse.Namespace, best: dict[str, dict[int, dict]]) -> None:
    grid_step = math.log2(a.lr_list[1] / a.lr_list[0])
    print(f"| parametrization | width | best lr (geometric mean over {a.seeds} seed(s)) | seeds' range | "
          f"val bpb at the best grid lr (mean) |\n|---|---|---|---|---|")
    for p, widths in best.items():
        for w, b in widths.items():
            print(f"| {p} | {w} | {2 ** b['log2']:.3g} | {2 ** b['low']:.3g} - {2 ** b['high']:.3g} | "
                  f"{b['best_bpb']:.4f} |")
    print()
    narrow, wide = a.width_list[0], a.width_list[-1]
    for p, widths in best.items():
        moved = (widths[wide]["log2"] - widths[narrow]["log2"]) / grid_step
        print(f"{p}: the best lr moves {moved:+.2f} grid steps (x{2 ** (moved * grid_step):.3g}) from width {narrow} "
              f"to {wide} ({wide // narrow}x)")


def plot(a: argparse.Namespace, best: dict[str, dict[int, dict]], out: Path) -> None:
    """val bpb against lr, one curve per width, a panel per parametrization; each width's best lr marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(best), sharey=True)
    for ax, (p, widths) in zip(axes, best.items()):
        for w, b in widths.items():
            finite = [(lr, y) for lr, y in zip(a.lr_list, b["curve"]) if math.isfinite(y)]  # diverged: left out
            if finite:
                line, = ax.plot(*zip(*finite), marker="o", ms=3, label=f"width {w}")
                ax.axvline(2 ** b["log2"], color=line.get_color(), ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{p}: val bpb after {a.steps} steps (mean of {a.seeds} seed(s)); dotted: best lr", fontsize=10)
        ax.set_xlabel("peak lr (train.lr)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("final val bits per byte")
    fig.suptitle(f"{C.command(__file__, None)} | {C.cpu_model()}", fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    table = {f"{p} {w}": overrides(a, p, w, a.lr_list[0]) for p in PARAMETRIZATIONS for w in a.width_list}
    C.check_overrides(__file__, a.config, table, [])
    done = load_done(a)
    n = len(a.width_list) * len(a.lr_list) * a.seeds * 2 - len(a.lr_list) * a.seeds
    C.banner("µP transfer: the best lr across width, sp and mup", {
        "config": a.config, "widths": f"{a.widths} (mup's base {a.width_list[0]}), depth {a.depth}, heads of "
        f"{HEAD_DIM}", "lrs": ", ".join(f"{lr:.3g}" for lr in a.lr_list),
        "runs": f"{n} ({a.seeds} seed(s), {a.steps} steps of {TOKENS} tokens, {a.parallel} at once, {len(done)} reused)"
        + (" at toy size (--smoke)" if a.smoke else "")}, C.command(__file__, argv))
    work = Path(tempfile.mkdtemp(prefix="nanopt-mup-"))
    try:
        runs = run_all(a, done, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = optima(a, runs)
    report(a, best)
    if a.plot:
        plot(a, best, a.plot)
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
