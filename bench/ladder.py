"""The optimisation ladder on this machine: each rung's tokens/s and MFU against the matmul peak
measured in the same alternating rounds (on a GPU nanopt.distributed.hardware knows, its spec-sheet peak, as in training).

    python bench/ladder.py                     # dim 512, 4 layers, seq 256
    python bench/ladder.py --repeats 5 --no-compile
    python bench/ladder.py --smoke             # toy sizes, no compile: checks that the bench runs
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Optional

import _common as C
import torch


@dataclass
class Rung:
    label: str
    precision: str  # bf16 (autocast) | fp32
    attention: str  # eager | sdpa
    micro_batch: int
    compile: bool


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = C.parser(__file__, __doc__)
    C.add_shape_args(p, dim=512, ffn=1536, vocab=8192)
    p.add_argument("--small-batch", type=int, default=1, help="micro-batch of the first rungs")
    p.add_argument("--large-batch", type=int, default=4, help="micro-batch from the 'larger micro-batch' rung on")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="0 -> all cores")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--smoke", action="store_true", help=f"{C.SMOKE_HELP}: a one-layer, 32-wide model, no compile "
                   "rungs, one round, a 128² matmul for the peak")
    a = p.parse_args(argv)
    a.peak_n = None  # the matmul's side for the peak: _common.peak_flops's default
    if a.smoke:
        a.dim, a.layers, a.heads, a.kv_heads, a.ffn, a.vocab, a.seq = 32, 1, 2, 1, 64, 64, 16
        a.large_batch, a.repeats, a.no_compile, a.peak_n = 2, 1, True, 128
    return a


def rungs(a: argparse.Namespace) -> list[Rung]:
    small, large = a.small_batch, a.large_batch
    out = [
        Rung("fp32, eager attention", "fp32", "eager", small, False),
        Rung("+ bf16 autocast", "bf16", "eager", small, False),
        Rung("+ sdpa", "bf16", "sdpa", small, False),
        Rung(f"+ micro-batch {large}", "bf16", "sdpa", large, False),
    ]
    if not a.no_compile:
        out.append(Rung("+ torch.compile", "bf16", "sdpa", large, True))
    # Without AMX tiles a CPU's bf16 matmul (avx512_bf16 dot products) can be slower than fp32 FMA:
    # the last rung asks whether bf16 is worth it on this device at all.
    out.append(Rung("same, fp32 instead of bf16", "fp32", "sdpa", large, not a.no_compile))
    return out


def make_step(r: Rung, cfg, a: argparse.Namespace, device: torch.device):
    from nanopt.recipe.attention import BACKENDS
    from nanopt.recipe.model import build_model

    torch.manual_seed(0)
    model = build_model(cfg, device).train()
    model.set_attention(BACKENDS[r.attention])
    fwd = torch.compile(model) if r.compile else model
    idx = torch.randint(0, a.vocab, (r.micro_batch, a.seq), device=device)
    targets = torch.roll(idx, -1, dims=1)
    return C.make_step(model, lambda: fwd(idx, targets), r.precision, device)


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = C.model_config(a)
    fpt = C.flops_per_token(cfg, a.seq)
    side = a.peak_n or (8192 if device.type == "cuda" else 2048)
    C.banner("optimisation ladder", {
        "shape": f"dim {a.dim} layers {a.layers} heads {a.heads}/{a.kv_heads} ffn {a.ffn} vocab {a.vocab} seq {a.seq}"
                 f" ({fpt / 1e6:.1f} MFLOP/token, nanopt.recipe.mfu convention)",
        "peak": f"best {side}^2 matmul FLOP/s per precision, measured inside the same alternating rounds",
    }, C.command(__file__, argv))
    ladder = rungs(a)
    fns = {r.label: make_step(r, cfg, a, device) for r in ladder}
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    print(f"warm-up (incl. compile) {time.perf_counter() - t0:.0f} s", flush=True)
    peaks: dict[str, list[float]] = {"bf16": [], "fp32": []}
    budget = 0.0 if a.smoke else 0.5
    fns["peak bf16"] = lambda: peaks["bf16"].append(C.peak_flops(torch.bfloat16, device, budget, side))
    fns["peak fp32"] = lambda: peaks["fp32"].append(C.peak_flops(torch.float32, device, budget, side))
    times = C.alternate(fns, repeats=a.repeats, warmup=1, device=device)
    peak = {k: C.median(v) for k, v in peaks.items()}
    # MFU as training reports it: a known GPU's spec sheet; on CPU (or an unknown GPU) the measured peak.
    spec = {k: C.spec_peak(device, k) for k in peak}
    mfu_peak = spec if all(spec.values()) else peak

    print(f"\n{'rung':28s} | {'prec':4s} | {'mb':>2s} | {'step ms':>7s} | {'spread':>6s} | {'tokens/s':>8s} "
          f"| {'GFLOP/s':>7s} | {'MFU':>5s} | {'% bf16 peak':>11s}")
    print("-" * 100)
    best = (0.0, "")
    for r in ladder:
        m = C.median(times[r.label])
        tps = r.micro_batch * a.seq / m
        achieved = fpt * tps
        mfu = achieved / mfu_peak[r.precision]
        of_bf16 = achieved / peak["bf16"]
        best = max(best, (of_bf16, r.label))
        print(f"{r.label:28s} | {r.precision:4s} | {r.micro_batch:2d} | {1000 * m:7.0f} | "
              f"{C.spread(times[r.label]):>6s} | {tps:8.0f} | {achieved / 1e9:7.1f} | {100 * mfu:4.0f}% | "
              f"{100 * of_bf16:10.0f}%")
    print(f"measured matmul peak: bf16 {peak['bf16'] / 1e9:.0f} GFLOP/s, fp32 {peak['fp32'] / 1e9:.0f} GFLOP/s "
          f"(median of {a.repeats} in-round bests); MFU is against the rung's own precision, "
          + ("measured peak" if mfu_peak is peak else
             f"spec-sheet peak bf16 {spec['bf16'] / 1e12:.0f} / fp32 (tf32) {spec['fp32'] / 1e12:.0f} TFLOP/s"))
    first = C.median(times[ladder[0].label]) / ladder[0].micro_batch
    last = min(C.median(times[r.label]) / r.micro_batch for r in ladder)
    print(f"RATIO best rung = {100 * best[0]:.0f}% of the measured bf16 matmul peak ({best[1]}); "
          f"{first / last:.2f}x the first rung's tokens/s")


if __name__ == "__main__":
    main()
