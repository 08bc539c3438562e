"""The averaged weights (train.ema_decay): an fp32 EMA of the parameters in each one's layout, one fused lerp per step
from train.ema_start, swapped into the model for evaluation, saved whole by the checkpointer."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from nanopt.config import Config
from nanopt.distributed.parallel import local_tensor, whole


class EMA:
    """ema = decay × ema + (1 - decay) × weights after each step past `start` (at `start`: the weights; nothing
    allocated before). state_dict() is JSON; the tensors travel through full_weights() and load_tensors()."""

    def __init__(self, model: torch.nn.Module, decay: float, start: int):
        if not 0 < decay < 1:
            raise ValueError(f"an EMA decay is in (0, 1), got {decay}")
        self.model, self.decay, self.start = model, decay, start
        named = list(model.named_parameters())  # a tied parameter once, under its first name, like model_state()
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.averaged: Optional[list[torch.Tensor]] = None

    @classmethod
    def for_config(cls, cfg: Config, model: torch.nn.Module) -> Optional["EMA"]:
        t = cfg.train
        return cls(model, t.ema_decay, t.ema_start) if t.ema_decay > 0 else None

    @property
    def started(self) -> bool:
        return self.averaged is not None

    @torch.no_grad()
    def begin(self, step: int) -> None:
        if self.averaged is None and step >= self.start:
            self.averaged = [p.detach().to(torch.float32, copy=True) for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After step `step`; parameters read each call: FSDP may re-point a local shard at its first forward."""
        if self.averaged is None:
            self.begin(step)
            return
        weights = [local_tensor(p) for p in self.params]
        if weights[0].dtype != torch.float32:  # bf16-pure: lerp takes one dtype
            weights = [w.float() for w in weights]
        torch._foreach_lerp_([local_tensor(a) for a in self.averaged], weights, 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[str]:
        """The averaged weights in the model for the duration; yields "ema" (or "model" before ema_start). In place,
        so optimizer, DDP, compiled graphs and FSDP keep their tensors; fp32 values trade through one scratch tensor,
        a bf16 parameter is kept aside."""
        if self.averaged is None:
            yield "model"
            return
        held = self._swap(None)
        try:
            yield "ema"
        finally:
            self._swap(held)

    @torch.no_grad()
    def _swap(self, held: Optional[list[Optional[torch.Tensor]]]) -> list[Optional[torch.Tensor]]:
        """Swap in (held None: returns what it kept aside) or back (held: what swapping in returned)."""
        pairs = [(local_tensor(p), local_tensor(a)) for p, a in zip(self.params, self.averaged)]
        same = [p.numel() for p, a in pairs if p.dtype == a.dtype]
        scratch = torch.empty(max(same, default=0), dtype=torch.float32, device=pairs[0][0].device)
        kept: list[Optional[torch.Tensor]] = []
        for i, (p, a) in enumerate(pairs):
            if p.dtype == a.dtype:  # an exchange is its own inverse, and exact
                tmp = scratch[:p.numel()].view_as(p)
                tmp.copy_(p)
                p.copy_(a)
                a.copy_(tmp)
                kept.append(None)
            elif held is None:
                kept.append(p.clone())
                p.copy_(a)
            else:
                p.copy_(held[i])
        self._reshard()
        return kept

    def _reshard(self) -> None:
        """FSDP keeps gathered weights after a no-grad forward; they would survive a swap stale, so all drop them."""
        for module in self.model.modules():
            if hasattr(module, "set_requires_gradient_sync") and hasattr(module, "reshard"):  # an FSDPModule
                module.reshard()

    # ------------------------------------------------------------ what a checkpoint holds
    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "start": self.start, "started": self.started}

    def full_weights(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """The average as whole CPU tensors by name; every rank calls it, those with keep=False get {}."""
        out = {}
        for name, a in zip(self.names, self.averaged or []):
            gathered = whole(a)  # every rank takes part in a sharded average's gather
            if keep:
                out[name] = gathered.detach().to("cpu").contiguous()
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.averaged or []))

    @torch.no_grad()
    def load_tensors(self, fill: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """The average from fill(tensors), which fills each named tensor in place (a sharded checkpoint's reader)."""
        tensors = {n: p.detach().to(torch.float32, copy=True) for n, p in zip(self.names, self.params)}
        fill(tensors)
        self.averaged = [tensors[n] for n in self.names]
