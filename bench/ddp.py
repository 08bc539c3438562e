"""2 processes × 1 thread (DDP, gloo) vs 1 process × 2 threads at the same global batch, on CPU.

Both set-ups live in the same pair of processes and alternate, round by round: rank 0 runs the
single-process step with 2 threads while rank 1 waits at a barrier, then both ranks run the DDP step
with 1 thread each. Both models start from the same weights and see the same batches, so their
losses must agree step for step (the check), and the timings see the same machine load.

    python bench/ddp.py
    python bench/ddp.py --dim 512 --precision fp32 --compile
    python bench/ddp.py --smoke                 # toy sizes: checks that the bench runs
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Optional

import _common as C
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = C.parser(__file__, __doc__)
    C.add_shape_args(p, dim=256, ffn=768, vocab=257)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per micro-step (as in the config)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--compile", action="store_true", help="torch.compile both models (train.compile)")
    p.add_argument("--smoke", action="store_true", help=f"{C.SMOKE_HELP}: a one-layer, 32-wide model on 16-token "
                   "sequences, fp32, one timed round")
    a = p.parse_args(argv)
    if a.smoke:
        a.dim, a.layers, a.heads, a.kv_heads, a.ffn, a.vocab, a.seq = 32, 1, 2, 1, 64, 64, 16
        a.micro_batch, a.precision, a.repeats = 2, "fp32", 1
    return a


def batches(round_idx: int, n_seq: int, a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The round's global batch: identical on every rank, so each rank can slice its share."""
    g = torch.Generator().manual_seed(1000 + round_idx)
    tokens = torch.randint(0, min(a.vocab, 64), (n_seq, a.seq + 1), generator=g)  # small alphabet: loss falls
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def worker(rank: int, world: int, ports: "mp.Queue", a: argparse.Namespace, out: "mp.Queue") -> None:
    store = C.join_group(rank, world, ports)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nanopt.distributed import runtime
    from nanopt.config import TrainConfig
    from nanopt.recipe.model import build_model
    from nanopt.recipe.optim import build_optimizer
    from nanopt.training.train import train_step

    rt = runtime.init("cpu", a.precision, threads=1)  # finds the gloo group
    single_rt = dataclasses.replace(rt, rank=0, local_rank=0, world_size=1, local_world_size=1)
    cfg = C.model_config(a)
    tcfg = TrainConfig(lr=1e-3)

    def build(distributed: bool):
        torch.manual_seed(0)  # the same initial weights for both set-ups
        model = build_model(cfg, rt.device)
        fwd = torch.compile(model) if a.compile else model
        if distributed:
            fwd = DDP(fwd, gradient_as_bucket_view=True)
        return model, fwd, build_optimizer(model, tcfg, rt if distributed else single_rt)

    ddp_model, ddp_fwd, ddp_opt = build(True)
    single = build(False) if rank == 0 else None
    mb, global_seq = a.micro_batch, a.micro_batch * world
    accum_single = world  # same micro_batch_size, so one process accumulates `world` micro-steps

    def ddp_step(r: int) -> float:
        x, y = batches(r, global_seq, a)
        mine = [(x[rank * mb:(rank + 1) * mb], y[rank * mb:(rank + 1) * mb])]
        loss, _ = train_step(ddp_fwd, ddp_opt, mine, rt, 1.0)
        rt.all_reduce_sum(loss)
        return loss.item() / world

    def single_step(r: int) -> float:
        x, y = batches(r, global_seq, a)
        micro = [(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) for i in range(accum_single)]
        _, fwd, opt = single
        loss, _ = train_step(fwd, opt, micro, single_rt, 1.0)
        return loss.item()

    warmup = 2
    times = {"1 proc x 2 threads": [], "2 procs x 1 thread": []}
    losses = []
    compile_s = time.perf_counter()
    for r in range(warmup + a.repeats):
        order = ["single", "ddp"] if r % 2 == 0 else ["ddp", "single"]  # alternate who goes first
        row = {}
        for which in order:
            dist.barrier()
            t0 = time.perf_counter()
            if which == "single":
                if rank == 0:
                    torch.set_num_threads(world)
                    row["single"] = single_step(r)
                    torch.set_num_threads(1)
                    store.set(f"single_done_{r}", "1")
                else:  # a blocking socket read: gloo's barrier busy-polls and would steal rank 0's 2nd core
                    store.wait([f"single_done_{r}"])
                elapsed, name = time.perf_counter() - t0, "1 proc x 2 threads"
            else:
                row["ddp"] = ddp_step(r)
                elapsed, name = time.perf_counter() - t0, "2 procs x 1 thread"
            if r >= warmup:
                times[name].append(elapsed)
        if r == warmup - 1:
            compile_s = time.perf_counter() - compile_s
        if rank == 0:
            losses.append((row["single"], row["ddp"]))
    if rank == 0:
        out.put({"times": times, "losses": losses, "warmup_s": compile_s})
    runtime.teardown()


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    world = 2
    tokens = a.micro_batch * world * a.seq
    C.banner("DDP on CPU: 2 processes x 1 thread vs 1 process x 2 threads", {
        "shape": f"dim {a.dim} layers {a.layers} heads {a.heads}/{a.kv_heads} ffn {a.ffn} vocab {a.vocab} seq {a.seq}",
        "batch": f"global {a.micro_batch * world} sequences = {tokens} tokens/step; micro-batch {a.micro_batch}; "
                 f"1 proc accumulates {world} micro-steps; {a.precision}; compile={a.compile}",
        "step": "nanopt.training.train.train_step (no_sync on non-final micro-steps, clip 1.0, fused AdamW) + loss all-reduce",
    }, C.command(__file__, argv))
    result = C.spawn_ranks(worker, world, (a,), "the DDP bench")
    times, losses = result["times"], result["losses"]
    print(f"warm-up (2 rounds, incl. compile) {result['warmup_s']:.0f} s\n")
    print(f"{'set-up':20s} | {'step ms':>7s} | {'spread':>6s} | {'tokens/s':>8s}")
    print("-" * 52)
    med = {}
    for name, ts in times.items():
        med[name] = C.median(ts)
        print(f"{name:20s} | {1000 * med[name]:7.0f} | {C.spread(ts):>6s} | {tokens / med[name]:8.0f}")
    print("\nround | loss 1 proc | loss 2 procs | |diff|")
    worst = 0.0
    for i, (s, d) in enumerate(losses):
        worst = max(worst, abs(s - d))
        print(f"{i:5d} | {s:11.5f} | {d:12.5f} | {abs(s - d):.1e}")
    ratio = med["1 proc x 2 threads"] / med["2 procs x 1 thread"]
    tol = 2e-2 if a.precision == "bf16" else 1e-4
    verdict = "match" if worst <= tol else "MISMATCH"
    print(f"RATIO 2 procs x 1 thread / 1 proc x 2 threads tokens/s = {ratio:.2f}; losses {verdict} (max |diff| "
          f"{worst:.1e}, tolerance {tol:g} for {a.precision}; first {losses[0][0]:.3f} -> last {losses[-1][0]:.3f})")


if __name__ == "__main__":
    main()
