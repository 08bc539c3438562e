"""FLOPs per token of the Llama in model.py, from its config alone (torch-free: `nanopt estimate`, and
build_model's check of param_counts), and the time/cost to train it. The in-loop MFU meter is in mfu.py.

"Model" FLOPs are what the model needs per token whatever the implementation does (recomputation is not
counted), so MFU compares runs across kernels, batch shapes and hardware; HFU adds what nanopt recomputes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from nanopt.config import ModelConfig
from nanopt.errors import ConfigError
from nanopt.hardware import matmul_precision, table_peak


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the Llama in model.py, by what they do per token."""
    # The lookup tables, gathers with no FLOPs: the token embedding (vocab × dim) and, with
    # value_embeddings, one vocab × (n_kv_heads × head_dim) table per layer.
    embedding: int
    lm_head: int  # the vocab × dim output matmul: FLOPs per token even when tied to the embedding
    block_matmuls: int  # wq, wk, wv, wo, w1, w2 (and w3 unless mlp is relu2) of every layer
    norms: int  # RMSNorm gains (dim × (2 layers + 1)); an elementwise multiply, ~0.005% of the 1B model
    scalars: int  # residual_scalars: a and b of every layer (2 × n_layers); 0 when off
    total: int  # unique parameters, a tied head counted once (== Llama.num_params())

    @property
    def n_6n(self) -> int:
        """N of the 6N rule: everything a token passes through once, the LM head included, the lookups not.
        Norm gains (and residual scalars) are in, so that with tied embeddings N is the familiar parameter
        count (Llama-3.2-1B: 1,235,814,400); they change FLOPs by 5 parts in 100,000."""
        return self.block_matmuls + self.norms + self.scalars + self.lm_head


def block_linears(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each Linear of one block, by its name in model.py."""
    q_dim, kv_dim = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    shapes = {"attention.wq": (m.dim, q_dim), "attention.wk": (m.dim, kv_dim), "attention.wv": (m.dim, kv_dim),
              "attention.wo": (q_dim, m.dim), "mlp.w1": (m.dim, m.ffn_dim), "mlp.w3": (m.dim, m.ffn_dim),
              "mlp.w2": (m.ffn_dim, m.dim)}
    if m.mlp == "relu2":  # w1, w2 only; SwiGLU adds w3 (up) beside w1 (gate)
        del shapes["mlp.w3"]
    return shapes


def param_counts(m: ModelConfig) -> ParamCounts:
    """Count parameters from the config alone (no model is built)."""
    kv_dim = m.n_kv_heads * m.head_dim
    block_matmuls = m.n_layers * sum(i * o for i, o in block_linears(m).values())
    norms = m.dim * (2 * m.n_layers + 1)
    scalars = 2 * m.n_layers if m.residual_scalars else 0
    lm_head = m.vocab_size * m.dim
    embedding = lm_head + (m.n_layers * m.vocab_size * kv_dim if m.value_embeddings else 0)
    total = embedding + block_matmuls + norms + scalars + (0 if m.tie_embeddings else lm_head)
    return ParamCounts(embedding=embedding, lm_head=lm_head, block_matmuls=block_matmuls, norms=norms,
                       scalars=scalars, total=total)


def flops_per_token_6n(m: ModelConfig) -> int:
    """Training FLOPs per token in the 6N convention: a multiply-add (2 FLOPs) per weight forward, twice that
    backward (gradients for the input and the weight). Recomputation is work the implementation chose: not in."""
    return 6 * param_counts(m).n_6n


def attention_flops_per_token(m: ModelConfig, seq_len: int, causal_halving: bool = True) -> int:
    """Training FLOPs per token of the two attention matmuls (scores Q·Kᵀ and the weighted sum P·V). Per layer and
    token, forward: 2·T·d (scores) + 2·T·d (values), d = n_heads × head_dim (GQA shares K/V heads, but every query
    head does its own products); backward doubles it: 12·L·T·d in all. causal_halving (our default) counts only the
    unmasked half, 6·L·T·d, since causal kernels skip the masked half. PaLM (appendix B), nanoGPT and torchtitan
    count the full square: compare with them at causal_halving=False."""
    full = 12 * m.n_layers * seq_len * m.n_heads * m.head_dim
    return full // 2 if causal_halving else full


def flops_per_token(m: ModelConfig, seq_len: int, causal_halving: bool = True) -> int:
    """Training FLOPs per token in the 6N + attention convention (the `mfu` we log)."""
    return flops_per_token_6n(m) + attention_flops_per_token(m, seq_len, causal_halving)


def recompute_flops_per_token(m: ModelConfig, micro_batch_tokens: int, loss_chunk_tokens: int,
                              seq_len: int = 0, blocks: bool = False, causal_halving: bool = True) -> int:
    """FLOPs per token that nanopt computes twice: the chunked loss (model.py, `train.loss_chunk_tokens`)
    runs the LM head forward again in backward, 2·vocab·dim per token, whenever a micro-batch holds more
    positions than one chunk; with `train.recompute` (blocks) every block's forward runs again too: its matmuls
    (2 per weight) and its attention forward (a third of attention_flops_per_token at `seq_len`), all but the MLP's
    down projection: nothing in backward needs its output, and torch's checkpoint stops the recompute before it."""
    counts = param_counts(m)
    chunked = 0 < loss_chunk_tokens < micro_batch_tokens
    head = 2 * counts.lm_head if chunked else 0
    if not blocks:
        return head
    down = m.n_layers * math.prod(block_linears(m)["mlp.w2"])
    block_norms = counts.norms - m.dim  # the final norm is outside the blocks
    block_forward = 2 * (counts.block_matmuls - down + block_norms + counts.scalars)
    return head + block_forward + attention_flops_per_token(m, seq_len, causal_halving) // 3


@dataclass(frozen=True)
class TokenFlops:
    """Training FLOPs per token at one sequence length, in each convention MFU is quoted in."""
    model: int  # 6N + attention as mfu.causal_halving counts it: nanopt's `mfu`
    six_n: int  # 6N alone: the blog's convention
    full_attention: int  # 6N + the whole T×T square: nanochat's, torchtitan's, PaLM's
    hardware: int  # model + what nanopt recomputes: `hfu`

    def summary(self) -> dict[str, int]:
        return {"flops_per_token": self.model, "flops_per_token_6n": self.six_n,
                "flops_per_token_full_attention": self.full_attention, "flops_per_token_hardware": self.hardware}


def token_flops(m: ModelConfig, seq_len: int, causal_halving: bool = True, micro_batch_size: int = 1,
                loss_chunk_tokens: int = 0, recompute: bool = False) -> TokenFlops:
    """Every FLOPs-per-token figure of a run at this sequence length (micro-batches of micro_batch_size rows;
    `recompute`: train.recompute's second forward of every block, in `hardware` only)."""
    model = flops_per_token(m, seq_len, causal_halving)
    again = recompute_flops_per_token(m, micro_batch_size * seq_len, loss_chunk_tokens, seq_len, recompute,
                                      causal_halving)
    return TokenFlops(model=model, six_n=flops_per_token_6n(m), full_attention=flops_per_token(m, seq_len, False),
                      hardware=model + again)


def estimate(m: ModelConfig, stages: Sequence[tuple[int, int]], hardware: str, gpus: int, mfu: float,
             precision: str = "bf16", price_per_gpu_hour: Optional[float] = None,
             causal_halving: bool = True) -> dict[str, Any]:
    """Wall time, GPU-hours and cost to train `stages`, (tokens, seq_len) pairs, at a given MFU (6N + attention
    FLOPs, which grow with seq_len: each stage's tokens at its own; the FLOPs per token reported are the mean)."""
    counts = param_counts(m)
    per_stage = [(n, token_flops(m, seq_len, causal_halving)) for n, seq_len in stages]
    tokens = sum(n for n, _ in per_stage)
    total_flops, full = (sum(n * getattr(f, key) for n, f in per_stage) for key in ("model", "full_attention"))
    peak = table_peak(hardware, precision)
    if peak is None:
        raise ValueError(f"{hardware} has no dense {matmul_precision(precision)} peak")
    hours = total_flops / (gpus * peak * mfu) / 3600
    return {
        "params": counts.total, "n_6n": counts.n_6n,
        "flops_per_token": round(total_flops / tokens), "flops_per_token_6n": flops_per_token_6n(m),
        "flops_per_token_full_attention": round(full / tokens),
        "causal_halving": causal_halving, "seq_len": max(seq_len for n, seq_len in stages if n), "tokens": tokens,
        "tokens_per_param": tokens / counts.total,
        "total_flops": total_flops, "hardware": hardware, "precision": matmul_precision(precision),
        # The same speed as MFU in the other conventions (the blog's 6N, nanochat's and torchtitan's full square).
        "peak_flops_per_gpu": peak, "gpus": gpus, "mfu": mfu,
        "mfu_6n": mfu * flops_per_token_6n(m) * tokens / total_flops, "mfu_full_attention": mfu * full / total_flops,
        "hours": hours, "gpu_hours": hours * gpus, "price_per_gpu_hour": price_per_gpu_hour,
        "cost_usd": None if price_per_gpu_hour is None else hours * gpus * price_per_gpu_hour,
    }


_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_tokens(text: str, params: int) -> int:
    """`24714985472`, `2.5e10`, `25B` / `300M` / `1.2T`, or `20x` (tokens per parameter)."""
    s = text.strip().lower().replace("_", "").replace(",", "")
    scale = {**_SUFFIX, "x": params}
    try:
        value = float(s[:-1]) * scale[s[-1]] if s and s[-1] in scale else float(s)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"`--tokens {text}` is not a token count; write e.g. 25000000000, 2.5e10, 25B or "
                          f"20x (tokens per parameter).")
    return int(round(value))
