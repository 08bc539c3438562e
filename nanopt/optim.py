"""Optimizer parameter groups by kind, the learning-rate schedule as a multiplier (a pure function of step),
and optimizer-state loading that resumes checkpoints written with the older two-group layout."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from nanopt.config import TrainConfig
from nanopt.runtime import fused_adamw_supported

# Group order is fixed: the optimizer's state_dict indexes parameters by their position across groups,
# so a stable order keeps checkpoints loadable.
KINDS = ("matrix", "embedding", "head", "scalar")
# Group keys that belong to this run's config and device rather than to the training trajectory: a resume
# takes them from the freshly built optimizer, never from the checkpoint.
RUN_KEYS = ("kind", "base_lr", "weight_decay")
IMPL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def kind_hparams(kind: str, cfg: TrainConfig) -> tuple[float, float]:
    """(base lr, weight decay) of one kind. Per-kind config keys, when they come, are one line each here.

    Scalars (RMSNorm gains) never decay: pulling a gain toward zero shrinks the whole layer's output,
    which is not what weight decay is for.
    """
    if kind == "scalar":
        return cfg.lr, 0.0
    if kind in ("matrix", "embedding", "head"):
        return cfg.lr, cfg.weight_decay
    raise ValueError(f"unknown parameter kind {kind!r}; expected one of {KINDS}")


def param_kind(p: torch.Tensor, embedding_ids: set[int], head_ids: set[int]) -> str:
    """A parameter's kind from where it sits in the model, not from its name."""
    if p.ndim < 2:  # first, so no vector (a gain, a bias) ever decays, whichever module holds it
        return "scalar"
    if id(p) in embedding_ids:  # before head: a tied LM head is the embedding matrix, one param
        return "embedding"
    if id(p) in head_ids:
        return "head"
    return "matrix"


def param_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    """One group per non-empty kind, in KINDS order; each carries kind, base_lr, weight_decay and params.

    Every trainable parameter appears exactly once (model.parameters() yields a tied weight once).
    """
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
            lr, wd = kind_hparams(kind, cfg)
            groups.append({"kind": kind, "base_lr": lr, "weight_decay": wd, "params": params})
    return groups


def build_optimizer(model: nn.Module, cfg: TrainConfig, device_kind: str) -> torch.optim.Optimizer:
    """AdamW over the kind groups, each starting at its base lr (apply_schedule scales it every step)."""
    groups = [dict(g, lr=g["base_lr"]) for g in param_groups(model, cfg)]
    # fused AdamW is one kernel per step on CUDA (and a vectorised loop on CPU); foreach elsewhere.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=fused_adamw_supported(device_kind))


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Share of each group's base lr at optimizer step `step` (0-based): 1.0 at the peak, min_lr_ratio at the floor.

    Linear warmup to the peak over warmup_steps, then:
      cosine   - half a cosine from the peak down to min_lr_ratio at max_steps
      wsd      - flat (warmup-stable), then linear decay over the last decay_fraction of the steps
      constant - flat
    """
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


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of a group whose base lr is cfg.lr (what the schedule looks like in absolute terms)."""
    return cfg.lr * lr_multiplier(step, cfg)


def apply_schedule(optimizer: torch.optim.Optimizer, multiplier: float) -> None:
    """Scale each group's own base lr: one shared lr written into every group would erase per-group lrs."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier


# ---------------------------------------------------------------- loading optimizer state


def load_state_dict(optimizer: torch.optim.Optimizer, model: nn.Module, state: dict) -> None:
    """Load a saved optimizer state_dict into `optimizer` (built by build_optimizer for `model`).

    Accepts the current kind layout and the older two-group layout ([every >=2-D param, every <2-D param],
    no "kind"), whose per-parameter state is moved onto the kind groups by parameter identity. The
    trajectory (moments, step counts, lr, betas, eps) comes from the checkpoint; kind, base_lr,
    weight_decay and the implementation flags come from this run, since torch's load would otherwise
    replace them with the saved groups' (or drop them, as old groups lack kind and base_lr).
    """
    current = [{k: g[k] for k in RUN_KEYS + IMPL_KEYS if k in g} for g in optimizer.param_groups]
    if _is_legacy(state):
        state = _from_legacy(state, optimizer, model)
    saved_kinds = [g.get("kind") for g in state["param_groups"]]
    kinds = [g.get("kind") for g in current]
    if saved_kinds != kinds:  # torch would only compare group sizes, and could load moments into wrong params
        raise ValueError(f"the saved optimizer has parameter groups {saved_kinds}, this model has {kinds}")
    optimizer.load_state_dict(state)
    for group, keys in zip(optimizer.param_groups, current):
        group.update(keys)
        if group.get("fused") or group.get("capturable"):
            _steps_on_param_device(optimizer, group)


def _is_legacy(state: dict) -> bool:
    groups = state["param_groups"]
    return len(groups) == 2 and not any("kind" in g for g in groups)


def _legacy_order(model: nn.Module) -> list[list[nn.Parameter]]:
    """The two groups the old param_groups built: trainable >=2-D params, then the rest, in parameters() order."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [[p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]]


def _from_legacy(state: dict, optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """The old two-group state_dict rewritten in `optimizer`'s kind layout (the input is left as it was).

    A state_dict keys per-parameter state by the parameter's flat index across groups, so the old index
    of each parameter is found through the model and re-keyed to its index in the new groups. Each new
    group takes its hyperparameters from the old group its parameters came from.
    """
    old_groups = _legacy_order(model)
    saved_lens = [len(g["params"]) for g in state["param_groups"]]
    if saved_lens != [len(g) for g in old_groups]:
        raise ValueError(f"the saved optimizer's groups hold {saved_lens} parameters, this model's old layout "
                         f"{[len(g) for g in old_groups]}: the checkpoint is not of this model")
    old_index: dict[int, tuple[int, int]] = {}  # id(param) -> (old group, old flat index)
    for gi, (params, saved) in enumerate(zip(old_groups, state["param_groups"])):
        old_index.update((id(p), (gi, idx)) for p, idx in zip(params, saved["params"]))
    new_state: dict[int, Any] = {}
    new_groups: list[dict] = []
    flat = 0
    for group in optimizer.param_groups:
        sources = {old_index[id(p)][0] for p in group["params"]}
        if len(sources) != 1:  # cannot happen while scalar == "<2-D": the old split is kept inside kinds
            raise ValueError(f"group {group.get('kind')!r} mixes parameters of both old groups")
        hyper = {k: v for k, v in state["param_groups"][sources.pop()].items() if k != "params"}
        indices = list(range(flat, flat + len(group["params"])))
        for p, idx in zip(group["params"], indices):
            old = old_index[id(p)][1]
            if old in state["state"]:  # a parameter that never stepped has no state
                new_state[idx] = state["state"][old]
        new_groups.append(dict(hyper, kind=group.get("kind"), params=indices))
        flat += len(indices)
    return {"state": new_state, "param_groups": new_groups}


def _steps_on_param_device(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """Fused and capturable AdamW read the step count from a float32 tensor beside the param. torch's load
    places it by the saved group's flags, so a checkpoint from a plain run would leave it on the host."""
    for p in group["params"]:
        step = optimizer.state.get(p, {}).get("step")
        if isinstance(step, torch.Tensor) and step.device != p.device:
            optimizer.state[p]["step"] = step.to(dtype=torch.float32, device=p.device)
