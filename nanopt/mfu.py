"""Model FLOPs utilisation in the loop: the run's peak (spec sheet or measured), and the meter that turns a
logging window's seconds into MFU, HFU and TFLOP/s. MFU = achieved model FLOP/s / (per-device dense peak ×
devices); the FLOPs per token come from flops.py, the peaks from hardware.py."""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import torch

from nanopt.config import Config
from nanopt.flops import TokenFlops, token_flops
from nanopt.hardware import (PEAKS, cpu_peak, detect_hardware, matmul_precision, measure_matmul_flops, peak_key,
                             table_peak)
from nanopt.runtime import Runtime

log = logging.getLogger("nanopt")


@functools.cache  # once per process and message
def warn_once(message: str) -> None:
    log.warning(message)


class MFUMeter:
    """Turns (steps, seconds) of a logging window into MFU, skipping warm-up steps.

    Work is counted per optimizer step over the whole world (every rank and micro-step) and the peak per
    device × devices, so MFU is one device's achieved FLOP/s over its own peak whatever the world size. `mfu` is in
    the run's convention (mfu.causal_halving); `mfu_6n` and `mfu_full_attention` are the same speed in the others."""

    CONVENTIONS = (("mfu", "model"), ("mfu_6n", "six_n"), ("mfu_full_attention", "full_attention"), ("hfu", "hardware"))

    def __init__(self, per_token: Callable[[int], TokenFlops], seq_len: int, tokens_per_step: int,
                 peak_flops: Optional[float], world_size: int, start_step: int = 0, warmup_steps: int = 1,
                 peak_label: str = "", basis: str = ""):
        self.per_token = per_token  # FLOPs per token for a sequence length
        self.world_size = world_size
        self.peak_flops = peak_flops  # per device
        self.first_counted_step = start_step + warmup_steps + 1
        self.peak_label = peak_label  # where the peak came from (spec sheet, measured, override)
        self.basis = basis  # "bf16-equivalent" when FP8 matmuls are counted against the bf16 peak, else ""
        self.flops_done = {key: 0.0 for key, _ in self.CONVENTIONS}  # per device, over the counted windows
        self.seconds_done = 0.0
        self.set_stage(tokens_per_step, seq_len)

    def set_stage(self, tokens_per_step: int, seq_len: int) -> None:
        """From now on a step holds `tokens_per_step` tokens (the world's) in sequences of `seq_len`."""
        self.tokens_per_step = tokens_per_step
        self.flops = self.per_token(seq_len)

    def summary(self) -> dict[str, Any]:
        """What every MFU figure of the run is relative to, and this session's MFU over its timed steps."""
        seconds, peak = self.seconds_done, self.peak_flops
        mean = {key: done / seconds / peak if seconds and peak else None for key, done in self.flops_done.items()}
        return {"mfu_peak_flops_per_device": peak, "mfu_peak_source": self.peak_label,
                "mfu_basis": self.basis or None, **self.flops.summary(), **mean}

    def update(self, step: int, window_steps: int, step_seconds: float) -> dict[str, Optional[float]]:
        """Metrics for the `window_steps` optimizer steps ending at `step`, which took `step_seconds` each; nulls
        for a window that includes a warm-up step (compilation, allocation, autotuning). A window of 0 steps is the
        step that opened it (a session's or a stage's first: its compilation, or a new seq_len's recompile), timed
        alone: a warm-up step too, in neither the figure nor the summary."""
        out: dict[str, Optional[float]] = {key: None for key, _ in self.CONVENTIONS}
        if window_steps < 1 or step - window_steps + 1 < self.first_counted_step or step_seconds <= 0:
            return {**out, "tflops_per_device": None}
        tokens_per_s_per_device = self.tokens_per_step / step_seconds / self.world_size
        self.seconds_done += window_steps * step_seconds
        for key, field in self.CONVENTIONS:
            achieved = tokens_per_s_per_device * getattr(self.flops, field)
            self.flops_done[key] += achieved * window_steps * step_seconds
            out[key] = achieved / self.peak_flops if self.peak_flops else None
        return {**out, "tflops_per_device": tokens_per_s_per_device * self.flops.model / 1e12}


def _measure_together(rt: Runtime, dtype: torch.dtype, budget_s: float) -> float:
    """Every rank measures at once, sharing the cores as they will in training; the mean."""
    rt.barrier()
    measured = torch.tensor([measure_matmul_flops(dtype, rt.device, budget_s, rt.sync)], dtype=torch.float64)
    return rt.all_reduce_sum(measured).item() / rt.world_size


def _any_rank(rt: Runtime, flag: bool) -> bool:
    """True on every rank when it is on any: all ranks measure the peak, or none (one alone would read high)."""
    return rt.all_reduce_sum(torch.tensor([float(flag)], dtype=torch.float64)).item() > 0


def run_peak(cfg: Config, rt: Runtime) -> tuple[Optional[float], str]:
    """(per-device peak FLOP/s or None, a description for the log): the `mfu.hardware` override, else on CPU a
    peak measured by every rank at once (the mean), else the detected accelerator's table entry. An unknown
    accelerator gives None and one warning: MFU is then null, never a guess."""
    precision, override = cfg.train.precision, cfg.mfu.hardware
    warn = warn_once if rt.is_main else (lambda message: None)  # one warning per run, not per rank
    if override == "auto" and rt.backend.measures_peak:
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        peak, how = cpu_peak(peak_key(dtype, torch.get_num_threads(), rt.world_size),
                             functools.partial(_measure_together, rt, dtype), functools.partial(_any_rank, rt),
                             rt.is_main)
        return peak, (f"MEASURED on {rt.hardware_name()}: a {str(dtype).replace('torch.', '')} matmul benchmark, "
                      f"{how}, {torch.get_num_threads()} thread(s) per rank (not a spec-sheet figure)")
    name = rt.hardware_name()
    key = override if override != "auto" else detect_hardware(name, rt.backend.power_limit_watts())
    if key is None:
        warn(f"mfu: unknown accelerator {name!r}: no dense peak in nanopt.mfu.PEAKS, so MFU is null. Set "
             f"--mfu.hardware=KEY if it is one of: {', '.join(PEAKS)}")
        return None, f"unknown accelerator {name!r}"
    peak = table_peak(key, precision)
    if peak is None:
        warn(f"mfu: {PEAKS[key].name} has no published dense {matmul_precision(precision)} peak; MFU will be "
             f"null (train in bf16 for an MFU figure)")
    source = f"{PEAKS[key].name}, from mfu.hardware" if override != "auto" else name
    return peak, f"{key} ({source}), {matmul_precision(precision)} dense spec sheet"


def meter_for_run(cfg: Config, rt: Runtime, start_step: int = 0) -> MFUMeter:
    """Build the run's meter (measuring the CPU peak if needed) and log what MFU is relative to."""
    t = cfg.train
    per_token = functools.partial(token_flops, cfg.model, causal_halving=cfg.mfu.causal_halving,
                                  micro_batch_size=t.micro_batch_size, loss_chunk_tokens=t.loss_chunk_tokens,
                                  recompute=t.recompute)
    peak, where = run_peak(cfg, rt)
    # FP8 matmuls are counted against the dense peak of the run's precision, not an FP8 peak: MFU stays comparable
    # with a bf16 run's, and FP8's gain shows as a higher figure.
    dense = matmul_precision(t.precision)
    if dense == "tf32" and rt.backend.measures_peak and cfg.mfu.hardware == "auto":
        dense = "fp32"  # the CPU's measured fp32 matmul, not a TF32 spec sheet
    basis = f"{dense}-equivalent" if t.fp8 != "none" else ""
    f = per_token(t.seq_len)
    if rt.is_main:
        peak_text = "n/a" if peak is None else f"{peak / 1e12:.3f} TFLOP/s per device × {rt.num_devices}"
        log.info("mfu: peak %s (%s); FLOPs/token %s (6N+attention, causal %s) | 6N %s | full attention %s | "
                 "hardware %s", peak_text, where, f"{f.model:.4g}", "halved" if cfg.mfu.causal_halving else "full",
                 f"{f.six_n:.4g}", f"{f.full_attention:.4g}", f"{f.hardware:.4g}")
        if basis:
            log.info("mfu: %s: train.fp8 runs the block matmuls in FP8, counted against the dense %s peak",
                     basis, dense)
    # num_devices: ranks on CUDA/CPU, every chip one SPMD process drives on XLA.
    return MFUMeter(per_token, t.seq_len, t.global_batch_tokens, peak, rt.num_devices, start_step,
                    cfg.mfu.warmup_steps, where, basis)
