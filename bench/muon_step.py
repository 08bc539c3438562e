"""Muon's optimizer step: torch.optim.Muon (one bf16 Newton-Schulz per matrix) against nanopt's BatchedMuon (one
per matrix shape, batched) with its Newton-Schulz in bf16 and in fp32, and fused AdamW, on the hidden matrices of a
config's model, side by side in one process.

All step the same parameters from the same random gradients, alternating round-robin after a warm-up; the table
gives the median seconds per step, the spread, and each one's ratio to AdamW's; the updates are compared once (max
abs difference to torch's, and fp32's to bf16's relative to the update's size). `nanopt` trains with the Newton-Schulz
dtype its backend names (Backend.reduced_dtype: fp32 on a CPU without bf16 hardware). A benchmark, not a test.

    python bench/muon_step.py                                   # configs/speedrun-cpu.yaml's 21 matrices
    python bench/muon_step.py --config configs/170m-1gpu.yaml --repeats 5
    python bench/muon_step.py --cut-off --repeats 5            # batched vs one at a time, per shape
    python bench/muon_step.py --whole-step --repeats 3         # whole training steps: Muon's cost against AdamW's
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import _common as C
import torch

from nanopt import rundirs
from nanopt.config import load_config, parse_overrides
from nanopt.distributed.runtime import CpuBackend
from nanopt.recipe.model import build_model
from nanopt.recipe.optim import BatchedMuon, orthogonalize, param_groups


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = C.parser(__file__, __doc__)
    p.add_argument("--config", default=str(C.REPO / "configs" / "speedrun-cpu.yaml"))
    p.add_argument("--repeats", type=int, default=30, help="alternating rounds")
    p.add_argument("--cut-off", action="store_true",
                   help="instead: per shape, 6 same-shaped matrices in one batched Newton-Schulz against one at a "
                        "time, in this CPU backend's dtype: where BatchedMuon's cut-off (muon_batch_max_numel) lies")
    p.add_argument("--whole-step", action="store_true",
                   help="instead: whole `python -m nanopt.main` processes of --config with Muon (the backend's "
                        "Newton-Schulz dtype), Muon in bf16, and AdamW, alternating: median ms per training step")
    p.add_argument("--steps", type=int, default=40, help="--whole-step: steps per process (the first 10 are warm-up)")
    p.add_argument("--smoke", action="store_true", help=f"{C.SMOKE_HELP}: the config at toy width (its 7 matrices), "
                   "one round; with --whole-step 11 steps per process")
    a = p.parse_args(argv)
    a.overrides = C.TOY_RECIPE if a.smoke else []  # bf16 emulated (AVX2): 21 matrices' Newton-Schulz take seconds
    a.repeats, a.steps = (1, 11) if a.smoke else (a.repeats, a.steps)
    return a


WHOLE_STEP = {"muon (auto dtype)": [], "muon, bf16 Newton-Schulz": ["--optim.muon_dtype=bf16"],
              "adamw": ["--optim.name=adamw"]}


def whole_step(config: str, rounds: int, steps: int, extra: tuple[str, ...] = ()) -> None:
    """Each variant a whole training process per round, the order rotating; the median of its logged step_ms past
    the warm-up, then the median over rounds."""
    times: dict[str, list[float]] = {name: [] for name in WHOLE_STEP}
    with tempfile.TemporaryDirectory() as work:
        for r in range(rounds):
            names = list(WHOLE_STEP)[r % 3:] + list(WHOLE_STEP)[:r % 3]
            for name in names:
                run_dir = Path(work) / f"{r}-{len(times[name])}-{names.index(name)}"
                cmd = [sys.executable, "-m", "nanopt.main", "--config", config, f"--run.dir={run_dir}",
                       f"--train.max_steps={steps}", "--eval.every=0", "--eval.test_at_end=false", "--log.every=1",
                       "--sample.num_samples=0", "--checkpoint.every=0", "--log.tensorboard=false",
                       *extra, *WHOLE_STEP[name]]
                subprocess.run(cmd, cwd=C.REPO, check=True, capture_output=True)
                rows = [json.loads(x) for x in (run_dir / rundirs.METRICS_FILE).read_text().splitlines()]
                times[name].append(C.median([x["step_ms"] for x in rows if "step_ms" in x and x["step"] > 10]))
                C.progress(f"round {r} | {name}: {times[name][-1]:.1f} ms/step")
    adamw = C.median(times["adamw"])
    print(f"| optimizer | median ms/step | spread | / AdamW |\n|---|---:|---|---:|")
    for name, xs in times.items():
        print(f"| {name} | {C.median(xs):.1f} | {C.spread(xs)} | {C.median(xs) / adamw:.2f}x |")


CUT_OFF_SHAPES = [(128, 128), (128, 344), (256, 688), (384, 384), (512, 512), (768, 2048)]  # 16k .. 1.6M elements


def per_shape(repeats: int) -> None:
    """Batched over one at a time, per shape, at the backend's Newton-Schulz dtype."""
    dtype = CpuBackend(torch.device("cpu")).reduced_dtype
    coefficients, g = (3.4445, -4.775, 2.0315), torch.Generator().manual_seed(0)
    print(f"Newton-Schulz in {dtype}, 5 steps, batches of 6\n\n| shape | elements | batched ms | one at a time ms "
          f"| batched speed-up |\n|---|---:|---:|---:|---:|")
    for shape in CUT_OFF_SHAPES:
        x = torch.randn(6, *shape, generator=g)
        times = C.alternate({"batched": lambda: orthogonalize(x, coefficients, 5, 1e-7, dtype),
                             "single": lambda: [orthogonalize(m, coefficients, 5, 1e-7, dtype) for m in x]}, repeats)
        b, one = C.median(times["batched"]), C.median(times["single"])
        print(f"| {shape[0]}x{shape[1]} | {shape[0] * shape[1]:,} | {1e3 * b:.1f} | {1e3 * one:.1f} | {one / b:.2f}x |",
              flush=True)
    limit = CpuBackend(torch.device("cpu")).muon_batch_max_numel
    print(f"\nThis CPU's muon_batch_max_numel is {limit:,}: shapes above it go one at a time.")


def matrices(config: str, overrides: list[str]) -> list[torch.Tensor]:
    """The matrix kind's parameters (what Muon steps) of the config's model, detached copies."""
    cfg = load_config(config, parse_overrides(overrides))
    model = build_model(cfg.model)
    group = next(g for g in param_groups(model, cfg.train, cfg.optim) if g["kind"] == "matrix")
    return [p.detach().clone() for p in group["params"]]


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    C.banner("Muon step: torch.optim.Muon vs BatchedMuon", {"config": a.config}, C.command(__file__, argv))
    if a.cut_off:
        return per_shape(a.repeats)
    if a.whole_step:
        return whole_step(a.config, a.repeats, a.steps, tuple(a.overrides))
    start = matrices(a.config, a.overrides)
    shapes = sorted({tuple(p.shape) for p in start})
    print(f"matrices: {len(start)} in {len(shapes)} shapes {shapes}\n")
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) for p in start]
    kw = dict(lr=0.01, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    names = ("torch", "batched_bf16", "batched_fp32", "adamw")
    params = {name: [p.clone().requires_grad_() for p in start] for name in names}
    cut_off = CpuBackend(torch.device("cpu")).muon_batch_max_numel  # as nanopt trains on this CPU
    opts = {"torch": torch.optim.Muon(params["torch"], **kw),
            "batched_bf16": BatchedMuon(params["batched_bf16"], **kw, batch_max_numel=cut_off,
                                        ns_dtype=torch.bfloat16),
            "batched_fp32": BatchedMuon(params["batched_fp32"], **kw, batch_max_numel=cut_off,
                                        ns_dtype=torch.float32),
            "adamw": torch.optim.AdamW(params["adamw"], lr=1e-3, weight_decay=0.0, fused=True)}
    for name in opts:
        for p, grad in zip(params[name], grads):
            p.grad = grad
        opts[name].step()
    moved = {name: [p - s for p, s in zip(params[name], start)] for name in names}  # the first step's updates
    diff = max((x - y).abs().max().item() for x, y in zip(params["torch"], params["batched_bf16"]))
    rel = max(((x - y).norm() / y.norm()).item() for x, y in zip(moved["batched_fp32"], moved["batched_bf16"]))
    times = C.alternate({name: opt.step for name, opt in opts.items()}, a.repeats)
    adamw = C.median(times["adamw"])
    print("| optimizer | median ms/step | spread | / AdamW |\n|---|---:|---|---:|")
    for name, label in (("torch", "torch.optim.Muon (bf16)"), ("batched_bf16", "nanopt BatchedMuon, bf16"),
                        ("batched_fp32", "nanopt BatchedMuon, fp32"), ("adamw", "torch AdamW (fused)")):
        print(f"| {label} | {1e3 * C.median(times[name]):.2f} | {C.spread(times[name])} | "
              f"{C.median(times[name]) / adamw:.2f}x |")
    ratio = C.median(times["torch"]) / C.median(times["batched_bf16"])
    print(f"\nBatchedMuon (bf16) is **{ratio:.2f}x** torch's speed; the first steps' updates differ by at most "
          f"{diff:.2e}. The fp32 update differs from the bf16 one by at most {rel:.1e} of its norm (the bf16 iteration's "
          f"own error: one bf16 rounding is {2**-8:.1e}). This CPU's backend trains with "
          f"{str(CpuBackend(torch.device('cpu')).reduced_dtype).replace('torch.', '')}.")

if __name__ == "__main__":
    main()
