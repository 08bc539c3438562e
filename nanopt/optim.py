"""Optimizer parameter groups by kind, the optimizers by name (adamw, muon) and the AdamW flags each device
wants, the learning-rate schedule as a multiplier (a pure function of step), and loading optimizer state."""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from nanopt import xla
from nanopt.config import OptimConfig, TrainConfig

log = logging.getLogger("nanopt")

# Group order is fixed: the optimizer's state_dict indexes parameters by their position across groups,
# so a stable order keeps checkpoints loadable.
KINDS = ("matrix", "embedding", "head", "scalar")
# Every group names the torch optimizer that steps it, so a checkpoint says which update rule its state is for.
ADAMW, MUON = "adamw", "muon"
# Group keys that belong to this run's config and device rather than to the training trajectory: a resume
# takes them from the freshly built optimizer, never from the checkpoint.
RUN_KEYS = ("kind", "optimizer", "base_lr", "weight_decay")
IMPL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def adamw_options(device_type: str) -> dict[str, bool]:
    """AdamW's implementation flags for this device: fused on CUDA and CPU (one kernel per step, a vectorised
    loop on CPU), the XLA backend's choice there (torch would otherwise pick its per-parameter loop)."""
    if device_type == "xla":
        return dict(xla.ADAMW_OPTIONS)
    return {"fused": device_type in ("cuda", "cpu")}


def kind_hparams(kind: str, train: TrainConfig, optim: Optional[OptimConfig] = None) -> tuple[float, float]:
    """(base lr, weight decay) of one kind: optim.<kind>_lr and optim.<kind>_weight_decay, null meaning
    train.lr and train.weight_decay. Scalars (gains, residual scalars) never decay: pulling a gain toward zero
    shrinks the whole layer's output, which is not what weight decay is for."""
    optim = optim or OptimConfig()
    lr = getattr(optim, f"{kind}_lr")
    decay = 0.0 if kind == "scalar" else getattr(optim, f"{kind}_weight_decay")
    return (train.lr if lr is None else lr), (train.weight_decay if decay is None else decay)


def param_kind(p: torch.Tensor, embedding_ids: set[int], head_ids: set[int]) -> str:
    """A parameter's kind from where it sits in the model, not from its name."""
    if p.ndim < 2:  # first, so no vector (a gain, a bias) ever decays, whichever module holds it
        return "scalar"
    if id(p) in embedding_ids:  # before head: a tied LM head is the embedding matrix, one param
        return "embedding"
    if id(p) in head_ids:
        return "head"
    return "matrix"


def param_groups(model: nn.Module, train: TrainConfig, optim: Optional[OptimConfig] = None) -> list[dict]:
    """One group per non-empty kind, in KINDS order, with kind, base_lr, weight_decay and params; every
    trainable parameter appears exactly once (model.parameters() yields a tied weight once)."""
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = getattr(model, "lm_head", None)  # the model's output projection, when it has one
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    by_kind: dict[str, list[nn.Parameter]] = {kind: [] for kind in KINDS}
    for p in model.parameters():
        if p.requires_grad:
            by_kind[param_kind(p, embedding_ids, head_ids)].append(p)
    groups = []
    for kind, params in by_kind.items():
        if params:
            lr, wd = kind_hparams(kind, train, optim)
            groups.append({"kind": kind, "base_lr": lr, "weight_decay": wd, "params": params})
    return groups


def build_optimizer(model: nn.Module, train: TrainConfig, device_kind: str, optim: Optional[OptimConfig] = None,
                    muon_batch_max_numel: Optional[int] = None) -> torch.optim.Optimizer:
    """optim.name's optimizer over the kind groups, each at its base lr. adamw: AdamW on every kind. muon: Muon
    on the matrix kind (the hidden 2-D weights it is made for), AdamW on the others, as one MuonWithAdamW;
    `muon_batch_max_numel` is BatchedMuon's cut-off (the device backend's)."""
    optim = optim or OptimConfig()
    groups = [dict(g, lr=g["base_lr"]) for g in param_groups(model, train, optim)]
    if optim.name == ADAMW:
        return _adamw(groups, train, device_kind)
    if optim.name == MUON:
        if device_kind == "xla":
            log.warning("optim.name=muon on XLA: torch_xla does not lower the addmm(beta, alpha) of Muon's "
                        "Newton-Schulz iteration and runs it on the host, so the train step is cut into ~2 graphs "
                        "per matrix (compiled once, then reused) and is slow; adamw keeps it one graph.")
        matrix = [g for g in groups if g["kind"] == "matrix"]
        rest = [g for g in groups if g["kind"] != "matrix"]
        # XLA keeps torch's per-matrix Muon: its graphs were measured that way (tests/xla_jobs.py).
        if device_kind == "xla":
            muon: torch.optim.Muon = _muon(torch.optim.Muon, matrix, optim)
        else:
            muon = _muon(BatchedMuon, matrix, optim, batch_max_numel=muon_batch_max_numel)
        return MuonWithAdamW(muon, _adamw(rest, train, device_kind))
    raise ValueError(f"unknown optimizer {optim.name!r}; expected {ADAMW!r} or {MUON!r}")


def _adamw(groups: list[dict], train: TrainConfig, device_kind: str) -> torch.optim.AdamW:
    return torch.optim.AdamW([dict(g, optimizer=ADAMW) for g in groups], lr=train.lr,
                             betas=(train.beta1, train.beta2), eps=train.eps, **adamw_options(device_kind))


def _muon(muon_type: type[torch.optim.Muon], groups: list[dict], optim: OptimConfig,
          **extra: Any) -> torch.optim.Muon:
    # Each group brings its own lr and weight decay; Muon scales the lr per matrix shape (adjust_lr_fn).
    return muon_type([dict(g, optimizer=MUON) for g in groups], momentum=optim.muon_momentum,
                     nesterov=optim.muon_nesterov, ns_steps=optim.muon_ns_steps, adjust_lr_fn=optim.muon_adjust_lr,
                     **extra)


class BatchedMuon(torch.optim.Muon):
    """torch's Muon with one Newton-Schulz iteration per group of same-shaped matrices (batched matmuls) instead
    of one per matrix. The update is torch's (the same bf16 iteration, momentum, decay and per-shape lr); its groups
    and state are torch's, so checkpoints are interchangeable. Why: at the CPU speedrun's width 128 the 21
    matrices' 315 small matmuls were mostly call overhead; batched, the step is 2.25x as fast (bench/muon_step.py,
    docs/results.md).

    `batch_max_numel`: matrices above this many elements go one at a time (None: every shape batches). Where
    batching stops paying is the device's (its backend's muon_batch_max_numel, runtime.py): on 2 CPU cores a
    batched bf16 matmul of 170m's matrices ran 0.69x single ones."""

    def __init__(self, params: Any, *args: Any, batch_max_numel: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self.batch_max_numel = batch_max_numel

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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)  # torch's: creates the momentum buffers, refuses complex
            for part in self.batches(params):
                _muon_update([params[i] for i in part], [grads[i] for i in part], [bufs[i] for i in part], group)
        return loss


def _muon_update(params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor],
                 group: dict[str, Any]) -> None:
    """torch's per-matrix Muon step (torch.optim._muon._single_tensor_muon) for 1 or N matrices of one shape."""
    momentum = group["momentum"]
    torch._foreach_lerp_(bufs, grads, 1 - momentum)
    updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
    stacked = torch.stack(updates) if len(updates) > 1 else updates[0]  # N A B, or one A B
    ortho = orthogonalize(stacked, group["ns_coefficients"], group["ns_steps"], group["eps"]).to(params[0].dtype)
    lr = muon_lr(group["lr"], group["adjust_lr_fn"], params[0].shape)
    torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
    torch._foreach_add_(params, list(ortho.unbind(0)) if ortho.dim() == 3 else [ortho], alpha=-lr)


def orthogonalize(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """Newton-Schulz's quintic, as torch.optim.Muon runs it (in bf16, on the wide orientation), on one matrix or a
    batch: (N) A B -> (N) A B bf16, each matrix's singular values pushed into a band around 1."""
    a, b, c = coefficients
    tall = g.size(-2) > g.size(-1)
    x = g.bfloat16()
    x = x.mT if tall else x  # (N) R C with R <= C: the Gram matrices are the small side
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    mul_add = torch.baddbmm if x.dim() == 3 else torch.addmm
    for _ in range(steps):
        gram = x @ x.mT  # (N) R R
        x = mul_add(x, mul_add(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # (N) R C
    return x.mT if tall else x


def muon_lr(lr: float, adjust_lr_fn: Optional[str], shape: torch.Size) -> float:
    """Muon's per-shape lr (torch.optim._muon._adjust_lr): "original" sqrt(max(1, A/B)), "match_rms_adamw"
    0.2 sqrt(max(A, B)), otherwise lr as it is."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the matrix group and AdamW on the others, stepped, scheduled and checkpointed as one optimizer.

    This one holds the very group dicts and state the two step (shared, not copies), so param_groups is in
    KINDS order, state_dict() is a single optimizer's (each group's "optimizer" key names its owner) and
    torch's load_state_dict works unchanged; the two are re-pointed at the loaded groups and state after it."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW) -> None:
        self.optimizers = {MUON: muon, ADAMW: adamw}
        # Muon holds only the matrix group, first in KINDS: concatenating keeps KINDS order. "capturable" is
        # the flag XlaBackend.compile_step sets through `defaults` for AdamW's on-device step count; Muon ignores it.
        super().__init__([*muon.param_groups, *adamw.param_groups], defaults={"capturable": False})
        self._share()

    def _share(self) -> None:
        """Point each torch optimizer at its groups and the state here (after a load: at the loaded ones)."""
        for name, opt in self.optimizers.items():
            opt.param_groups = [g for g in self.param_groups if g.get("optimizer") == name]
            opt.state = self.state
            if not opt.param_groups:
                raise ValueError(f"no parameter group is marked for {name}; groups: "
                                 f"{[g.get('optimizer') for g in self.param_groups]}")

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = self.optimizers[MUON].step(closure)  # Muon evaluates the closure (with grad) before it steps
        self.optimizers[ADAMW].step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Share of each group's base lr at optimizer step `step` (0-based): 1.0 at the peak, min_lr_ratio at the
    floor. Linear warmup over warmup_steps, then cosine (half a cosine down to the floor at max_steps), wsd
    (flat, then linear decay over the last decay_fraction of the steps) or constant."""
    floor = cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        decay_steps = max(1, int(round(cfg.max_steps * cfg.decay_fraction)))
        decay_start = cfg.max_steps - decay_steps
        if step < decay_start:
            return 1.0
        frac = min(1.0, (step - decay_start + 1) / decay_steps)
        return 1.0 + (floor - 1.0) * frac
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return floor + 0.5 * (1.0 - floor) * (1 + math.cos(math.pi * frac))


def apply_schedule(optimizer: torch.optim.Optimizer, multiplier: float) -> None:
    """Scale each group's own base lr: one shared lr written into every group would erase per-group lrs."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier


def load_state_dict(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a saved state_dict into `optimizer` (build_optimizer's, same model). The trajectory (moments, step
    counts, lr, betas, ...) comes from the checkpoint; RUN_KEYS and the implementation flags from this run, which
    torch's load would replace with the saved groups'. Another optimizer's or other groups' state: ValueError."""
    current = [{k: g[k] for k in RUN_KEYS + IMPL_KEYS if k in g} for g in optimizer.param_groups]
    saved_name, name = optimizer_name(state["param_groups"]), optimizer_name(optimizer.param_groups)
    if saved_name != name:  # torch would load AdamW moments as Muon momentum (or fail halfway) without a word
        raise ValueError(f"the saved optimizer state is {saved_name}'s and this run's optimizer is {name} "
                         f"(optim.name): one's moments mean nothing to the other. Resume with "
                         f"`--optim.name={saved_name}`, or start a new run to train with {name}")
    saved_kinds = [g.get("kind") for g in state["param_groups"]]
    kinds = [g.get("kind") for g in current]
    if None in saved_kinds:
        raise ValueError("its parameter groups have no kind (the two-group layout nanopt wrote before parameter "
                         "kinds), which this version does not resume. Resume with the nanopt that wrote it, or start "
                         "a new run (a new `run.dir`)")
    if saved_kinds != kinds:  # torch would only compare group sizes, and could load moments into wrong params
        raise ValueError(f"the saved optimizer has parameter groups {saved_kinds}, this model has {kinds}")
    optimizer.load_state_dict(state)
    for group, keys in zip(optimizer.param_groups, current):
        group.update(keys)  # e.g. a CUDA checkpoint's fused=True would fail on XLA, an XLA one's foreach on CPU
        _place_steps(optimizer, group)


def optimizer_name(groups: list[dict]) -> str:
    """optim.name of the optimizer these param groups (live or saved) belong to: muon when Muon steps any."""
    return MUON if any(g.get("optimizer") == MUON for g in groups) else ADAMW


def _place_steps(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """Put each step count where this run's flags want it (torch's load follows the saved flags): fused and
    capturable AdamW read a float32 tensor beside the param, the others a host one (no sync every step)."""
    on_device = bool(group.get("fused") or group.get("capturable"))
    for p in group["params"]:
        step = optimizer.state.get(p, {}).get("step")
        if isinstance(step, torch.Tensor):
            want = p.device if on_device else torch.device("cpu")
            if step.device != want or (on_device and step.dtype != torch.float32):
                optimizer.state[p]["step"] = step.to(dtype=torch.float32 if on_device else step.dtype, device=want)
