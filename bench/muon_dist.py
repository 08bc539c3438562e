"""Muon's orthogonalisation split across gloo ranks (optim.OwnerSplit): the Newton-Schulz time each rank spends per
step at 1, 2 and 4 ranks, on the hidden matrices of a config's model, and its ratio to one rank's.

Each world size runs in its own forked processes (one torch thread each, so 4 ranks on 2 cores oversubscribe them):
every rank steps BatchedMuon over the same matrices and gradients, as DDP replicas (`--layout replicas`) or as
FSDP2-style Shard(0) DTensors (`--layout shards`). A rank's orthogonalisation time is the CPU time of its own thread
inside optim.orthogonalize, which an oversubscribed machine does not inflate the way it inflates wall time; the
step's wall time (momentum, the collectives, the update) is shown beside it. The table gives medians over the
repeats: the busiest rank's (it sets the step), the mean over ranks, and the ratio of the busiest to one rank. The
first step's parameters are compared with one rank's (max abs difference). A benchmark, not a test.

    python bench/muon_dist.py                                   # configs/speedrun-cpu.yaml's 21 matrices
    python bench/muon_dist.py --layout shards --ranks 1,2,4 --repeats 20
    python bench/muon_dist.py --smoke                           # 1 and 2 ranks, one repeat: checks that it runs
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import _common as C
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanopt.config import load_config
from nanopt.distributed.runtime import CpuBackend
from nanopt.recipe import optim
from nanopt.recipe.model import build_model


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = C.parser(__file__, __doc__)
    p.add_argument("--config", default=str(C.REPO / "configs" / "speedrun-cpu.yaml"))
    p.add_argument("--ranks", default="1,2,4", help="world sizes, comma-separated, 1 first (the reference)")
    p.add_argument("--layout", default="replicas", choices=["replicas", "shards"],
                   help="whole matrices on every rank (ddp) or Shard(0) DTensors (fsdp)")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per world size, after one warm-up step")
    p.add_argument("--smoke", action="store_true", help=f"{C.SMOKE_HELP}: 1 and 2 ranks, one timed step")
    a = p.parse_args(argv)
    a.worlds = [1, 2] if a.smoke else [int(w) for w in a.ranks.split(",")]
    a.repeats = 1 if a.smoke else a.repeats
    if a.worlds[0] != 1 or min(a.worlds) < 1:
        C.bad_input(__file__, f"--ranks {a.ranks!r}: give world sizes of at least 1, starting with 1 (the reference)")
    return a


def matrix_shapes(config: str) -> list[tuple[int, int]]:
    """The shapes of the matrix kind's parameters (what Muon steps) of the config's model."""
    cfg = load_config(config)
    group = next(g for g in optim.param_groups(build_model(cfg.model), cfg.train, cfg.optim) if g["kind"] == "matrix")
    return [tuple(p.shape) for p in group["params"]]


def _rank(rank: int, world: int, shapes: list[tuple[int, int]], layout: str, repeats: int, out: str) -> None:
    """One rank: a warm-up step (its parameters saved by rank 0), then `repeats` timed steps."""
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    params, grads = _params(shapes, layout, world)
    spent: list[float] = []
    real = optim.orthogonalize

    def timed(*args: Any) -> torch.Tensor:
        start = time.thread_time()
        result = real(*args)
        spent.append(time.thread_time() - start)
        return result

    optim.orthogonalize = timed
    cpu = CpuBackend(torch.device("cpu"))  # as nanopt trains on this CPU: its cut-off and Newton-Schulz dtype
    opt = optim.BatchedMuon(params, lr=0.01, weight_decay=0.0, adjust_lr_fn="match_rms_adamw",
                            batch_max_numel=cpu.muon_batch_max_numel, ns_dtype=cpu.reduced_dtype,
                            process_group=dist.group.WORLD if world > 1 else None)
    for p, grad in zip(params, grads):
        p.grad = grad
    opt.step()
    first = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]  # every rank gathers
    if rank == 0:
        torch.save(first, f"{out}/first.pt")
    ns_ms, step_ms = [], []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()  # the ranks start each step together
        spent.clear()
        start = time.perf_counter()
        opt.step()
        step_ms.append(1e3 * (time.perf_counter() - start))
        ns_ms.append(1e3 * sum(spent))
    Path(out, f"{rank}.json").write_text(json.dumps({"ns_ms": ns_ms, "step_ms": step_ms}))
    if world > 1:
        dist.destroy_process_group()


def _params(shapes: list[tuple[int, int]], layout: str,
            world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same random matrices and gradients on every rank: whole, or this rank's Shard(0) rows as DTensors."""
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    if layout == "replicas" or world == 1:
        return [p.requires_grad_() for p in start], grads
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def cut(t: torch.Tensor) -> torch.Tensor:
        return distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)

    return [cut(p).requires_grad_() for p in start], [cut(grad) for grad in grads]


def measure(world: int, shapes: list[tuple[int, int]], layout: str, repeats: int) -> dict[str, Any]:
    """Each rank's medians over the timed steps, and rank 0's parameters after the first step."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, shapes, layout, repeats, out), nprocs=world, start_method="fork")
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
        first = torch.load(f"{out}/first.pt")
    ns = [C.median(r["ns_ms"]) for r in ranks]
    return {"ns_max": max(ns), "ns_mean": sum(ns) / world, "step_max": max(C.median(r["step_ms"]) for r in ranks),
            "first": first}


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    C.banner("Muon's orthogonalisation split across gloo ranks", {"config": a.config, "layout": a.layout},
             C.command(__file__, argv))
    shapes = matrix_shapes(a.config)
    print(f"matrices: {len(shapes)} in {len(set(shapes))} shapes {sorted(set(shapes))}; one torch thread per rank\n")
    rows = {}
    for world in a.worlds:
        C.progress(f"{world} rank(s) ...")
        rows[world] = measure(world, shapes, a.layout, a.repeats)
    one = rows[1]
    print("| ranks | Newton-Schulz ms/step, busiest rank | mean over ranks | ratio to 1 rank | ideal 1/world "
          "| step wall ms, slowest rank | first step's max abs diff to 1 rank |\n|---:|---:|---:|---:|---:|---:|---:|")
    for world, r in rows.items():
        diff = max((x - y).abs().max().item() for x, y in zip(r["first"], one["first"]))
        print(f"| {world} | {r['ns_max']:.2f} | {r['ns_mean']:.2f} | {r['ns_max'] / one['ns_max']:.2f} | "
              f"{1 / world:.2f} | {r['step_max']:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
