"""MFU: the formula, the FLOPs per token counted from the model's own modules (on the meta device), and the meter
that feeds it the loop's timings. HFU adds what nanopt recomputes. The peaks are hardware.py's."""
from __future__ import annotations

import functools
import logging
from dataclasses import astuple, dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from nanopt.config import Config, ModelConfig
from nanopt.distributed.hardware import (PEAK_BUDGET_S, PEAKS, detect_hardware, matmul_precision, measure_matmul_flops,
                                         table_peak)
from nanopt.distributed.runtime import Runtime
from nanopt.recipe.model import RESIDUAL_OUT, Llama, meta_model  # meta_model: importers of mfu read FLOPs from it

log = logging.getLogger("nanopt")


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_device: Optional[float],
        devices: int) -> Optional[float]:
    """Achieved FLOP/s over (the dense peak per device × devices). flops_per_token: 6N (a multiply-add per weight
    forward, twice that backward; lookups not counted) plus attention's two T×T matmuls, causally halved.
    tokens_per_s: every rank's. An unknown device's peak is None, and so is its MFU: never a guess."""
    if peak_flops_per_device is None:
        return None
    return flops_per_token * tokens_per_s / (peak_flops_per_device * devices)




@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # nn.Embedding tables (the token embedding, value embeddings): gathers, no FLOPs
    lm_head: int  # the Linears outside the blocks (the output matmul): FLOPs per token even when tied
    block_matmuls: int  # the Linears inside model.layers
    norms: int  # norm gains (a module whose class name has "Norm"): elementwise, ~0.005% of the 1B model
    scalars: int  # every other parameter (residual_scalars' a and b)
    total: int  # unique parameters, a tied head once (== Llama.num_params())

    @property
    def n_6n(self) -> int:
        """N of 6N: everything a token passes through, the head in, the lookups out."""
        return self.block_matmuls + self.norms + self.scalars + self.lm_head


def attention_flops(module: nn.Module, seq_len: int, causal_halving: bool = True) -> int:
    """Training FLOPs per token of the attention modules in `module` (those with n_heads and head_dim, d their
    product): 2·T·d for Q·Kᵀ and 2·T·d for P·V forward, twice that backward: 12·T·d, halved when causal."""
    d = sum(m.n_heads * m.head_dim for m in module.modules() if hasattr(m, "n_heads") and hasattr(m, "head_dim"))
    return 12 * seq_len * d // (2 if causal_halving else 1)


def param_counts(model: nn.Module) -> ParamCounts:
    in_blocks = {id(p) for p in model.layers.parameters()}
    seen: set[int] = set()
    counts = dict.fromkeys(("embedding", "lm_head", "block_matmuls", "norms", "scalars"), 0)
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if isinstance(module, nn.Linear):  # a tied head's weight was seen as the embedding: its matmul still counts
                counts["block_matmuls" if id(p) in in_blocks else "lm_head"] += p.numel()
            elif id(p) not in seen:
                kind = ("embedding" if isinstance(module, nn.Embedding) else
                        "norms" if "Norm" in type(module).__name__ else "scalars")
                counts[kind] += p.numel()
            seen.add(id(p))
    return ParamCounts(**counts, total=sum(p.numel() for p in model.parameters()))


@dataclass(frozen=True)
class TokenFlops:
    """Training FLOPs per token at one sequence length, in each convention MFU is quoted in."""
    model: int  # 6N + attention as mfu.causal_halving counts it: nanopt's `mfu`
    six_n: int  # 6N alone: the blog's convention
    full_attention: int  # 6N + the whole T×T square: nanochat's, torchtitan's, PaLM's
    hardware: int  # model + what nanopt recomputes: `hfu`

    def summary(self) -> dict[str, int]:
        return dict(zip(("flops_per_token", "flops_per_token_6n", "flops_per_token_full_attention",
                         "flops_per_token_hardware"), astuple(self)))


def token_flops(model: nn.Module, seq_len: int, causal_halving: bool = True, micro_batch_size: int = 1,
                loss_chunk_tokens: int = 0, recompute: bool = False) -> TokenFlops:
    """Every FLOPs-per-token figure at `seq_len`. Recomputed (HFU only): the head forward when the loss is chunked;
    under train.recompute every block's forward but its last residual-output Linear, whose output no backward needs."""
    counts = param_counts(model)
    six_n = 6 * counts.n_6n
    full, attention = attention_flops(model, seq_len, False), attention_flops(model, seq_len, causal_halving)
    again = 2 * counts.lm_head if 0 < loss_chunk_tokens < micro_batch_size * seq_len else 0
    for block in model.layers if recompute else []:
        weights = [p.numel() for m in block.modules() if not isinstance(m, nn.Embedding) for p in m.parameters(False)]
        down = [m.weight.numel() for m in block.modules() if getattr(m, RESIDUAL_OUT, False)][-1:]
        again += 2 * (sum(weights) - sum(down)) + attention_flops(block, seq_len, causal_halving) // 3
    return TokenFlops(six_n + attention, six_n, six_n + full, six_n + attention + again)


CONVENTIONS = ("mfu", "mfu_6n", "mfu_full_attention", "hfu")  # TokenFlops' fields in order, as MFU figures


class MFUMeter:
    """Feeds mfu() each logging window, per convention; warm-up windows give nulls."""

    def __init__(self, per_token: Callable[[int], TokenFlops], seq_len: int, tokens_per_step: int,
                 peak_flops: Optional[float], world_size: int, start_step: int = 0, warmup_steps: int = 1,
                 peak_label: str = "", basis: str = ""):
        self.per_token, self.peak_flops, self.world_size = per_token, peak_flops, world_size
        self.first_counted_step = start_step + warmup_steps + 1
        # Where the peak came from (spec sheet, measured, override); "bf16-equivalent" when FP8 matmuls are counted.
        self.peak_label, self.basis = peak_label, basis
        self.tokens_done, self.seconds_done, self.flops_done = 0.0, 0.0, [0.0] * len(CONVENTIONS)
        self.set_stage(tokens_per_step, seq_len)

    def set_stage(self, tokens_per_step: int, seq_len: int) -> None:
        self.tokens_per_step, self.flops = tokens_per_step, self.per_token(seq_len)

    def update(self, step: int, window_steps: int, step_seconds: float) -> dict[str, Optional[float]]:
        """MFU of the `window_steps` steps ending at `step`; nulls for a window holding a warm-up step and for a
        0-step window (a first step's compile timed alone), in neither the figure nor the summary."""
        if window_steps < 1 or step - window_steps + 1 < self.first_counted_step or step_seconds <= 0:
            return dict.fromkeys((*CONVENTIONS, "tflops_per_device"))
        tokens_per_s, seconds, per_token = self.tokens_per_step / step_seconds, window_steps * step_seconds, \
            astuple(self.flops)
        self.tokens_done, self.seconds_done = self.tokens_done + tokens_per_s * seconds, self.seconds_done + seconds
        self.flops_done = [done + f * tokens_per_s * seconds for done, f in zip(self.flops_done, per_token)]
        return {**{name: mfu(f, tokens_per_s, self.peak_flops, self.world_size) for name, f in
                   zip(CONVENTIONS, per_token)},
                "tflops_per_device": tokens_per_s * self.flops.model / self.world_size / 1e12}

    def summary(self) -> dict[str, Any]:
        tokens, seconds = self.tokens_done, self.seconds_done
        mean = {name: mfu(done / tokens, tokens / seconds, self.peak_flops, self.world_size) if seconds else None
                for name, done in zip(CONVENTIONS, self.flops_done)}
        return {"mfu_peak_flops_per_device": self.peak_flops, "mfu_peak_source": self.peak_label,
                "mfu_basis": self.basis or None, **self.flops.summary(), **mean}


warn_once = functools.cache(log.warning)  # once per process and message


def run_peak(cfg: Config, rt: Runtime) -> tuple[Optional[float], str]:
    """(per-device peak FLOP/s or None, its description): the `mfu.hardware` override, else on CPU measured by every
    rank at once (the mean), else the detected accelerator's table entry; unknown: None and one warning."""
    precision, override, name = cfg.train.precision, cfg.mfu.hardware, rt.hardware_name()
    if override == "auto" and rt.backend.measures_peak:
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        rt.barrier()
        measured = torch.tensor([measure_matmul_flops(dtype, rt.device, PEAK_BUDGET_S, rt.sync)], dtype=torch.float64)
        peak = rt.all_reduce_sum(measured).item() / rt.world_size
        return peak, (f"MEASURED on {name}: a {str(dtype).replace('torch.', '')} matmul benchmark, every rank at "
                      f"once, {torch.get_num_threads()} thread(s) per rank (not a spec-sheet figure)")
    warn = warn_once if rt.is_main else (lambda message: None)  # one warning per run, not per rank
    key = override if override != "auto" else detect_hardware(name, rt.backend.power_limit_watts())
    if key is None:
        warn(f"mfu: unknown accelerator {name!r}: no dense peak in nanopt.distributed.hardware.PEAKS, so MFU is null. Set "
             f"--mfu.hardware=KEY if it is one of: {', '.join(PEAKS)}")
        return None, f"unknown accelerator {name!r}"
    peak = table_peak(key, precision)
    if peak is None:
        warn(f"mfu: {PEAKS[key].name} has no published dense {matmul_precision(precision)} peak; MFU will be "
             f"null (train in bf16 for an MFU figure)")
    source = f"{PEAKS[key].name}, from mfu.hardware" if override != "auto" else name
    return peak, f"{key} ({source}), {matmul_precision(precision)} dense spec sheet"


def meter_for_run(cfg: Config, rt: Runtime, start_step: int = 0) -> MFUMeter:
    """The run's meter, counting a meta-device twin of the model; logs what MFU is relative to."""
    t, halved = cfg.train, cfg.mfu.causal_halving
    per_token = functools.partial(token_flops, meta_model(cfg.model), causal_halving=halved,
                                  micro_batch_size=t.micro_batch_size, loss_chunk_tokens=t.loss_chunk_tokens,
                                  recompute=t.recompute)
    peak, where = run_peak(cfg, rt)
    # FP8 matmuls count against the run precision's dense peak; a CPU's is its measured fp32 matmul, not TF32's.
    measured = rt.backend.measures_peak and cfg.mfu.hardware == "auto"
    dense = "fp32" if t.precision == "fp32" and measured else matmul_precision(t.precision)
    basis = f"{dense}-equivalent" if t.fp8 != "none" else ""
    # num_devices: ranks on CUDA/CPU, every chip one SPMD process drives on XLA.
    meter = MFUMeter(per_token, t.seq_len, t.global_batch_tokens, peak, rt.num_devices, start_step,
                     cfg.mfu.warmup_steps, where, basis)
    if rt.is_main:
        f = meter.flops
        peak_text = "n/a" if peak is None else f"{peak / 1e12:.3f} TFLOP/s per device × {rt.num_devices}"
        log.info(f"mfu: peak {peak_text} ({where}); FLOPs/token {f.model:.4g} (6N+attention, "
                 f"causal {'halved' if halved else 'full'}) | 6N {f.six_n:.4g} | full attention "
                 f"{f.full_attention:.4g} | hardware {f.hardware:.4g}")
        if basis:
            log.info(f"mfu: {basis}: train.fp8 runs the block matmuls in FP8, counted against the dense {dense} peak")
    return meter
