"""THE parallelism (runtime.parallel): DDP replicas, FSDP2 shards on a 1-D DeviceMesh, or HSDP (FSDP2 on a 2-D
(replicate, shard) mesh); what the train step asks of each (micro-step sync, clipping, zeroing), and whole weights
loaded into any of them. Checkpoints need nothing here: DCP reshards (checkpoint.py).

Everything else sees one model object: under ddp the unwrapped model (DDP wraps it for the step), under fsdp and
hsdp the model itself, sharded in place by fully_shard. Without torchrun all three leave the model as it is."""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nanopt.config import Config
from nanopt.distributed.runtime import Runtime

# train.precision -> FSDP2's MixedPrecisionPolicy (param_dtype, reduce_dtype): bf16 gathers bf16 parameters and
# computes in them; every precision reduces gradients in fp32, so the mean over ranks is not rounded to bf16.
PRECISION_DTYPES: dict[str, tuple[Optional[torch.dtype], Optional[torch.dtype]]] = {
    "bf16": (torch.bfloat16, torch.float32), "bf16-pure": (None, torch.float32), "fp32": (None, None)}


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` holds DTensor parameters (fsdp across ranks): every rank must then run its forward passes
    (sampling, evaluation) together, and its state is gathered to be saved."""
    return any(is_dtensor(p) for p in model.parameters())


def shard(model: nn.Module, cfg: Config, rt: Runtime) -> None:
    """fsdp or hsdp across ranks: fully_shard each block, then the root (embedding, head, final norm), in place,
    before the optimizer is built (it must hold the sharded parameters). Otherwise (ddp, one process) nothing."""
    if cfg.runtime.parallel == "ddp" or not rt.distributed:
        return
    # Lazy: torch.distributed.fsdp loads torch.distributed.tensor (seconds at import), which no ddp run should pay.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _mesh(cfg, rt)
    param_dtype, reduce_dtype = PRECISION_DTYPES[rt.precision]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers:
        # reshard_after_forward (the default for non-root modules): a block's full weights are freed after its
        # forward and gathered again for its backward, so only one block is whole at a time.
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if dist.get_backend() == "gloo":
        # Gloo's reduce-scatter once took AVG for SUM (pytorch#162338): the gradients were summed, not averaged. SUM
        # plus FSDP2's own division is right on every torch. The setting is per FSDP module (it does not recurse).
        for module in (*model.layers, model):
            module.set_force_sum_reduction_for_comms(True)


def _mesh(cfg: Config, rt: Runtime) -> Any:
    """fsdp: a 1-D mesh over every rank. hsdp: a 2-D (replicate, shard) mesh whose rows are shard groups of
    consecutive ranks (one node's by default): all-gathers and reduce-scatters stay inside a group, and only the
    all-reduce of each shard's gradient crosses groups."""
    from torch.distributed.device_mesh import init_device_mesh

    if cfg.runtime.parallel == "fsdp":
        return init_device_mesh(rt.device.type, (rt.world_size,), mesh_dim_names=("shard",))
    replicas, group = cfg.runtime.hsdp_mesh(rt.world_size, rt.local_world_size)
    return init_device_mesh(rt.device.type, (replicas, group), mesh_dim_names=("replicate", "shard"))


def no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's keyword for "no buffer broadcast before each forward" (the only buffers, the RoPE tables, are the same on
    every rank): forward_sync_buffers on torch 2.13, where broadcast_buffers warns; the floor, 2.9, knows only that."""
    renamed = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    return {"forward_sync_buffers": False} if renamed else {"broadcast_buffers": False}


def wrap(model: nn.Module, rt: Runtime) -> nn.Module:
    """The module the train step calls: DDP over `model` across ranks under ddp, else `model` itself (a sharded
    model reduce-scatters its own gradients)."""
    if not rt.distributed or is_sharded(model):
        return model
    return DDP(model, device_ids=rt.backend.ddp_device_ids, gradient_as_bucket_view=True, **no_forward_buffer_sync())


def accumulating(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Around one micro-step's forward and backward. DDP: no_sync() until the last micro-step. FSDP: every
    micro-step reduce-scatters into the shards; skipping it would keep every whole fp32 gradient on every rank
    (32 GB at 8B), the memory fsdp is chosen to save. HSDP: the same inside each shard group, and the all-reduce
    across replicas (between nodes) only on the last micro-step: that saving costs no memory."""
    if last:
        return contextlib.nullcontext()
    if isinstance(model, DDP):
        return model.no_sync()
    p = next(model.parameters(), None)
    if is_dtensor(p) and p.device_mesh.ndim == 2:  # hsdp
        return _hsdp_no_all_reduce(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _hsdp_no_all_reduce(model: Any):
    model.set_requires_all_reduce(False)  # an FSDPModule; recurses into the blocks
    try:
        yield
    finally:
        model.set_requires_all_reduce(True)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients to a total norm of max_norm; the norm before clipping, a plain tensor. On sharded
    gradients torch's clip_grad_norm_ sums each shard's squares across ranks (a partial DTensor norm): the norm
    of the whole gradient, equal to DDP's."""
    return whole(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def grads_in_buckets(model: nn.Module) -> bool:
    """Whether the gradients are views of DDP's buckets: zeroed in place then, not freed (see train_step)."""
    return isinstance(model, DDP)


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a DTensor (a parameter, moment or average of a sharded model). Importing
    torch.distributed.tensor costs 0.6-1.8 s, so only an fsdp run loads it (shard()): otherwise nothing is one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered from every rank (every rank calls it), any other tensor as it is."""
    return t.full_tensor() if is_dtensor(t) else t


# ---------------------------------------------------------------- forwards outside the train step, on every rank
class Broken(RuntimeError):
    """Another rank stopped its forwards under lockstep (its own error is the cause)."""


class _Vote:
    """The ranks' agreement before each forward under lockstep: one all_reduce of one integer, how many still run."""

    def __init__(self, rt: Runtime):
        self.rt, self.broken = rt, False

    def _running(self, me: bool) -> int:
        return int(self.rt.all_reduce_sum(torch.tensor([int(me)], device=self.rt.device)).item())

    def before_forward(self, module: nn.Module, args: Any) -> None:
        if self.broken or self._running(True) < self.rt.world_size:
            self.broken = True  # no second vote from this rank: it is already counted as stopped
            raise Broken("another rank stopped scoring; its error is the cause")

    def finish(self) -> None:
        """Vote "stopped" until no rank runs: a rank still running sees the vote fall short and stops too."""
        while self._running(False):
            pass


@contextlib.contextmanager
def lockstep(model: nn.Module, rt: Runtime) -> Iterator[None]:
    """Around forwards every rank runs apart from the train step (task scoring): a sharded model's forward is a
    collective, so a rank that fails before its last forward would leave the others waiting forever. Each forward
    (its embedding) starts with a vote: when a rank has stopped, the others' forward raises Broken; on the way out
    every rank votes "stopped" until all have (a failure between two collectives still hangs, as in training). The
    root's weights stay gathered throughout: the scorers call model.hidden and model.logits, which FSDP's hooks do
    not see. Not sharded: nothing."""
    if not is_sharded(model):
        yield
        return
    with torch.no_grad():  # the root's first forward initialises FSDP's root state; one token, discarded
        model(torch.zeros(1, 1, dtype=torch.long, device=rt.device))
    model.unshard()
    vote = _Vote(rt)
    hook = model.embed.register_forward_pre_hook(vote.before_forward)
    try:
        yield
    finally:
        hook.remove()
        vote.finish()
        model.reshard()


# ---------------------------------------------------------------- whole weights into a model, whatever the parallelism
def load_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Whole weights (a Hugging Face import) into `model`, each rank keeping its shard of a sharded one:
    (missing, unexpected)."""
    if not is_sharded(model):
        return model.load_state_dict(weights, strict=False)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    return set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
