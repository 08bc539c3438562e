"""nanopt vs Hugging Face LlamaForCausalLM: one full train step (forward, backward, clip, AdamW) at
identical shape, precision and optimizer settings, both measured alternately in this process. It then
profiles a few eager steps of each and prints the CEILING: HF's step over nanopt's time in matmul and
attention kernels, the best nanopt/HF any overhead removal could reach without faster kernels.

    python bench/vs_hf.py                       # dim 512, bf16 and fp32, eager and torch.compile
    python bench/vs_hf.py --no-compile --repeats 5 --precisions bf16
    python bench/vs_hf.py --smoke              # toy sizes, fp32, no compile: checks that the bench runs
"""
from __future__ import annotations

import argparse
import time
from typing import Optional

import _common as C
import torch


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = C.parser(__file__, __doc__)
    C.add_shape_args(p, dim=512, ffn=1536, vocab=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--precisions", default="bf16,fp32", help="comma list of bf16 (autocast) and fp32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="0 -> all cores")
    p.add_argument("--profile-rounds", type=int, default=3, help="profiled steps per model for the kernel split")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    p.add_argument("--hf-compile", action="store_true", help="also time torch.compile(HF model)")
    p.add_argument("--smoke", action="store_true", help=f"{C.SMOKE_HELP}: a one-layer, 32-wide model, fp32, no "
                   "compile, one round and one profiled step each")
    a = p.parse_args(argv)
    if a.smoke:
        a.dim, a.layers, a.heads, a.kv_heads, a.ffn, a.vocab, a.seq = 32, 1, 2, 1, 64, 64, 16
        a.batch, a.precisions, a.repeats, a.profile_rounds, a.no_compile, a.hf_compile = 1, "fp32", 1, 1, True, False
    return a


# The kernels both models must run: the matmuls (the 6N FLOPs) and the fused attention kernel.
HARD_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::_scaled_dot_product_flash_attention",
            "aten::_scaled_dot_product_flash_attention_backward", "aten::_efficient_attention_forward",
            "aten::_efficient_attention_backward", "aten::_flash_attention_forward", "aten::_flash_attention_backward")


def kernel_split(fns: dict, names: tuple[str, ...], rounds: int,
                 device: torch.device) -> dict[str, tuple[float, float]]:
    """{name: (median seconds per step in matmul + attention kernels, median wall seconds per step)}, from
    `rounds` profiled steps of each model, alternating like the timing rounds.

    On CPU, kernel time is the self time of those ops on the calling thread (each runs its own OpenMP
    team, so it is wall time); on CUDA, the GPU time of the kernels they launch. Both models pay the same
    small profiler overhead per op.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    hard: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for name in names:
            with profile(activities=activities) as prof:
                C.sync(device)
                t0 = time.perf_counter()
                fns[name]()
                C.sync(device)
                wall[name].append(time.perf_counter() - t0)
            events = [e for e in prof.key_averages() if e.key in HARD_OPS]
            hard[name].append(sum(e.device_time_total if cuda else e.self_cpu_time_total for e in events) / 1e6)
    return {n: (C.median(hard[n]), C.median(wall[n])) for n in names}


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    from nanopt.recipe.model import build_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = C.model_config(a, tie_embeddings=True, attention="sdpa")
    hf_cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                         num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
                         rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=True,
                         use_cache=False)
    tokens = a.batch * a.seq
    fpt = C.flops_per_token(cfg, a.seq)
    C.banner("nanopt vs HF LlamaForCausalLM, full train step", {
        "shape": f"dim {a.dim} layers {a.layers} heads {a.heads}/{a.kv_heads} ffn {a.ffn} vocab {a.vocab} "
                 f"seq {a.seq} batch {a.batch} ({tokens} tokens/step, {fpt / 1e6:.1f} MFLOP/token)",
        "step": "autocast fwd + loss, backward, clip_grad_norm 1.0, fused AdamW (wd 0.1 on matrices), zero_grad",
        "hf": "transformers LlamaForCausalLM, attn_implementation=sdpa, labels=input (HF shifts inside)",
    }, C.command(__file__, argv))
    torch.manual_seed(0)
    idx = torch.randint(0, a.vocab, (a.batch, a.seq), device=device)  # data on device before the step
    targets = torch.roll(idx, -1, dims=1)

    rows = []
    hard: dict[tuple[str, str], tuple[float, float]] = {}
    for precision in a.precisions.split(","):
        torch.manual_seed(0)
        hf = LlamaForCausalLM._from_config(hf_cfg, attn_implementation="sdpa").to(device).train()
        ours = build_model(cfg, device).train()
        fns = {
            "HF transformers": C.make_step(hf, lambda: hf(input_ids=idx, labels=idx).loss, precision, device),
            "nanopt": C.make_step(ours, lambda: ours(idx, targets), precision, device),
        }
        if not a.no_compile:
            ours_c = build_model(cfg, device).train()
            compiled = torch.compile(ours_c)
            fns["nanopt + compile"] = C.make_step(ours_c, lambda: compiled(idx, targets), precision, device)
        if a.hf_compile:
            hf_c = LlamaForCausalLM._from_config(hf_cfg, attn_implementation="sdpa").to(device).train()
            hf_compiled = torch.compile(hf_c)
            fns["HF + compile"] = C.make_step(hf_c, lambda: hf_compiled(input_ids=idx, labels=idx).loss, precision,
                                              device)
        t0 = time.perf_counter()
        for fn in fns.values():  # compile and allocate outside the timed rounds
            fn()
        print(f"[{precision}] warm-up (incl. compile) {time.perf_counter() - t0:.0f} s", flush=True)
        times = C.alternate(fns, repeats=a.repeats, warmup=1, device=device)
        base = C.median(times["HF transformers"])
        # Where the eager step goes, to bound what removing overhead could ever win.
        for name, split in kernel_split(fns, ("HF transformers", "nanopt"), a.profile_rounds, device).items():
            hard[(precision, name)] = split
        for name, ts in times.items():
            m = C.median(ts)
            rows.append((precision, name, 1000 * m, C.spread(ts), tokens / m, fpt * tokens / m / 1e9, base / m))

    print(f"\n{'precision':9s} | {'implementation':16s} | {'step ms':>8s} | {'spread':>6s} | {'tokens/s':>8s} "
          f"| {'GFLOP/s':>7s} | vs HF")
    print("-" * 78)
    for p, name, ms, sp, tps, gf, ratio in rows:
        print(f"{p:9s} | {name:16s} | {ms:8.0f} | {sp:>6s} | {tps:8.0f} | {gf:7.1f} | {ratio:.2f}x")
    print(f"(median of {a.repeats} alternating repeats after warm-up; spread: ± half the inter-quartile range, "
          "relative to the median)")
    print(f"\nwhere the eager step goes (profiled, median of {a.profile_rounds} alternating steps each):")
    for (p, name), (h, total) in hard.items():
        print(f"  {p:5s} {name:16s}: matmul + attention kernels {1000 * h:6.0f} ms of {1000 * total:6.0f} ms "
              f"({100 * h / total:.0f}%)")
    for p in dict.fromkeys(r[0] for r in rows):
        ceiling = hard[(p, "HF transformers")][1] / hard[(p, "nanopt")][0]
        print(f"CEILING {p}: nanopt/HF <= {ceiling:.2f}x even if nanopt spent nothing outside its matmul and "
              f"attention kernels (the same kernels HF calls, for the same FLOPs): HF's step / nanopt's kernel time")
    for p in dict.fromkeys(r[0] for r in rows):
        eager = next(r[-1] for r in rows if r[0] == p and r[1] == "nanopt")
        best_ratio, best_name = max((r[-1], r[1]) for r in rows if r[0] == p and r[1].startswith("nanopt"))
        print(f"RATIO {p}: nanopt/HF tokens/s = {eager:.2f}x eager, best {best_ratio:.2f}x ({best_name})")


if __name__ == "__main__":
    main()
