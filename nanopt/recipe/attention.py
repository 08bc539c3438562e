"""Causal self-attention kernels behind one signature, whether each can run on this device, and the choice.
The TPU kernel itself lives in xla.py with the rest of torch_xla."""
from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from nanopt.distributed import xla
from nanopt.distributed.hardware import detect_hardware

log = logging.getLogger("nanopt")

# q: B Hq Tq D, k/v: B Hkv Tk D -> B Hq Tq D. `causal_offset` is the absolute position of the first
# query (non-zero when decoding with a KV cache, where Tq < Tk).
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA without kernel support: k/v B Hkv Tk D -> B Hq Tk D."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int = 0) -> torch.Tensor:
    """The naive baseline: materialise the T×T score matrix, mask, softmax, weight the values."""
    k, v = repeat_kv(q, k, v)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # B H Tq D @ B H D Tk -> B H Tq Tk
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(causal_offset)  # Tq Tk
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return probs @ v  # B H Tq Tk @ B H Tk D -> B H Tq D


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int = 0) -> torch.Tensor:
    """PyTorch's fused kernel; enable_gqa indexes KV heads instead of repeating K/V."""
    gqa = q.shape[1] != k.shape[1]
    if causal_offset == 0 and q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if q.shape[2] == 1:  # one new token attends to every cached position
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    # Tq Tk, True = may attend: query i sits at position causal_offset + i
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(causal_offset)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def sdpa_repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int = 0) -> torch.Tensor:
    """sdpa with K/V repeated instead of enable_gqa: a fused kernel where enable_gqa gets the math one (choose)."""
    return sdpa(q, *repeat_kv(q, k, v), causal_offset)


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int = 0) -> torch.Tensor:
    """flash-attn 2 (CUDA only); its causal mask is aligned bottom-right, so decoding's causal_offset is implied."""
    from flash_attn import flash_attn_func  # imported lazily: the package exists only on CUDA hosts

    dtype = q.dtype
    if not (dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == dtype):
        # Half types only: sampling after a bf16-autocast run calls it outside autocast with fp32 weights.
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    return out.transpose(1, 2).to(dtype)


def xla_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int = 0) -> torch.Tensor:
    """torch_xla's Pallas flash attention (TPU only), or sdpa where the kernel does not apply."""
    out = xla.flash_attention(q, *repeat_kv(q, k, v), causal_offset)
    return sdpa(q, k, v, causal_offset) if out is None else out


BACKENDS: dict[str, AttentionFn] = {"eager": eager, "sdpa": sdpa, "flash": flash, "xla_flash": xla_flash}


def flash_unavailable_reason(device_type: str, precision: str = "bf16") -> Optional[str]:
    """Why flash-attn (CUDA only, fp16/bf16 only) cannot be used for this run, or None when it can."""
    if device_type != "cuda":
        return f"flash-attn needs a CUDA device (this run is on {device_type})"
    if precision == "fp32":  # its kernels reject fp32 q/k/v, and an fp32 run has no autocast to cast them
        return "flash-attn computes in fp16/bf16 only and train.precision is fp32"
    try:
        import flash_attn  # noqa: F401
    except ImportError as e:
        return f"flash-attn is not importable ({e}); install the `gpu` extra"
    return None


UNAVAILABLE_REASON = {"flash": flash_unavailable_reason, "xla_flash": xla.flash_unavailable_reason}

# GPUs (hardware.PEAKS keys -> results file) where bench/gpu_check.py measured flash-attn faster than SDPA: `auto`
# picks it there only. None yet: on an H100 SDPA runs cuDNN's kernel (bench/results/gpu_check_h100_shipped.json).
FLASH_MEASURED_FASTER: dict[str, str] = {}


def choose(name: str, device_type: str, precision: str = "bf16", gpu: str = "") -> tuple[str, AttentionFn]:
    """Resolve the configured backend for this device, precision and GPU, logging any fallback and its reason.
    `auto` is flash-attn where it can run and is listed in FLASH_MEASURED_FASTER, else SDPA."""
    kernel = "flash" if name == "auto" else name
    reason = UNAVAILABLE_REASON[kernel](device_type, precision) if kernel in UNAVAILABLE_REASON else None
    if reason is None and name == "auto" and detect_hardware(gpu, None) not in FLASH_MEASURED_FASTER:
        reason = (f"bench/gpu_check.py has not measured flash-attn faster than SDPA on {gpu or 'this GPU'} "
                  f"(nanopt.recipe.attention.FLASH_MEASURED_FASTER)")
    if reason is not None:
        if name == "auto":
            log.info("attention: auto chose sdpa because %s", reason)
        else:
            log.warning("attention: %s requested but %s; falling back to sdpa", name, reason)
        kernel = "sdpa"
    if kernel == "sdpa" and device_type == "cuda" and precision == "fp32":
        # With enable_gqa SDPA would fall to its math kernel (T x T scores in memory: 8 GiB per layer at 1B
        # shapes, bench/gpu_check.py): the flash kernel refuses fp32 and the memory-efficient one enable_gqa.
        log.info("attention: sdpa repeats K/V heads for grouped-query attention because SDPA's fused CUDA kernels "
                 "take either fp32 or enable_gqa, not both")
        return "sdpa (K/V repeated)", sdpa_repeat_kv
    return kernel, BACKENDS[kernel]
