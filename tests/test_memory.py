"""The per-GPU memory model (nanopt/distributed/memory.py): hand arithmetic for a small config under each parallelism,
and the activation formula against the tensors autograd really saves in model.py's block."""
from __future__ import annotations

import pytest
import torch

from nanopt.config import ModelConfig
from nanopt.distributed.memory import (Training, activation_bytes, activation_bytes_per_token, device_memory,
                                       every_parallelism)
from nanopt.recipe.mfu import meta_model
from nanopt.recipe.model import Block, rope_tables

# 4 layers of dim 64 (4 heads of 16, 2 KV heads), SwiGLU 128, vocabulary 100, tied head.
SMALL = meta_model(ModelConfig(vocab_size=100, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128))
# By hand: per block wq 64·64 + wk, wv 64·32 each + wo 64·64 + w1, w3, w2 64·128 each = 36,864 matrix
# parameters and two norm gains of 64; the root: the embedding 100·64 (the tied head) and the final norm's 64.
BLOCK_MATRICES, BLOCK, ROOT = 36_864, 36_864 + 128, 6_400 + 64
N = 4 * BLOCK + ROOT  # 154,432


def test_ddp_holds_everything_whole_and_fsdp_divides_by_the_shard_ranks_by_hand():
    m = device_memory(SMALL, Training("fp32", "adamw", micro_batch_size=2, seq_len=16, loss_chunk_tokens=0), "ddp")
    assert (m.params, m.grads, m.optimizer) == (4 * N, 4 * N, 8 * N)  # fp32 weights, gradients, two moments
    # bf16: fp32 weights plus autocast's bf16 copy of every matmul weight (the blocks' and the head's).
    bf16 = device_memory(SMALL, Training("bf16", "adamw", 2, 16, 0), "ddp")
    assert bf16.params == 4 * N + 2 * (4 * BLOCK_MATRICES + 6_400)
    pure = device_memory(SMALL, Training("bf16-pure", "adamw", 2, 16, 0), "ddp")
    assert (pure.params, pure.grads, pure.optimizer) == (2 * N, 2 * N, 4 * N)
    # Muon: one momentum buffer for the block matrices, AdamW's two for the rest.
    muon = device_memory(SMALL, Training("fp32", "muon", 2, 16, 0), "ddp")
    assert muon.optimizer == 4 * (4 * BLOCK_MATRICES) + 8 * (N - 4 * BLOCK_MATRICES)
    t = Training("bf16", "adamw", micro_batch_size=2, seq_len=16, loss_chunk_tokens=0)
    m = device_memory(SMALL, t, "fsdp", 4)  # fsdp divides by the shard ranks and adds what is whole
    # The fp32 shard, plus the root and two blocks (the running one, the prefetched next) gathered in bf16.
    assert m.params == 4 * N // 4 + 2 * (ROOT + 2 * BLOCK)
    # The shard, plus the head's whole bf16 gradient and one block's in bf16 and in fp32 for its reduce-scatter.
    assert m.grads == 4 * N // 4 + 2 * 6_400 + (2 + 4) * BLOCK
    assert m.optimizer == 8 * N // 4
    assert m.activations == device_memory(SMALL, t, "ddp").activations  # each rank runs its own micro-batch
    assert m.resident == 16 * N // 4  # between steps: the shards alone (bench/fsdp_memory.py measures it)
    # hsdp shards over its group (2 of the 4 devices) and replicates across groups: between ddp and fsdp.
    rows = every_parallelism(SMALL, t, devices=4, shard_group_size=2)
    assert [(r.parallel, r.shard_ranks) for r in rows] == [("ddp", 1), ("fsdp", 4), ("hsdp", 2)]
    assert rows[2].optimizer == 8 * N // 2 and rows[1].total < rows[2].total < rows[0].total
    assert [r.parallel for r in every_parallelism(SMALL, t, devices=1, shard_group_size=2)] == ["ddp"]


def test_activations_by_hand_with_and_without_recompute():
    t = Training("bf16", "adamw", micro_batch_size=2, seq_len=16, loss_chunk_tokens=8)
    per_token = (2 * (4 + 2) * 64  # two norms: the fp32 normalised input and the bf16 output
                 + 2 * (2 * 64 + 2 * 32) + 4 * 4  # SDPA's q, k, v, output and the per-head log-sum-exp
                 + 4 * 128 * 2)  # SwiGLU's four ffn-wide tensors
    assert activation_bytes_per_token(SMALL.layers[0], "bf16") == per_token == 2_192
    loss = (4 + 2) * 64 * 32 + (2 + 8) * 8 * 100  # the final norm; 8 positions' logits, log-softmax, gradient
    assert activation_bytes(SMALL, t) == 4 * per_token * 32 + loss
    # Recompute keeps each block's fp32 input and one block's activations at a time.
    recomputed = activation_bytes(SMALL, Training("bf16", "adamw", 2, 16, 8, recompute=True))
    assert recomputed == 4 * 4 * 64 * 32 + per_token * 32 + loss


def _saved_bytes_per_token(m: ModelConfig, precision: str, batch: int = 2, seq: int = 24) -> float:
    """Bytes of every tensor autograd saves in one Block's forward (each storage once), less the weights and
    their autocast copies and the RoPE tables: what activation_bytes_per_token models (test_mfu.py uses it too)."""
    torch.manual_seed(0)
    block, (cos, sin), x = Block(m), rope_tables(m, seq), torch.randn(batch, seq, m.dim)
    if precision == "bf16-pure":
        block, x = block.to(torch.bfloat16), x.to(torch.bfloat16)
    x.requires_grad_()
    weights = {tuple(p.shape) for p in block.parameters()} | {tuple(p.shape)[::-1] for p in block.parameters()}
    skip = {t.untyped_storage().data_ptr() for t in (*block.parameters(), cos, sin)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and not (t.ndim == 2 and tuple(t.shape) in weights):
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, x, cos, sin, None)  # x0: no residual scalars; idx: no value embeddings
    return sum(saved.values()) / (batch * seq)


@pytest.mark.parametrize("precision, n_kv_heads", [("fp32", 4), ("bf16", 4), ("bf16", 2), ("bf16-pure", 2)])
def test_the_activation_formula_is_what_autograd_saves(precision, n_kv_heads):
    """Within 2%: the formula leaves out the norms' per-row fp32 scale (4 bytes a row each). fp32 with grouped-query
    attention is left out: on CUDA nanopt repeats K/V there (attention.choose), which the formula follows."""
    m = ModelConfig(vocab_size=100, dim=64, n_layers=1, n_heads=4, n_kv_heads=n_kv_heads, ffn_dim=160)
    assert _saved_bytes_per_token(m, precision) == pytest.approx(activation_bytes_per_token(Block(m), precision), 0.02)
