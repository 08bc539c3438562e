"""Per-rank parameter, gradient and optimizer-state bytes, and step time: DDP against FSDP (runtime.parallel) at
1, 2 and 4 gloo ranks on CPU, one thread per rank, with the bytes nanopt/distributed/memory.py's model predicts beside them.

At each world size the same spawned processes hold both set-ups (the same initial weights) and alternate their
steps round by round after warm-up. Bytes are summed over this rank's tensors (a DTensor's local shard): the
weights, the gradients as the optimizer sees them (counted in a step pre-hook, so before train_step zeroes or frees
them) and the optimizer's state, after the warm-up steps; the largest rank's figure is reported. At world size 1
both set-ups are one process with the model as it is (as in training). The issue-38 goals: at 2 ranks FSDP's
bytes <= 0.55x DDP's, at 4 ranks <= 0.3x; at 2 ranks its steps/s within 15% of DDP's.

    python bench/fsdp_memory.py                          # configs/tiny.yaml's model and micro-batch, fp32
    python bench/fsdp_memory.py --config configs/speedrun-cpu.yaml --worlds 2
    python bench/fsdp_memory.py --smoke                  # toy sizes: checks that the bench runs
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any, Optional

import _common as C
import torch
import torch.multiprocessing as mp

from nanopt.config import load_config, parse_overrides
from nanopt.distributed.memory import device_memory, Training
from nanopt.recipe.mfu import meta_model

SMOKE = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.ffn_dim=64",
         "--model.vocab_size=64", "--train.seq_len=16", "--train.micro_batch_size=2", "--train.precision=fp32"]
SETUPS = ("ddp", "fsdp")


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = C.parser(__file__, __doc__)
    p.add_argument("--config", default=str(C.REPO / "configs" / "tiny.yaml"), help="the model, micro-batch, "
                   "seq_len and precision (default configs/tiny.yaml)")
    p.add_argument("--worlds", default="1,2,4", help="comma list of rank counts (default 1,2,4)")
    p.add_argument("--repeats", type=int, default=10, help="timed rounds per world size")
    p.add_argument("--smoke", action="store_true", help=f"{C.SMOKE_HELP}: a 2-layer, 32-wide model on 2 ranks, "
                   "one timed round")
    a = p.parse_args(argv)
    a.overrides = SMOKE if a.smoke else []
    if a.smoke:
        a.worlds, a.repeats = "2", 1
    a.worlds = [int(w) for w in a.worlds.split(",")]
    return a


def local_bytes(tensors: Any) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard), each once. By address, not storage:
    DDP's gradients are views of its buckets, FSDP2's of one reduce-scatter output."""
    from nanopt.distributed.parallel import local_tensor

    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = local_tensor(t)
            seen[(local.data_ptr(), local.numel())] = local.numel() * local.element_size()
    return sum(seen.values())


def worker(rank: int, world: int, ports: "mp.Queue", a: argparse.Namespace, out: "mp.Queue") -> None:
    C.join_group(rank, world, ports)
    from nanopt.distributed import parallel
    from nanopt.distributed import runtime
    from nanopt.recipe.model import build_model
    from nanopt.recipe.optim import build_optimizer
    from nanopt.training.train import train_step

    base = load_config(a.config, parse_overrides(a.overrides))
    t = base.train
    rt = runtime.init("cpu", t.precision, threads=1)
    built = {}
    for setup in SETUPS:
        cfg = load_config(a.config, parse_overrides([*a.overrides, f"--runtime.parallel={setup}"]))
        torch.manual_seed(0)  # the same initial weights for both
        model = build_model(cfg.model, rt.device)
        parallel.shard(model, cfg, rt)
        optimizer = build_optimizer(model, t, rt, cfg.optim)  # as train.Trainer builds it
        grads: list[int] = []
        optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, g=grads: g.append(local_bytes(p.grad for p in opt_params(opt))))
        built[setup] = (model, parallel.wrap(model, rt), optimizer, grads)

    def step(setup: str, r: int) -> None:
        g = torch.Generator().manual_seed(1000 * r + rank)  # each rank its own rows
        tokens = torch.randint(0, base.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=g)
        _, fwd, optimizer, _ = built[setup]
        train_step(fwd, optimizer, [(tokens[:, :-1], tokens[:, 1:])], rt, t.grad_clip)

    warmup, times = 2, {s: [] for s in SETUPS}
    for r in range(warmup + a.repeats):
        for setup in (SETUPS if r % 2 == 0 else SETUPS[::-1]):  # alternate who goes first
            rt.barrier()
            t0 = time.perf_counter()
            step(setup, r)
            rt.barrier()
            if r >= warmup:
                times[setup].append(time.perf_counter() - t0)
    sizes = {s: {"params": local_bytes(m.parameters()), "grads": built[s][3][-1],
                 "optimizer": local_bytes(v for state in opt.state.values() for v in state.values())}
             for s, (m, _, opt, _) in built.items()}
    everyone = rt.gather_objects(sizes)
    if rt.is_main:
        out.put({"world": world, "times": times,
                 "bytes": {s: {k: max(r[s][k] for r in everyone) for k in sizes[s]} for s in SETUPS}})
    runtime.teardown(wait_for_peers=True)


def opt_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def measure(world: int, a: argparse.Namespace) -> dict:
    """One world size: `world` spawned ranks; rank 0's result."""
    return C.spawn_ranks(worker, world, (a,), f"world size {world}")


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    cfg = load_config(a.config, parse_overrides(a.overrides))
    m, t = cfg.model, cfg.train
    C.banner("FSDP against DDP on CPU: per-rank parameter, gradient and optimizer bytes, and step time", {
        "model": f"{a.config}: dim {m.dim} layers {m.n_layers} heads {m.n_heads}/{m.n_kv_heads} ffn {m.ffn_dim} "
                 f"vocab {m.vocab_size}; micro-batch {t.micro_batch_size} x {t.seq_len} per rank, one micro-step; "
                 f"{t.precision}, {cfg.optim.name}",
        "ranks": f"{', '.join(map(str, a.worlds))} gloo processes x 1 thread on {os.cpu_count()} cores (more ranks "
                 "than cores share them: step times there measure the sharing, the bytes do not change)",
    }, C.command(__file__, argv))
    training = Training(t.precision, cfg.optim.name, t.micro_batch_size, t.seq_len, t.loss_chunk_tokens)
    print(f"{'ranks':>5} | {'set-up':6} | {'params MB':>9} | {'grads MB':>8} | {'optim MB':>8} | {'total MB':>8} | "
          f"{'x ddp':>5} | {'model MB':>8} | {'step ms':>7} | {'spread':>6}")
    print("-" * 96)
    ratios = {}
    for world in a.worlds:
        r = measure(world, a)
        medians = {s: C.median(r["times"][s]) for s in SETUPS}
        totals = {s: sum(r["bytes"][s].values()) for s in SETUPS}
        for s in SETUPS:
            b = r["bytes"][s]
            modelled = device_memory(meta_model(m), training, s if world > 1 else "ddp", world).resident
            print(f"{world:5d} | {s:6} | {b['params'] / 1e6:9.2f} | {b['grads'] / 1e6:8.2f} | "
                  f"{b['optimizer'] / 1e6:8.2f} | {totals[s] / 1e6:8.2f} | {totals[s] / totals['ddp']:5.2f} | "
                  f"{modelled / 1e6:8.2f} | {1000 * medians[s]:7.1f} | {C.spread(r['times'][s]):>6}")
        ratios[world] = (totals["fsdp"] / totals["ddp"], medians["ddp"] / medians["fsdp"])
    print("\n'model MB': nanopt/distributed/memory.py's resident bytes (params + grads + optimizer between steps) for the same "
          "config; 'x ddp': total bytes over DDP's at the same ranks.")
    for world, (memory, speed) in ratios.items():
        goal = {2: 0.55, 4: 0.3}.get(world)
        verdict = "" if goal is None else f" (goal <= {goal}: {'met' if memory <= goal else 'MISSED'})"
        print(f"RATIO {world} ranks: fsdp/ddp bytes {memory:.3f}{verdict}; fsdp/ddp steps/s {speed:.2f}" +
              (f" (goal >= 0.85: {'met' if speed >= 0.85 else 'MISSED'})" if world == 2 else ""))


if __name__ == "__main__":
    main()
