"""Weight averaging at a fixed step budget: the val bits-per-byte of a run's last weights, of the mean of its last K
checkpoints (LAWA, `nanopt average --last K`) and of its EMA (`train.ema_decay`), over seeds.

Averaging the checkpoints happens after training, so a race to a target cannot use it: here every run trains
exactly `--steps` optimizer steps instead, saving a checkpoint every `--every` steps, and each set of weights is
evaluated on the same validation batches. Three arms, each a whole `python -m nanopt.main` process per seed, one
at a time (`--parallel N`: N at once), the order rotating with the seed:

- `cosine`: the recipe (`--config`) as it is, its lr schedule ending at `--steps`;
- `constant`: the recipe without a decay phase (`train.schedule=constant`: WSD's warmup and stable part);
- `wsd`: the recipe with WSD's decay phase (`train.schedule=wsd`, `train.decay_fraction` the config's).

Each run is scored three ways with what `nanopt average` and `nanopt eval --weights` call (in this process): the
model's own last weights (`last`: what a run without EMA would evaluate, since keeping the average never changes
the training, tests/test_ema.py), the EMA of them (`ema`), and the mean of the last K checkpoints (`lawa K`, for
each K of `--last`). The comparisons each give mean ± sd per side, the difference and its 95% interval, the
one-sided Welch p that the first side is lower (experiments.welch, as `nanopt runs --compare`) and the seeds per
side the observed difference needs at p < 0.01 with 80% power (experiments.seeds_needed).

    python bench/averaging.py --data DIR --seeds 6
    python bench/averaging.py --data DIR --seeds 8 --steps 160 --every 10 --last 4,2 --json avg.json
        # --json keeps each finished seed: run again with more --seeds and only the new ones train

Step counts and bits per byte do not depend on the machine's load, so a shared machine is fine; the bench prints
no seconds.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import _common as C  # importing _common puts REPO on sys.path: nanopt from this checkout

from nanopt.config import load_config, parse_overrides  # noqa: E402
from nanopt.evals.checkpoint_eval import evaluate_checkpoint, Evaluator  # noqa: E402
from nanopt.lab.averaging import average_checkpoints  # noqa: E402
from nanopt.lab.runs import RECORD_ALPHA, seeds_needed, welch  # noqa: E402
from nanopt.training import checkpoint  # noqa: E402

ARMS = {"cosine": [], "constant": ["--train.schedule=constant"], "wsd": ["--train.schedule=wsd"]}
# --smoke: the recipe at toy width for 4 steps, a checkpoint every 2, one validation batch: the whole path in seconds.
SMOKE = {"steps": 4, "every": 2, "last": "2", "batches": 1}


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = C.parser(__file__, __doc__)
    p.add_argument("--config", default=str(C.REPO / "configs" / "speedrun-cpu.yaml"))
    p.add_argument("--data", default="", help="train on these prepared shards (data.source) instead of the config's")
    p.add_argument("--seeds", type=int, default=3, help="run.seed 0 .. N-1 (default 3)")
    p.add_argument("--steps", type=int, default=160, help="optimizer steps of every run (train.max_steps)")
    p.add_argument("--every", type=int, default=10, help="a checkpoint every this many steps (checkpoint.every)")
    p.add_argument("--last", default="4", help="comma list of K: average the last K checkpoints (default 4)")
    p.add_argument("--batches", type=int, default=32, help="validation micro-batches for every score (default 32)")
    p.add_argument("--threads", type=int, default=1, help="runtime.threads of every run and evaluation (default 1: "
                   "one core per run leaves a shared machine usable, and the bench measures no seconds)")
    p.add_argument("--parallel", type=int, default=1, help="arms of a seed trained at once, each a process of "
                   "--threads threads (default 1); the scores do not depend on it")
    p.add_argument("--json", type=Path, default=None, help="write every seed's scores here as each seed finishes; "
                   "the seeds already in it (same settings) are not trained again")
    p.add_argument("--smoke", action="store_true", help=f"{C.SMOKE_HELP}: one seed at toy width, "
                   f"{SMOKE['steps']} steps")
    a = p.parse_args(argv)
    if a.smoke:
        a.seeds, a.steps, a.every, a.last, a.batches = 1, *SMOKE.values()
    a.lasts = check_layout(a)
    return a


def check_layout(a: argparse.Namespace) -> list[int]:
    """The K of --last, each averaging 2 or more of the checkpoints the runs save; exit 2 naming the fix if not."""
    if min(a.seeds, a.steps, a.every, a.batches, a.threads, a.parallel) < 1:
        C.bad_input(__file__, f"--seeds ({a.seeds}), --steps ({a.steps}), --every ({a.every}), --batches "
                    f"({a.batches}), --threads ({a.threads}) and --parallel ({a.parallel}) must each be at least 1.")
    saved = len(range(a.every, a.steps + 1, a.every)) + (a.steps % a.every != 0)  # and the last step's
    try:
        lasts = [int(k) for k in a.last.split(",")]
    except ValueError:
        lasts = []
    if not lasts or any(k < 2 or k > saved for k in lasts) or len(set(lasts)) != len(lasts):
        C.bad_input(__file__, f"--last {a.last!r}: give distinct K from 2 to {saved}, comma separated (a run of "
                    f"{a.steps} steps with a checkpoint every {a.every} saves {saved}); e.g. --last 4,2, or save more "
                    f"often with a smaller --every.")
    return lasts


def settings(a: argparse.Namespace) -> dict[str, Any]:
    """What a seed's scores depend on: a --json file made with other settings is not reused."""
    return {"config": a.config, "data": a.data, "steps": a.steps, "every": a.every, "last": a.lasts,
            "batches": a.batches, "threads": a.threads, "smoke": a.smoke}


def common_overrides(a: argparse.Namespace) -> list[str]:
    out = [f"--data.source={a.data}"] if a.data else []
    out += [f"--train.max_steps={a.steps}", f"--checkpoint.every={a.every}", f"--checkpoint.keep={max(a.lasts)}",
            "--eval.every=0", "--eval.test_at_end=false"]  # the scores here are the only evaluations that count
    return [*out, *(C.TOY_RECIPE if a.smoke else []), f"--runtime.threads={a.threads}"]  # after TOY_RECIPE's


def train(config: str, overrides: list[str], seed: int, run_dir: Path) -> None:
    """One whole run, `overrides` last."""
    cmd = [sys.executable, "-m", "nanopt.main", "--config", config, f"--run.dir={run_dir}", f"--run.seed={seed}",
           "--checkpoint.resume=false", "--log.tensorboard=false", "--log.curves=false", "--sample.num_samples=0",
           *overrides]
    # PASSIVE: the runs share the cores with whatever else runs (docs/mfu.md "Speed and memory settings").
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(cmd, cwd=C.REPO, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")


def train_arms(a: argparse.Namespace, arms: list[str], seed: int, work: Path) -> None:
    """The arms' runs of one seed at once (one: as train alone), each into work/SEED-ARM; a failure exits."""
    def one(name: str) -> None:
        train(a.config, [*common_overrides(a), *ARMS[name]], seed, work / f"{seed}-{name}")

    with ThreadPoolExecutor(len(arms)) as pool:  # each thread only waits on its process
        list(pool.map(one, arms))  # re-raises the first failure's SystemExit here


def score(run_dir: Path, lasts: list[int], batches: int) -> dict[str, float]:
    """Val bpb of the run's last weights, of their EMA and of the mean of its last K checkpoints for each K, all on
    the same `batches` validation batches (`nanopt eval`'s line goes to stderr with the progress)."""
    newest = checkpoint.checkpoint_dirs(run_dir)[-1]
    todo = {"last": (newest, "model"), "ema": (newest, "ema")}
    for k in lasts:
        todo[f"lawa {k}"] = (average_checkpoints(run_dir, run_dir / f"lawa{k}", last=k), "model")
    out = {}
    with contextlib.redirect_stdout(sys.stderr):
        for name, (ckpt, weights) in todo.items():
            out[name] = evaluate_checkpoint(ckpt, Evaluator(batches=batches, weights=weights))["val_bpb"]
    return out


def contrasts(lasts: list[int]) -> list[tuple[str, tuple[str, str], tuple[str, str]]]:
    """(claim, (arm, weights) that should be lower, (arm, weights) it is tested against). Against the recipe's own
    figures (cosine, its EMA as it evaluates and its last weights) only the first K of --last: the one chosen first."""
    out = [("EMA vs none", ("cosine", "ema"), ("cosine", "last"))]
    for k in lasts:
        out += [(f"LAWA {k} vs none", ("cosine", f"lawa {k}"), ("cosine", "last")),
                (f"LAWA {k} vs EMA", ("cosine", f"lawa {k}"), ("cosine", "ema")),
                (f"constant + LAWA {k} vs WSD with decay", ("constant", f"lawa {k}"), ("wsd", "last"))]
    first = f"lawa {lasts[0]}"
    return [*out, ("constant + EMA vs WSD with decay", ("constant", "ema"), ("wsd", "last")),
            (f"constant + LAWA {lasts[0]} vs cosine + EMA", ("constant", first), ("cosine", "ema")),
            (f"constant + LAWA {lasts[0]} vs cosine", ("constant", first), ("cosine", "last"))]


def compare(scores: dict[str, dict[str, dict[str, float]]], lasts: list[int]) -> list[dict[str, Any]]:
    """Each contrast over the seeds: Welch's one-sided test that the first side is lower, and the seeds per side
    its observed difference needs (None where the first side is not lower, or n < 2)."""
    rows = []
    for claim, (arm_a, w_a), (arm_b, w_b) in contrasts(lasts):
        a = [seed[arm_a][w_a] for seed in scores.values()]
        b = [seed[arm_b][w_b] for seed in scores.values()]
        test = welch(a, b, "val_bpb", RECORD_ALPHA, (f"{arm_a} {w_a}", f"{arm_b} {w_b}"))
        need = None
        if test["testable"] and test["difference"] < 0:
            need = seeds_needed(statistics.stdev(a), statistics.stdev(b), test["difference"])
        rows.append({"claim": claim, **test, "seeds_needed": need})
    return rows


def _mean_sd(values: list[float]) -> str:
    return f"{statistics.fmean(values):.4f}" + (f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else "")


def report(scores: dict[str, dict[str, dict[str, float]]], rows: list[dict[str, Any]], a: argparse.Namespace) -> None:
    """The scores per arm (mean ± sd over the seeds), then each contrast."""
    columns = ["last", "ema", *(f"lawa {k}" for k in a.lasts)]
    print(f"val bpb after {a.steps} steps, mean ± sd over {len(scores)} seed(s) ({a.batches} validation batches; "
          f"lawa K: the mean of the checkpoints of the last {a.every}-step marks):\n")
    print(f"| arm | {' | '.join(columns)} |\n|---|{'---|' * len(columns)}")
    for arm in ARMS:
        print(f"| {arm} | {' | '.join(_mean_sd([s[arm][c] for s in scores.values()]) for c in columns)} |")
    print(f"\n| claim (A lower than B) | A | B | A - B (95% CI) | one-sided Welch p | seeds needed | p < "
          f"{RECORD_ALPHA:g} |\n|---|---|---|---|---|---|---|")
    for r in rows:
        ci = r["difference_ci95"]
        diff = f"{r['difference']:+.4f}" + (f" ({ci[0]:+.4f} to {ci[1]:+.4f})" if ci else "")
        p = f"{r['p']:.2g}" if r["testable"] else "n/a"
        need = r["seeds_needed"] or ("-" if r["testable"] else "n/a")
        print(f"| {r['claim']} | {r['a']['name']} | {r['b']['name']} | {diff} | {p} | {need} | "
              f"{'yes' if r['a_beats_b'] else 'no'} |")


def load_done(a: argparse.Namespace) -> dict[str, dict[str, dict[str, float]]]:
    """The seeds a --json file of the same settings already holds; exit 2 when it holds other settings."""
    if a.json is None or not a.json.is_file():
        return {}
    try:
        held = json.loads(a.json.read_text())
        same, scores = held["settings"] == settings(a), held["scores"]
    except (ValueError, KeyError, TypeError) as e:
        C.bad_input(__file__, f"--json {a.json} is not a file this bench wrote ({e}); give a new path.")
    if not same:
        C.bad_input(__file__, f"--json {a.json} holds seeds of other settings ({held['settings']}); give a new path "
                    f"or the settings it was made with.")
    return scores


def run_seeds(a: argparse.Namespace, scores: dict, work: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Each seed's scores per arm, reusing those given (from --json); the arms' order rotating with the seed."""
    for seed in range(a.seeds):
        if str(seed) in scores:
            continue
        names = list(ARMS)[seed % len(ARMS):] + list(ARMS)[: seed % len(ARMS)]
        scores[str(seed)] = {}
        for i in range(0, len(names), a.parallel):
            arms = names[i : i + a.parallel]
            train_arms(a, arms, seed, work)
            for name in arms:
                run_dir = work / f"{seed}-{name}"
                scores[str(seed)][name] = score(run_dir, a.lasts, a.batches)
                shutil.rmtree(run_dir, ignore_errors=True)
                shown = ", ".join(f"{k} {v:.4f}" for k, v in scores[str(seed)][name].items())
                C.progress(f"seed {seed} | {name}: {shown}")
        if a.json:
            a.json.write_text(json.dumps({"settings": settings(a), "scores": scores}, indent=2))
    return {seed: scores[seed] for seed in map(str, range(a.seeds))}


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    C.check_overrides(__file__, a.config, ARMS, common_overrides(a))
    if not load_config(a.config, parse_overrides(common_overrides(a))).train.ema_decay:
        C.bad_input(__file__, f"{a.config} keeps no EMA (train.ema_decay is 0), and every run is scored on its EMA "
                    f"too; give a config with train.ema_decay above 0 (configs/speedrun-cpu.yaml has 0.95).")
    done = load_done(a)
    C.banner("Weight averaging at a fixed step budget: val bpb of last, EMA and LAWA weights", {
        "config": a.config, "data": a.data or "the config's", "runs": f"{len(ARMS)} arms x {a.seeds} seed(s), "
        f"{a.steps} steps, a checkpoint every {a.every}, LAWA of the last {a.last}" + (" at toy size (--smoke)"
                                                                                      if a.smoke else "")
        + (f", {a.parallel} runs at once" if a.parallel > 1 else "")},
        C.command(__file__, argv))
    work = Path(tempfile.mkdtemp(prefix="nanopt-averaging-"))
    try:
        scores = run_seeds(a, done, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(scores, compare(scores, a.lasts), a)


if __name__ == "__main__":
    main()
