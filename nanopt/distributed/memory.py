"""What one device holds while a model trains, read from its modules (a meta-device model for `nanopt estimate` and
bench/fsdp_memory.py): parameters, gradients, optimizer state and activations per device under each parallelism
(ddp, fsdp over n ranks, hsdp sharded over groups of g), and whether that fits a device's memory.

An estimate of the eager step (docs/mfu.md "Memory per GPU" has the formulas and what they leave out): torch.compile
fuses and usually saves less. Bytes, not GiB, throughout."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch.nn as nn

from nanopt.config import Config
from nanopt.recipe.mfu import param_counts
from nanopt.recipe.model import RESIDUAL_OUT
from nanopt.training.plan import build_plan

# Blocks whose whole compute-dtype weights exist at once under fsdp: the one running and the next, whose all-gather
# FSDP2 prefetches (forward and backward) so that communication overlaps compute.
GATHERED_BLOCKS = 2
FP32 = 4


@dataclass(frozen=True)
class Training:
    """What, beyond the model's shape, sets a device's memory."""

    precision: str  # train.precision: bf16 | bf16-pure | fp32
    optimizer: str  # optim.name: adamw | muon
    micro_batch_size: int
    seq_len: int
    loss_chunk_tokens: int  # train.loss_chunk_tokens (0: the whole micro-batch's logits at once)
    recompute: bool = False  # train.recompute: each block's activations recomputed in backward


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device holds at the step's peak (the end of the forward pass), by what they are."""

    parallel: str  # ddp | fsdp | hsdp
    shard_ranks: int  # ranks a tensor is sharded over: 1 under ddp
    params: int  # the fp32 (bf16-pure: bf16) weights, or this rank's shard, plus the compute copies alive
    grads: int
    optimizer: int
    activations: int  # saved for backward at one micro-batch, plus the loss's logits
    transient: int = 0  # of params and grads: what exists only during a step (gathered, unreduced, autocast copies)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def resident(self) -> int:
        """Parameters, gradients and optimizer state held between steps: what bench/fsdp_memory.py measures."""
        return self.params + self.grads + self.optimizer - self.transient

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total, "resident": self.resident}


def _dtypes(precision: str) -> tuple[int, int]:
    """(bytes of a stored weight, gradient, optimizer moment and of the residual stream (fp32 under bf16 autocast
    too: embedding + bf16 block outputs); bytes of a computed activation and of the weights a matmul reads).
    bf16 keeps fp32 weights and computes in bf16 copies; bf16-pure stores bf16; fp32 both fp32."""
    return {"bf16": (4, 2), "bf16-pure": (2, 2), "fp32": (4, 4)}[precision]


def activation_bytes_per_token(block: nn.Module, precision: str) -> int:
    """Bytes one block (a model.layers module) saves for backward per token, read from its modules (eager model.py;
    checked against autograd's saved tensors in tests/test_memory.py). s = the activation dtype's bytes:
    - each norm: its fp32 normalised input and its output in s (the next Linears' shared input), bf16-pure also the
      bf16 copy the gain multiplies: (4 + s) × its width, or (4 + 2s);
    - each attention module: SDPA's q, k, v and output (s·(2·q_dim + 2·kv_dim); fp32 with grouped-query attention
      repeats K/V to q_dim on CUDA, attention.choose), its fp32 log-sum-exp per head, with qk_norm the fp32
      normalised q and k; RoPE keeps only its tables;
    - each other Linear that does not write the residual stream (SwiGLU's w1 and w3, relu2's w1): its output and the
      elementwise result made of it, 2·out·s (SwiGLU: w1, w3, silu and the product; relu2: the relu and its square);
    - scalar parameters (residual_scalars): the block input (x0 is shared)."""
    weight, s = _dtypes(precision)  # the residual stream is stored like the weights
    total, in_attention = 0, set()
    for m in block.modules():
        if hasattr(m, "n_heads") and hasattr(m, "head_dim"):  # model.Attention, or a variant's
            q_dim, kv_dim = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
            sdpa_kv = q_dim if precision == "fp32" else kv_dim
            qk_norm = FP32 * (q_dim + kv_dim) if getattr(m, "qk_norm_eps", None) is not None else 0
            total += s * (2 * q_dim + 2 * sdpa_kv) + FP32 * m.n_heads + qk_norm
            in_attention |= {id(x) for x in m.modules()}
        elif "Norm" in type(m).__name__:
            total += (4 + (2 * s if precision == "bf16-pure" else s)) * m.weight.numel()
        elif isinstance(m, nn.Linear) and id(m) not in in_attention and not getattr(m, RESIDUAL_OUT, False):
            total += 2 * s * m.out_features
    scalars = any(p.numel() == 1 for p in block.parameters())
    return total + (weight * _dim(block) if scalars else 0)


def _dim(model: nn.Module) -> int:
    """The residual stream's width: the first Linear's input."""
    return next(m.in_features for m in model.modules() if isinstance(m, nn.Linear))


def activation_bytes(model: nn.Module, t: Training) -> int:
    """Saved activations of one micro-batch: every block's (with recompute: every block's input, plus the largest
    block's activations while it is recomputed), the final norm, and the loss's logits over one chunk of positions:
    the logits in s, their fp32 log-softmax and its gradient (s + 8 bytes per position and vocabulary entry)."""
    tokens, (weight, s), dim = t.micro_batch_size * t.seq_len, _dtypes(t.precision), _dim(model)
    blocks = [activation_bytes_per_token(b, t.precision) * tokens for b in model.layers]
    saved = len(blocks) * weight * dim * tokens + max(blocks) if t.recompute else sum(blocks)
    positions = min(t.loss_chunk_tokens, tokens) if t.loss_chunk_tokens > 0 else tokens
    return saved + (4 + s) * dim * tokens + (s + 8) * positions * model.lm_head.out_features


def device_memory(model: nn.Module, t: Training, parallel: str, shard_ranks: int = 1) -> DeviceMemory:
    """One device's bytes under `parallel` (ddp; fsdp over shard_ranks = the world; hsdp over shard_ranks = the
    shard group size, replicated across groups), `model` a meta-device one (mfu.meta_model) or any other:
    - ddp: everything whole; bf16 adds autocast's bf16 copy of every matmul weight (saved for backward).
    - fsdp / hsdp: weights, gradients and moments divided by shard_ranks, plus what is whole at the peak: the root
      (what is outside the blocks: embedding, head, final norm; gathered for the whole step) and GATHERED_BLOCKS
      blocks in the compute dtype, and the whole gradients of the head and one block before their reduce-scatter
      (fp32 for it). Gradient accumulation adds nothing: every micro-step reduce-scatters into the shards.
    Activations are per micro-batch and the same under every parallelism (each rank runs its own rows)."""
    counts, (weight, compute) = param_counts(model), _dtypes(t.precision)
    # AdamW: two moments per parameter, stored like the weights; Muon: one momentum buffer per block matrix instead.
    optimizer = weight * (2 * counts.total - (counts.block_matmuls if t.optimizer == "muon" else 0))
    activations = activation_bytes(model, t)
    if parallel == "ddp":
        copies = compute * (counts.block_matmuls + counts.lm_head) if t.precision == "bf16" else 0
        return DeviceMemory("ddp", 1, weight * counts.total + copies, weight * counts.total, optimizer, activations,
                            copies)
    n, blocks = shard_ranks, [sum(p.numel() for p in b.parameters()) for b in model.layers]
    block, root = max(blocks), counts.total - sum(blocks)
    gathered = compute * (root + GATHERED_BLOCKS * block)
    # At the peak (backward's start) the head's whole gradient is out (the root reduces last), and one block's:
    # in the compute dtype, plus the fp32 copy its reduce-scatter takes.
    unreduced = compute * counts.lm_head + (compute + (FP32 if compute != FP32 else 0)) * block
    shard = -(-weight * counts.total // n)  # ceil
    return DeviceMemory(parallel, n, shard + gathered, shard + unreduced, -(-optimizer // n), activations,
                        gathered + unreduced)


def every_parallelism(m: nn.Module, t: Training, devices: int,
                      shard_group_size: Optional[int] = None) -> list[DeviceMemory]:
    """ddp, fsdp over `devices`, and hsdp over groups of shard_group_size when that is a real middle (1 < g <
    devices and g divides devices); one device: ddp alone (every parallelism is one process there)."""
    rows = [device_memory(m, t, "ddp")]
    if devices > 1:
        rows.append(device_memory(m, t, "fsdp", devices))
    if (g := shard_group_size) is not None and 1 < g < devices and devices % g == 0:
        rows.append(device_memory(m, t, "hsdp", g))
    return rows


def config_memory(cfg: Config, model: nn.Module, devices: int, shard_group_size: Optional[int] = None,
                  recompute: bool = False) -> list[DeviceMemory]:
    """every_parallelism for a config's model (mfu.meta_model) on `devices`, each at its most demanding stage of the
    plan (the longest sequences); `recompute` as if train.recompute were on."""
    t = cfg.train
    per_stage = [every_parallelism(model, Training(t.precision, cfg.optim.name, t.micro_batch_size, s.seq_len,
                                                   t.loss_chunk_tokens, recompute or t.recompute),
                                   devices, shard_group_size) for s in build_plan(t, devices).stages]
    return [max(rows, key=lambda r: r.total) for rows in zip(*per_stage)]
