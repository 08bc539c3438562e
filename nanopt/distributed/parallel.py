"""THE parallelism (runtime.parallel): DDP replicas, FSDP2 shards on a 1-D DeviceMesh, or HSDP (FSDP2 on a 2-D
(replicate, shard) mesh); what the train step asks of each (micro-step sync, gradient clipping, zeroing), and whole
weights loaded into any of them (train.init_from). Checkpoints need nothing here: DCP reshards (checkpoint.py).

Everything else sees one model object: under ddp the unwrapped model (DDP wraps a view of it for the step), under
fsdp and hsdp the model itself, sharded in place by fully_shard (its parameters become DTensors, forward gathers
them). Without torchrun (world size 1) all three mean one process and the model is left as it is."""
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


def _dtensor_type() -> Optional[type]:
    """DTensor when torch.distributed.tensor is loaded, else None: nothing can be one then. Importing it costs
    0.6-1.8 s, so only an fsdp run loads it (in shard())."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` holds DTensor parameters (fsdp across ranks): every rank must then run its forward passes
    (sampling, evaluation) together, and its state is gathered to be saved."""
    return any(is_dtensor(p) for p in model.parameters())


def shard(model: nn.Module, cfg: Config, rt: Runtime) -> None:
    """runtime.parallel=fsdp or hsdp across ranks: fully_shard each transformer block, then the root (embedding,
    head, final norm), on the mesh, in place. Before the optimizer is built: it must hold the sharded parameters.
    Otherwise (ddp, or one process) nothing."""
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
        # Gloo's reduce-scatter once took ReduceOp.AVG for a SUM (pytorch#162338): the ranks' gradients were summed,
        # not averaged. SUM plus FSDP2's own division is right on every torch; the extra division costs nothing.
        # The setting is per FSDP module (it does not recurse).
        for module in (*model.layers, model):
            module.set_force_sum_reduction_for_comms(True)


def _mesh(cfg: Config, rt: Runtime) -> Any:
    """fsdp: a 1-D mesh over every rank. hsdp: a 2-D (replicate, shard) mesh whose rows are the shard groups of
    consecutive ranks (one node's under the default), so the parameter all-gathers and gradient reduce-scatters
    stay inside a group and only the all-reduce of each shard's gradient crosses groups. fully_shard reads a 2-D
    mesh as HSDP; parameters are DTensors placed (Replicate(), Shard(0))."""
    from torch.distributed.device_mesh import init_device_mesh

    if cfg.runtime.parallel == "fsdp":
        return init_device_mesh(rt.device.type, (rt.world_size,), mesh_dim_names=("shard",))
    replicas, group = cfg.runtime.hsdp_mesh(rt.world_size, rt.local_world_size)
    return init_device_mesh(rt.device.type, (replicas, group), mesh_dim_names=("replicate", "shard"))


def no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's keyword for "no buffer broadcast before each forward". The only buffers are the RoPE tables, computed
    identically on every rank, and DDP's default would send them from rank 0 every micro-step. torch 2.13 names it
    forward_sync_buffers (the old broadcast_buffers warns once per rank there; the new one still syncs them once at
    construction, which is harmless for identical tables); torch 2.9, the floor, knows only broadcast_buffers."""
    renamed = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    return {"forward_sync_buffers": False} if renamed else {"broadcast_buffers": False}


def wrap(model: nn.Module, rt: Runtime) -> nn.Module:
    """The module the train step calls: DDP over `model` across ranks under ddp, else `model` itself (a sharded
    model reduce-scatters its own gradients)."""
    if not rt.distributed or is_sharded(model):
        return model
    return DDP(model, device_ids=rt.backend.ddp_device_ids, gradient_as_bucket_view=True, **no_forward_buffer_sync())


def accumulating(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Around one micro-step's forward and backward. DDP: no_sync() until the last micro-step, which all-reduces
    the sum once. FSDP: every micro-step reduce-scatters its gradients into the shards, so a rank never holds more
    than its shard of them between micro-steps; skipping it (set_requires_gradient_sync(False)) would save
    accum - 1 reduce-scatters but keep every whole gradient in fp32 on every rank, 4 bytes per parameter (32 GB at
    8B), which is the memory fsdp is chosen to save. HSDP: the same inside each shard group, and the all-reduce
    across the replicas (the traffic between nodes) only on the last micro-step: that one pays, for no memory."""
    if last:
        return contextlib.nullcontext()
    if isinstance(model, DDP):
        return model.no_sync()
    if _replicated(model):
        return _hsdp_no_all_reduce(model)
    return contextlib.nullcontext()


def _replicated(model: nn.Module) -> bool:
    """Whether `model` is sharded on a 2-D (replicate, shard) mesh: hsdp."""
    p = next(model.parameters(), None)
    return is_dtensor(p) and p.device_mesh.ndim == 2


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
    """Whether `t` is a DTensor (a parameter, moment or average of a sharded model)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


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
    """Around forwards every rank runs apart from the train step (task scoring), each rank the same ones: a sharded
    model's forward is a collective (each block gathers its weights from every rank), so a rank that fails before
    its last forward would leave the others waiting forever. Each forward (its embedding, the first thing a forward
    or model.hidden runs) starts with a vote: when a rank has stopped, the others' forward raises Broken and they
    stop too; on the way out every rank votes "stopped" until all have. A failure inside a forward, between two
    collectives, still hangs, as it does in training. The root's own weights (embedding, final norm, head) stay
    gathered throughout, since the scorers call model.hidden and model.logits, which FSDP's forward hooks do not
    see; the blocks gather theirs in their own calls. Not sharded: nothing."""
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
