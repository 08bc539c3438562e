"""Parameter groups by kind (with µP's lr factor), the optimizers (adamw, muon: batched, shared out across ranks),
the lr schedule as a multiplier of the step, and loading optimizer state."""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim._muon import _adjust_lr

from nanopt.config import OptimConfig, TrainConfig
from nanopt.distributed import xla
from nanopt.distributed.runtime import Runtime

log = logging.getLogger("nanopt")

# A fixed group order: the optimizer's state_dict indexes parameters by position, so checkpoints stay loadable.
KINDS = ("matrix", "embedding", "head", "scalar")
# Every group names the torch optimizer that steps it, so a checkpoint says which update rule its state is for.
ADAMW, MUON = "adamw", "muon"
# Group keys of this run's config and device, not of the trajectory: a resume takes them from this run.
RUN_KEYS = ("kind", "optimizer", "base_lr", "weight_decay", "fused", "foreach", "capturable", "differentiable")


def kind_hparams(kind: str, train: TrainConfig, optim: Optional[OptimConfig] = None) -> tuple[float, float]:
    """(base lr, weight decay) of one kind: optim.<kind>_lr/_weight_decay, null meaning train.lr/weight_decay.
    Scalars never decay: pulling a gain toward zero shrinks the whole layer's output."""
    optim = optim or OptimConfig()
    lr = getattr(optim, f"{kind}_lr")
    decay = 0.0 if kind == "scalar" else getattr(optim, f"{kind}_weight_decay")
    return (train.lr if lr is None else lr), (train.weight_decay if decay is None else decay)


def mup_lr_scale(kind: str, width_mult: float, optim: OptimConfig) -> float:
    """µP's factor on a hidden matrix's base lr at width_mult m (docs/scaling.md; 1.0 under sp). AdamW: 1/m (Tensor
    Programs V). Muon `original` already meets the spectral condition: 1; `match_rms_adamw` grows as sqrt(m):
    1/sqrt(m)."""
    if kind != "matrix" or width_mult == 1.0:
        return 1.0
    if optim.name == MUON:
        return 1 / math.sqrt(width_mult) if optim.muon_adjust_lr == "match_rms_adamw" else 1.0
    return 1 / width_mult


def param_groups(model: nn.Module, train: TrainConfig, optim: Optional[OptimConfig] = None) -> list[dict]:
    """One group per non-empty kind, in KINDS order (kind, base_lr, weight_decay, params); every trainable
    parameter once, a tied weight too."""
    optim = optim or OptimConfig()
    width_mult = getattr(getattr(model, "cfg", None), "width_mult", 1.0)
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = getattr(model, "lm_head", None)  # the model's output projection, when it has one
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    by_kind: dict[str, list[nn.Parameter]] = {kind: [] for kind in KINDS}
    for p in model.parameters():  # a kind from where the parameter sits in the model, not from its name
        if p.requires_grad:
            # ndim first: no vector ever decays; embedding before head: a tied head is the embedding matrix.
            kind = ("scalar" if p.ndim < 2 else "embedding" if id(p) in embedding_ids else
                    "head" if id(p) in head_ids else "matrix")
            by_kind[kind].append(p)
    groups = []
    for kind, params in by_kind.items():
        if params:
            lr, wd = kind_hparams(kind, train, optim)  # sp: × exactly 1.0, the configured lr itself
            groups.append({"kind": kind, "base_lr": lr * mup_lr_scale(kind, width_mult, optim), "weight_decay": wd,
                           "params": params})
    return groups


def build_optimizer(model: nn.Module, train: TrainConfig, rt: Runtime,
                    optim: Optional[OptimConfig] = None) -> torch.optim.Optimizer:
    """optim.name's optimizer over the kind groups, for rt's device. adamw: AdamW on every kind. muon: Muon on the
    matrix kind, AdamW on the others, as one MuonWithAdamW; rt's ranks share Muon's orthogonalisation, at rt's
    cut-off, in optim.muon_dtype as rt reads it (the device whole: a bf16 default had callers emulate it on AVX2)."""
    optim = optim or OptimConfig()
    groups = [dict(g, lr=g["base_lr"]) for g in param_groups(model, train, optim)]
    if optim.name == ADAMW:
        return _adamw(groups, train, rt.kind)
    if optim.name == MUON:
        if rt.kind == "xla":  # torch's per-matrix Muon: its XLA graphs were measured that way (tests/xla_jobs.py)
            log.warning("optim.name=muon on XLA: torch_xla does not lower the addmm(beta, alpha) of Muon's "
                        "Newton-Schulz iteration and runs it on the host, so the train step is cut into ~2 graphs "
                        "per matrix (compiled once, then reused) and is slow; adamw keeps it one graph.")
            muon_type, extra = torch.optim.Muon, {}
        else:
            muon_type, extra = BatchedMuon, dict(batch_max_numel=rt.backend.muon_batch_max_numel,
                                                 process_group=rt.process_group,
                                                 ns_dtype=rt.reduced_dtype(optim.muon_dtype))
        muon = muon_type([dict(g, optimizer=MUON) for g in groups if g["kind"] == "matrix"],
                         momentum=optim.muon_momentum, nesterov=optim.muon_nesterov, ns_steps=optim.muon_ns_steps,
                         adjust_lr_fn=optim.muon_adjust_lr, **extra)
        return MuonWithAdamW(muon, _adamw([g for g in groups if g["kind"] != "matrix"], train, rt.kind))
    raise ValueError(f"unknown optimizer {optim.name!r}; expected {ADAMW!r} or {MUON!r}")


def _adamw(groups: list[dict], train: TrainConfig, device_kind: str) -> torch.optim.AdamW:
    # Fused on CUDA and CPU (one kernel per step); on XLA the backend's flags (else torch picks its per-parameter loop).
    flags = dict(xla.ADAMW_OPTIONS) if device_kind == "xla" else {"fused": device_kind in ("cuda", "cpu")}
    return torch.optim.AdamW([dict(g, optimizer=ADAMW) for g in groups], lr=train.lr,
                             betas=(train.beta1, train.beta2), eps=train.eps, **flags)


class BatchedMuon(torch.optim.Muon):
    """torch's Muon (same update and state: checkpoints are interchangeable) with one batched Newton-Schulz call per
    group of same-shaped matrices: at the CPU speedrun's width the step is 2.25x as fast (bench/muon_step.py).
    `batch_max_numel`: larger matrices go one at a time (None: all batch). `ns_dtype`: what Newton-Schulz computes
    in, no default (the backend's: fp32 where bf16 is emulated). Across ranks each orthogonalises only the matrices
    it owns (OwnerSplit); momentum, decay and the update are elementwise, on each rank's own rows."""

    def __init__(self, params: Any, *args: Any, ns_dtype: torch.dtype, batch_max_numel: Optional[int] = None,
                 process_group: Optional[dist.ProcessGroup] = None, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self.batch_max_numel, self.process_group, self.ns_dtype = batch_max_numel, process_group, ns_dtype

    def batches(self, params: list[torch.Tensor]) -> list[list[int]]:
        """Indices into params, one list per Newton-Schulz call: same shapes together, large ones alone."""
        by_shape: dict[torch.Size, list[int]] = defaultdict(list)
        for i, p in enumerate(params):
            by_shape[p.shape].append(i)
        limit = self.batch_max_numel
        out: list[list[int]] = []
        for index in by_shape.values():
            alone = limit is not None and params[index[0]].numel() > limit
            out += [[i] for i in index] if alone else [index]
        return out

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            params, grads, bufs = [], [], []  # of torch.Tensor
            self._init_group(group, params, grads, bufs)  # torch's: creates the momentum buffers, refuses complex
            local, grads, bufs = ([_local(t) for t in ts] for ts in (params, grads, bufs))  # this rank's rows
            torch._foreach_lerp_(bufs, grads, 1 - group["momentum"])
            updates = torch._foreach_lerp(grads, bufs, group["momentum"]) if group["nesterov"] else bufs
            shapes = [p.shape for p in params]  # the whole matrices' (a DTensor's shape is its global one)
            split = OwnerSplit.of(params, self.process_group, self.ns_dtype)
            ortho = self.orthogonalize(updates, group) if split is None else split.orthogonalize(self, updates,
                                                                                                 shapes, group)
            torch._foreach_mul_(local, 1 - group["lr"] * group["weight_decay"])
            for p, shape, update in zip(local, shapes, ortho):
                p.add_(update.to(p.dtype), alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], shape))
        return loss

    def orthogonalize(self, updates: list[torch.Tensor], group: dict[str, Any]) -> list[torch.Tensor]:
        ortho = list(updates)
        for part in self.batches(updates):
            stacked = torch.stack([updates[i] for i in part]) if len(part) > 1 else updates[part[0]]  # N A B, or A B
            result = orthogonalize(stacked, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
            for i, matrix in zip(part, result.unbind(0) if result.dim() == 3 else [result]):
                ortho[i] = matrix
        return ortho


def orthogonalize(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz's quintic as torch.optim.Muon runs it, on one matrix or a batch: (N) A B -> (N) A B in `dtype`."""
    a, b, c = coefficients
    tall = g.size(-2) > g.size(-1)
    x = g.to(dtype)
    x = x.mT if tall else x  # (N) R C with R <= C: the Gram matrices are the small side
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    mul_add = torch.baddbmm if x.dim() == 3 else torch.addmm
    for _ in range(steps):
        gram = x @ x.mT  # (N) R R
        x = mul_add(x, mul_add(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # (N) R C
    return x.mT if tall else x


# ---------------------------------------------------------------- Muon's orthogonalisation shared out across ranks
def owners(shapes: list[torch.Size], world: int) -> list[int]:
    """The rank that orthogonalises each matrix: the least loaded so far, largest cost first, the lowest rank on
    ties (same shapes go round-robin); every rank computes the same answer."""
    load = [0] * world
    out = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -_ns_cost(shapes[i])):  # stable: ties keep their order
        rank = min(range(world), key=load.__getitem__)
        out[i] = rank
        load[rank] += _ns_cost(shapes[i])
    return out


def _ns_cost(shape: torch.Size) -> int:
    """Multiply-adds of one Newton-Schulz iteration on R x C (R <= C): two R^2 C products and R^3."""
    r, c = sorted(shape[-2:])
    return r * r * (2 * c + r)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a DTensor (in-place ops write the DTensor), else `t` (no import of DTensor's module)."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class OwnerSplit:
    """Muon's orthogonalisation shared out across `group` (nanochat's owner pattern): each matrix's owner
    orthogonalises it with its other same-shaped ones and sends every rank its rows, one all_to_all. Shard(0) rows
    (`sharded`: FSDP2's DTensors) first travel to the owner; replicas (DDP) need no gather."""
    group: dist.ProcessGroup
    rank: int
    world: int
    sharded: bool
    device: torch.device  # where the matrices and the messages live
    dtype: torch.dtype  # what Newton-Schulz computes in and the messages carry

    @classmethod
    def of(cls, params: list[torch.Tensor], process_group: Optional[dist.ProcessGroup],
           dtype: torch.dtype) -> Optional[OwnerSplit]:
        """Over the DTensors' mesh's Shard(0) dimension, else over `process_group` when it has more than one
        rank, else None."""
        if any(hasattr(p, "to_local") for p in params):  # DTensors
            mesh, placements = params[0].device_mesh, params[0].placements
            dims = [d for d, p in enumerate(placements) if p.is_shard(0)]
            uniform = all(getattr(p, "device_mesh", None) == mesh and p.placements == placements for p in params)
            if not uniform or len(dims) != 1 or not all(p.is_shard(0) or p.is_replicate() for p in placements):
                raise ValueError(f"Muon splits DTensor matrices that all share one mesh and are sharded by rows "
                                 f"(Shard(0)) along one of its dimensions; these are "
                                 f"{sorted({str(p.placements) for p in params})}")
            return cls(mesh.get_group(dims[0]), mesh.get_local_rank(dims[0]), mesh.size(dims[0]), True,
                       params[0].device, dtype)
        if process_group is None or dist.get_world_size(process_group) == 1:
            return None
        return cls(process_group, dist.get_rank(process_group), dist.get_world_size(process_group), False,
                   params[0].device, dtype)

    def spans(self, rows: int) -> list[tuple[int, int]]:
        """(start, stop) of a matrix's rows on each rank: torch.chunk's cut under Shard(0), all of them on replicas."""
        if not self.sharded:
            return [(0, rows)] * self.world
        size = -(-rows // self.world)
        return [(min(rows, r * size), min(rows, (r + 1) * size)) for r in range(self.world)]

    def orthogonalize(self, muon: BatchedMuon, updates: list[torch.Tensor], shapes: list[torch.Size],
                      group: dict[str, Any]) -> list[torch.Tensor]:
        """This rank's rows of every orthogonalised update, having orthogonalised only the matrices it owns."""
        for t, shape in zip(updates, shapes):
            start, stop = self.spans(shape[0])[self.rank]
            if t.shape != (stop - start, *shape[1:]):
                raise RuntimeError(f"rank {self.rank} of {self.world} holds a {tuple(t.shape)} part of a "
                                   f"{tuple(shape)} matrix, not rows {start}:{stop} (Shard(0) as torch.chunk cuts)")
        owner = owners(shapes, self.world)
        owned = [[i for i, o in enumerate(owner) if o == r] for r in range(self.world)]
        mine = owned[self.rank]
        if self.sharded:  # every rank sends each owner its rows of the owner's matrices
            sent = [[updates[i] for i in owned[r]] for r in range(self.world)]
            received = self._all_to_all(sent, [[self._numel(shapes[i], s) for i in mine] for s in range(self.world)])
            whole = [torch.cat([received[s][j].view(-1, shapes[i][1]) for s in range(self.world)])
                     for j, i in enumerate(mine)]
        else:
            whole = [updates[i] for i in mine]
        ortho = muon.orthogonalize(whole, group)
        # Each owner sends each rank its rows of the owner's results (a replica: the whole matrices).
        sent = [[ortho[j][slice(*self.spans(shapes[i][0])[r])] for j, i in enumerate(mine)] for r in range(self.world)]
        received = self._all_to_all(sent, [[self._numel(shapes[i], self.rank) for i in owned[o]]
                                           for o in range(self.world)])
        out: list[torch.Tensor] = [torch.empty(0)] * len(shapes)
        for o in range(self.world):
            for k, i in enumerate(owned[o]):
                out[i] = received[o][k].view(-1, shapes[i][1])
        return out

    def _numel(self, shape: torch.Size, rank: int) -> int:
        start, stop = self.spans(shape[0])[rank]
        return (stop - start) * shape[1]

    def _all_to_all(self, sent: list[list[torch.Tensor]], counts: list[list[int]]) -> list[list[torch.Tensor]]:
        """sent[r] to rank r in one all_to_all; what each rank s sent here, cut into counts[s]."""
        flat = [t.to(self.dtype).reshape(-1) for ts in sent for t in ts]
        send = torch.cat(flat) if flat else torch.empty(0, dtype=self.dtype, device=self.device)
        received = torch.empty(sum(map(sum, counts)), dtype=self.dtype, device=self.device)
        dist.all_to_all_single(received, send, [sum(c) for c in counts], [sum(t.numel() for t in ts) for ts in sent],
                               group=self.group)
        return [list(chunk.split(c)) for chunk, c in zip(received.split([sum(c) for c in counts]), counts)]


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the matrix group and AdamW on the others as one optimizer: it holds the very group dicts and state
    the two step, so state_dict() and torch's load work, the two re-pointed after it."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW) -> None:
        self.optimizers = {MUON: muon, ADAMW: adamw}
        # "capturable": XlaBackend.compile_step sets it through `defaults` for AdamW; Muon ignores it.
        super().__init__([*muon.param_groups, *adamw.param_groups], defaults={"capturable": False})
        self._share()

    def _share(self) -> None:
        for name, opt in self.optimizers.items():
            opt.param_groups = [g for g in self.param_groups if g.get("optimizer") == name]
            opt.state = self.state

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = self.optimizers[MUON].step(closure)  # Muon evaluates the closure (with grad) before it steps
        self.optimizers[ADAMW].step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Share of each group's base lr at step `step` (0-based): linear warmup, then cosine to min_lr_ratio at
    max_steps, wsd (flat, then linear decay over the last decay_fraction) or constant."""
    floor = cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":  # frac: the share of the decay steps done, 0 until they start
        decay_steps = max(1, int(round(cfg.max_steps * cfg.decay_fraction)))
        frac = min(1.0, max(0, step - (cfg.max_steps - decay_steps) + 1) / decay_steps)
        return 1.0 + (floor - 1.0) * frac
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return floor + 0.5 * (1.0 - floor) * (1 + math.cos(math.pi * frac))


def apply_schedule(optimizer: torch.optim.Optimizer, multiplier: float) -> None:
    """Scale each group's own base lr: one shared lr written into every group would erase per-group lrs."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier


def load_state_dict(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a saved state_dict: the trajectory from the checkpoint, RUN_KEYS from this run (torch's load would take
    the saved flags, and place the step counts by them). Another optimizer's or other groups' state: ValueError."""
    current = [{k: g[k] for k in RUN_KEYS if k in g} for g in optimizer.param_groups]
    saved_name, name = optimizer_name(state["param_groups"]), optimizer_name(optimizer.param_groups)
    if saved_name != name:  # torch would load AdamW moments as Muon momentum (or fail halfway) without a word
        raise ValueError(f"the saved optimizer state is {saved_name}'s and this run's optimizer is {name} "
                         f"(optim.name): one's moments mean nothing to the other. Resume with "
                         f"`--optim.name={saved_name}`, or start a new run to train with {name}")
    saved_kinds, kinds = ([g.get("kind") for g in groups] for groups in (state["param_groups"], current))
    if None in saved_kinds:
        raise ValueError("its parameter groups have no kind (the two-group layout nanopt wrote before parameter "
                         "kinds), which this version does not resume. Resume with the nanopt that wrote it, or start "
                         "a new run (a new `run.dir`)")
    if saved_kinds != kinds:  # torch would only compare group sizes, and could load moments into wrong params
        raise ValueError(f"the saved optimizer has parameter groups {saved_kinds}, this model has {kinds}")
    groups = [dict(saved, **keys) for saved, keys in zip(state["param_groups"], current)]
    optimizer.load_state_dict({**state, "param_groups": groups})


def optimizer_name(groups: list[dict]) -> str:
    """optim.name of the optimizer these param groups (live or saved) belong to: muon when Muon steps any."""
    return MUON if any(g.get("optimizer") == MUON for g in groups) else ADAMW
