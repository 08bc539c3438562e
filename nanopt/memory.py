"""What one device holds while a config trains, from the config alone (torch-free, for `nanopt estimate` and
bench/fsdp_memory.py): parameters, gradients, optimizer state and activations per device under each parallelism
(ddp, fsdp over n ranks, hsdp sharded over groups of g), and whether that fits a device's memory.

An estimate of the eager step (docs/mfu.md "Memory per GPU" has the formulas and what they leave out): torch.compile
fuses and usually saves less. Bytes, not GiB, throughout."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from nanopt.config import Config, ModelConfig
from nanopt.flops import param_counts
from nanopt.plan import build_plan

PARALLELISMS = ("ddp", "fsdp", "hsdp")
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
    """(bytes of a stored weight, gradient and optimizer moment; bytes of a computed activation and of the weights
    a matmul reads). bf16 keeps fp32 weights and computes in bf16 copies; bf16-pure stores bf16; fp32 both fp32."""
    return {"bf16": (4, 2), "bf16-pure": (2, 2), "fp32": (4, 4)}[precision]


def activation_bytes_per_token(m: ModelConfig, precision: str) -> int:
    """Bytes one block saves for backward per token (eager model.py; checked against autograd's saved tensors in
    tests/test_memory.py). s = the activation dtype's bytes:
    - each RMSNorm: its fp32 normalised input (4·dim) and its output in s (the next Linears' shared input), bf16-pure
      also the bf16 copy the gain multiplies (so 4 + 2s);
    - attention: SDPA's q, k, v and output (s·(2·q_dim + 2·kv_dim); fp32 with grouped-query attention repeats K/V
      to q_dim on CUDA, attention.choose) and its fp32 log-sum-exp per head; RoPE keeps only its tables;
    - SwiGLU: w1's and w3's outputs, silu's and the product (4·ffn·s); relu2: the relu and its square (2·ffn·s);
    - qk_norm adds the fp32 normalised q and k, residual_scalars the block input (x0 is shared)."""
    s = _dtypes(precision)[1]
    q_dim, kv_dim = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    norm = (4 + (2 * s if precision == "bf16-pure" else s)) * m.dim
    sdpa_kv = q_dim if precision == "fp32" and kv_dim != q_dim else kv_dim
    attention = s * (2 * q_dim + 2 * sdpa_kv) + FP32 * m.n_heads
    mlp = (2 if m.mlp == "relu2" else 4) * m.ffn_dim * s
    extras = (FP32 * (q_dim + kv_dim) if m.qk_norm else 0) + (_residual_bytes(precision) * m.dim
                                                              if m.residual_scalars else 0)
    return 2 * norm + attention + mlp + extras


def _residual_bytes(precision: str) -> int:
    """The residual stream's dtype: fp32 under bf16 autocast too (embedding + bf16 block outputs), bf16 in pure."""
    return 2 if precision == "bf16-pure" else FP32


def activation_bytes(m: ModelConfig, t: Training) -> int:
    """Saved activations of one micro-batch: every block's (with recompute: every block's input, plus one block's
    activations while it is recomputed), the final norm, and the loss's logits over one chunk of positions: the
    logits in s, their fp32 log-softmax and its gradient (s + 8 bytes per position and vocabulary entry)."""
    tokens, s = t.micro_batch_size * t.seq_len, _dtypes(t.precision)[1]
    block = activation_bytes_per_token(m, t.precision) * tokens
    blocks = (m.n_layers * _residual_bytes(t.precision) * m.dim * tokens + block if t.recompute
              else m.n_layers * block)
    positions = min(t.loss_chunk_tokens, tokens) if t.loss_chunk_tokens > 0 else tokens
    return blocks + (4 + s) * m.dim * tokens + (s + 8) * positions * m.vocab_size


def _optimizer_bytes(m: ModelConfig, t: Training, weight: int) -> int:
    """AdamW: two moments per parameter; Muon: one momentum buffer per block matrix, AdamW's two for the rest.
    Moments are stored like the weights (fp32, or bf16 under bf16-pure)."""
    counts = param_counts(m)
    if t.optimizer == "muon":
        return weight * (counts.block_matmuls + 2 * (counts.total - counts.block_matmuls))
    return 2 * weight * counts.total


def device_memory(m: ModelConfig, t: Training, parallel: str, shard_ranks: int = 1) -> DeviceMemory:
    """One device's bytes under `parallel` (ddp; fsdp over shard_ranks = the world; hsdp over shard_ranks = the
    shard group size, replicated across groups):
    - ddp: everything whole; bf16 adds autocast's bf16 copy of every matmul weight (saved for backward).
    - fsdp / hsdp: weights, gradients and moments divided by shard_ranks, plus what is whole at the peak: the root
      (embedding, head, final norm: gathered for the whole step) and GATHERED_BLOCKS blocks in the compute dtype,
      and the whole gradients of the head and one block before their reduce-scatter (fp32 for it). Gradient
      accumulation adds nothing: every micro-step reduce-scatters into the shards (parallel.accumulating).
    Activations are per micro-batch and the same under every parallelism (each rank runs its own rows)."""
    if parallel not in PARALLELISMS:
        raise ValueError(f"parallel is one of {PARALLELISMS}, not {parallel!r}")
    counts, (weight, compute) = param_counts(m), _dtypes(t.precision)
    activations, optimizer = activation_bytes(m, t), _optimizer_bytes(m, t, weight)
    if parallel == "ddp":
        copies = compute * (counts.block_matmuls + counts.lm_head) if t.precision == "bf16" else 0
        return DeviceMemory("ddp", 1, weight * counts.total + copies, weight * counts.total, optimizer, activations,
                            copies)
    n = shard_ranks
    root = root_params(m)
    block = (counts.total - root) // m.n_layers
    gathered = compute * (root + GATHERED_BLOCKS * block)
    # At the peak (backward's start) the head's whole gradient is out (the root reduces last), and one block's:
    # in the compute dtype, plus the fp32 copy its reduce-scatter takes.
    unreduced = compute * m.vocab_size * m.dim + (compute + (FP32 if compute != FP32 else 0)) * block
    return DeviceMemory(parallel, n, _ceil(weight * counts.total, n) + gathered,
                        _ceil(weight * counts.total, n) + unreduced, _ceil(optimizer, n), activations,
                        gathered + unreduced)


def root_params(m: ModelConfig) -> int:
    """Parameters outside the blocks, which fsdp shards as one unit (the root): the token embedding, an untied
    head and the final norm's gain."""
    return m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.dim


def _ceil(total: int, n: int) -> int:
    return -(-total // n)


def every_parallelism(m: ModelConfig, t: Training, devices: int,
                      shard_group_size: Optional[int] = None) -> list[DeviceMemory]:
    """ddp, fsdp over `devices`, and hsdp over groups of shard_group_size when that is a real middle (1 < g <
    devices and g divides devices); one device: ddp alone (every parallelism is one process there)."""
    rows = [device_memory(m, t, "ddp")]
    if devices > 1:
        rows.append(device_memory(m, t, "fsdp", devices))
    g = shard_group_size
    if g is not None and 1 < g < devices and devices % g == 0:
        rows.append(device_memory(m, t, "hsdp", g))
    return rows


def training(cfg: Config, seq_len: int, recompute: bool = False) -> Training:
    """The Training of a config's stage (its seq_len); `recompute` as if train.recompute were on."""
    t = cfg.train
    return Training(t.precision, cfg.optim.name, t.micro_batch_size, seq_len, t.loss_chunk_tokens,
                    recompute or t.recompute)


def config_memory(cfg: Config, devices: int, shard_group_size: Optional[int] = None,
                  recompute: bool = False) -> list[DeviceMemory]:
    """every_parallelism for a config on `devices`, each at its most demanding stage of the plan (the longest
    sequences)."""
    stages = build_plan(cfg.train, devices).stages
    per_stage = [every_parallelism(cfg.model, training(cfg, s.seq_len, recompute), devices,
                                   shard_group_size) for s in stages]
    return [max(rows, key=lambda r: r.total) for rows in zip(*per_stage)]
