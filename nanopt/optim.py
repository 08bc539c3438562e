"""AdamW with decay only on matrices, and the learning-rate schedule as a pure function of step."""
from __future__ import annotations

import math

import torch

from nanopt.config import TrainConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (linear weights, embeddings) decay; vectors (RMSNorm gains) do not.

    Decaying a norm gain pulls it toward zero, which shrinks the whole layer's output: not what
    weight decay is for.
    """
    decay, no_decay = [], []
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device_kind: str) -> torch.optim.AdamW:
    # fused AdamW is one kernel per step on CUDA (and a vectorised loop on CPU); foreach elsewhere.
    from nanopt.runtime import fused_adamw_supported

    fused = fused_adamw_supported(device_kind)
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        fused=fused,
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Linear warmup to cfg.lr over warmup_steps, then:
      cosine   - half a cosine from lr down to lr × min_lr_ratio at max_steps
      wsd      - flat (warmup-stable), then linear decay over the last decay_fraction of the steps
      constant - flat
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "wsd":
        decay_steps = max(1, int(round(cfg.max_steps * cfg.decay_fraction)))
        decay_start = cfg.max_steps - decay_steps
        if step < decay_start:
            return peak
        frac = min(1.0, (step - decay_start + 1) / decay_steps)
        return peak + (floor - peak) * frac
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * frac))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
