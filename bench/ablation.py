"""Steps and seconds to a target val bits-per-byte for the speedrun recipe and each of its parts.

Every variant is the recipe (`--config`, default configs/speedrun-cpu.yaml) with a few overrides: one option
turned off (or on, if the recipe leaves it off), the MLP swapped, and AdamW in place of Muon at several
learning rates and schedule lengths (every kind at `train.lr`; Muon's goal is measured against the best of those).
Each variant runs `--seeds` times as a whole `python -m nanopt.main` process with `train.stop_at_target`, the variants
alternating within each seed, and the table gives mean ± half-range of the optimizer steps and of the
training seconds (`train_seconds_to_target`: steps only, no start-up or evaluation) to the target, and Welch's p
that each variant's mean is the recipe's.

    python bench/ablation.py --target-bpb 2.70
    python bench/ablation.py --target-bpb 2.70 --seeds 5 --only "recipe,adamw lr 2e-3 450 steps"
    python bench/ablation.py --target-bpb 2.70 --variant "wide=--model.dim=256 --model.n_heads=8"
    python bench/ablation.py --target-bpb 2.8654 --data DIR --eval-every 10 --only recipe,+residual_scalars
        # on text prepared elsewhere (e.g. the Vim docs as bench/vs_nanogpt.py --work W prepares them), finer clock

The target: nanoGPT's final val loss on the embedded corpus, which `bench/vs_nanogpt.py` prints in bits
per byte. Every variant's overrides are checked against the config before the first run: a misspelt key is exit 2
at once, not an hour in.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import _common as C  # importing _common puts REPO on sys.path: nanopt from this checkout
import yaml
from scipy import stats

from nanopt import rundirs  # noqa: E402

ADAMW_LRS = ("1e-3", "2e-3", "4e-3")
# --smoke: the recipe at toy width for at most 2 steps, validated at every step: with a --target-bpb above any
# loss a run stops at its first validation, and the bench's whole path runs in seconds.
SMOKE = ["--train.max_steps=2", *C.TOY_RECIPE, "--eval.every=1", "--eval.batches=1"]


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = C.parser(__file__, __doc__)
    p.add_argument("--config", default=str(C.REPO / "configs" / "speedrun-cpu.yaml"))
    p.add_argument("--target-bpb", type=float, required=True, help="val bits per byte to race to")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--only", default="", help="comma list of variant names to run (default: all)")
    p.add_argument("--variant", action="append", default=[], help='extra "name=--key=value --key=value"')
    p.add_argument("--data", default="", help="train on these prepared shards (data.source) instead of the config's")
    p.add_argument("--eval-every", type=int, default=0, help="eval.every for every run (0: the config's); the "
                   "steps to the target are multiples of it")
    p.add_argument("--json", type=Path, default=None, help="also write every run's result here")
    p.add_argument("--smoke", action="store_true", help=f"{C.SMOKE_HELP}: one seed of the chosen variants (default "
                   "the recipe) at toy width, stopping at the first validation that meets the target")
    return p.parse_args(argv)


def variants(config: str, extra: list[str]) -> dict[str, list[str]]:
    """name -> overrides of the recipe. Boolean options flip; AdamW gets a small grid of lr x schedule length."""
    raw = yaml.safe_load(Path(config).read_text())
    model, train = raw.get("model", {}), raw.get("train", {})
    out: dict[str, list[str]] = {"recipe": []}
    for key in ("qk_norm", "value_embeddings", "residual_scalars"):
        on = bool(model.get(key, False))
        out[f"{'no ' if on else '+'}{key}"] = [f"--model.{key}={str(not on).lower()}"]
    if model.get("logit_softcap", 0):
        out["no logit_softcap"] = ["--model.logit_softcap=0"]
    # The other MLP at the same parameter count: SwiGLU has 3 matrices to ReLU²'s 2.
    if model.get("mlp", "swiglu") == "relu2":
        out["swiglu mlp"] = ["--model.mlp=swiglu", f"--model.ffn_dim={int(model['ffn_dim']) * 2 // 3}"]
    else:
        out["relu2 mlp"] = ["--model.mlp=relu2", f"--model.ffn_dim={int(model['ffn_dim']) * 3 // 2}"]
    steps = int(train["max_steps"])
    for lr in ADAMW_LRS:  # AdamW needs longer schedules than Muon: 1.5x and 2x the recipe's
        for length in (steps * 3 // 2, steps * 2):
            out[f"adamw lr {lr} {length} steps"] = [  # no comma: --only splits on commas
                "--optim.name=adamw", f"--train.lr={lr}", "--optim.matrix_lr=null", "--optim.embedding_lr=null",
                "--optim.head_lr=null", "--optim.scalar_lr=null", f"--train.max_steps={length}"]
    for v in extra:
        name, _, args = v.partition("=")
        if not name.strip() or "," in name or not args.strip():
            C.bad_input(__file__, f"--variant {v!r} is not NAME=OVERRIDES with a name free of commas (--only splits "
                        'on them) and at least one override, e.g. --variant "wide=--model.dim=256 --model.n_heads=8".')
        out[name] = args.split()
    return out


def choose(table: dict[str, list[str]], only: str) -> dict[str, list[str]]:
    """The variants --only names (all when empty), in the table's order; an unknown name is exit 2."""
    if not only:
        return table
    wanted = [name.strip() for name in only.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in table]
    if unknown:
        verb = "is" if len(unknown) == 1 else "are"
        C.bad_input(__file__, f"--only names {', '.join(map(repr, unknown))}, which {verb} not a variant of this "
                    f"config; the variants are {', '.join(map(repr, table))} (plus any you add with --variant "
                    '"NAME=--key=value ..."). Quote a name that has spaces: --only "recipe,no qk_norm".')
    return {name: args for name, args in table.items() if name in wanted}


def run_once(config: str, overrides: list[str], target: float, seed: int, run_dir: Path) -> dict:
    """One whole run to the target; `overrides` last, so a variant's own keys win over the bench's."""
    cmd = [sys.executable, "-m", "nanopt.main", "--config", config, f"--run.dir={run_dir}", f"--run.seed={seed}",
           f"--train.target_val_bpb={target}", "--train.stop_at_target=true", "--checkpoint.resume=false",
           "--log.tensorboard=false", "--sample.num_samples=0", *overrides]
    proc = subprocess.run(cmd, cwd=C.REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    s = rundirs.read_summary(run_dir)
    if s is None:
        sys.exit(f"{' '.join(cmd)} exited 0 but wrote no {rundirs.SUMMARY_FILE} in {run_dir}")
    return {"reached": s["target_reached"], "steps": s["step_to_target"], "seconds": s["train_seconds_to_target"],
            "final_val_bpb": s.get("final_val_bpb"), "max_steps": s.get("steps")}


def cell(rows: list[dict], key: str, fmt: str) -> str:
    hit = [r[key] for r in rows if r["reached"]]
    if len(hit) < len(rows):
        return f"{len(hit)}/{len(rows)} reached" + (f" (mean {statistics.mean(hit):{fmt}})" if hit else "")
    half = (max(hit) - min(hit)) / 2
    return f"{statistics.mean(hit):{fmt}} ± {half:{fmt}}"


def p_value(rows: list[dict], base: list[dict], key: str) -> str:
    """Welch's two-sided p that a variant's `key` (steps or seconds to the target) has the recipe's mean, over the
    seeds that reached it: is a difference more than seed noise? "equal" where both are the same constant."""
    a, b = ([r[key] for r in xs if r["reached"]] for xs in (rows, base))
    if len(a) < 2 or len(b) < 2:
        return "n/a"
    if len(set(a)) == 1 and len(set(b)) == 1:
        return "equal" if a[0] == b[0] else "0 (constant)"
    return f"{stats.ttest_ind(a, b, equal_var=False).pvalue:.2g}"


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    table = choose(variants(a.config, a.variant), a.only or ("recipe" if a.smoke else ""))
    common = [f"--data.source={a.data}"] if a.data else []
    common += [f"--eval.every={a.eval_every}"] if a.eval_every else []
    if a.smoke:
        a.seeds, common = 1, [*common, *SMOKE]
    C.check_overrides(__file__, a.config, table, common)
    C.banner("Speedrun ablation: steps and seconds to a target", {
        "config": a.config, "target": f"{a.target_bpb} bpb", "data": a.data or "the config's",
        "runs": f"{len(table)} variant(s) x {a.seeds} seed(s)" + (" at toy size (--smoke)" if a.smoke else "")},
        C.command(__file__, argv))
    work = Path(tempfile.mkdtemp(prefix="nanopt-ablation-"))
    try:
        results = run_all(a, table, common, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"| variant | steps to {a.target_bpb} bpb | train seconds to target | Welch p vs recipe (steps, seconds) "
          f"| overrides |\n|---|---|---|---|---|")
    base = results.get("recipe", [])
    for name, rows in results.items():
        shown = " ".join(o for o in table[name] if not o.endswith("=null")) or "-"  # AdamW's kind lrs reset to train.lr
        p = "-" if name == "recipe" else f"{p_value(rows, base, 'steps')}, {p_value(rows, base, 'seconds')}"
        print(f"| {name} | {cell(rows, 'steps', '.0f')} | {cell(rows, 'seconds', '.1f')} | {p} | `{shown}` |")
    if a.json:
        a.json.write_text(json.dumps({"target_bpb": a.target_bpb, "variants": table, "results": results}, indent=2))


def run_all(a: argparse.Namespace, table: dict[str, list[str]], common: list[str], work: Path) -> dict[str, list]:
    """Every variant once per seed, the order rotating with the seed so that drift hits all alike."""
    results: dict[str, list[dict]] = {name: [] for name in table}
    for seed in range(a.seeds):
        names = list(table)[seed % len(table):] + list(table)[: seed % len(table)]
        for i, name in enumerate(names):
            r = run_once(a.config, common + table[name], a.target_bpb, seed, work / f"{seed}-{i}")
            results[name].append(r)
            where = f"step {r['steps']}, {r['seconds']:.1f} s" if r["reached"] else "not reached"
            C.progress(f"seed {seed} | {name}: {where}")
    return results


if __name__ == "__main__":
    main()
