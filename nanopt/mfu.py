"""Model FLOPs utilisation in the loop: the run's peak (spec sheet or measured), and the meter that turns a
logging window's seconds into MFU, HFU and TFLOP/s.

MFU = achieved model FLOP/s / (per-device dense peak × world size); the FLOPs per token come from flops.py,
the peaks from hardware.py.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from nanopt.config import Config
from nanopt.flops import flops_per_token, flops_per_token_6n, recompute_flops_per_token
from nanopt.hardware import PEAKS, detect_hardware, matmul_precision, measure_matmul_flops, table_peak
from nanopt.runtime import Runtime

log = logging.getLogger("nanopt")

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


class MFUMeter:
    """Turns (steps, seconds) of a logging window into MFU, skipping warm-up steps.

    Work is counted per optimizer step over the whole world (tokens_per_step = train.global_batch_tokens,
    every rank and every micro-step), and the peak is per device × world size, so MFU equals one device's
    achieved FLOP/s over its own peak whatever the world size or accumulation.
    """

    def __init__(self, flops_per_token: float, flops_per_token_6n: float, tokens_per_step: int,
                 peak_flops: Optional[float], world_size: int, start_step: int = 0, warmup_steps: int = 1,
                 peak_label: str = "", flops_per_token_hw: Optional[float] = None):
        self.flops_per_token = flops_per_token
        self.flops_per_token_6n = flops_per_token_6n
        # What the hardware computes: the model's FLOPs plus recomputation (for HFU).
        self.flops_per_token_hw = flops_per_token if flops_per_token_hw is None else flops_per_token_hw
        self.tokens_per_step = tokens_per_step
        self.peak_flops = peak_flops  # per device
        self.world_size = world_size
        self.first_counted_step = start_step + warmup_steps + 1
        self.peak_label = peak_label  # where the peak came from (spec sheet, measured, override)

    def summary(self) -> dict[str, Any]:
        """What every MFU figure of the run is relative to, for summary.json."""
        return {"mfu_peak_flops_per_device": self.peak_flops, "mfu_peak_source": self.peak_label,
                "flops_per_token": self.flops_per_token, "flops_per_token_6n": self.flops_per_token_6n,
                "flops_per_token_hardware": self.flops_per_token_hw}

    def update(self, step: int, window_steps: int, step_seconds: float) -> dict[str, Optional[float]]:
        """Metrics for the `window_steps` optimizer steps ending at `step`, which took `step_seconds` each.

        A window that includes a warm-up step (compilation, allocation, autotuning) gives nulls.
        """
        window_steps = max(window_steps, 1)
        if step - window_steps + 1 < self.first_counted_step or step_seconds <= 0:
            return {"mfu": None, "mfu_6n": None, "hfu": None, "tflops_per_device": None}
        tokens_per_s_per_device = self.tokens_per_step / step_seconds / self.world_size
        achieved = tokens_per_s_per_device * self.flops_per_token
        out: dict[str, Optional[float]] = {"mfu": None, "mfu_6n": None, "hfu": None,
                                           "tflops_per_device": achieved / 1e12}
        if self.peak_flops:
            out["mfu"] = achieved / self.peak_flops
            out["mfu_6n"] = tokens_per_s_per_device * self.flops_per_token_6n / self.peak_flops
            out["hfu"] = tokens_per_s_per_device * self.flops_per_token_hw / self.peak_flops
        return out


def peak_memory_gib(rt: Runtime) -> Optional[float]:
    """This rank's peak device memory (CUDA: allocated; CPU: resident set; XLA: the busiest chip's, see
    xla.PeakMemory) in GiB, or None."""
    peak = rt.peak_memory_bytes()
    return None if peak is None else peak / 2**30


def peak_reserved_gib(rt: Runtime) -> Optional[float]:
    """This rank's peak reserved device memory in GiB (CUDA's caching allocator), or None elsewhere."""
    peak = rt.peak_reserved_bytes()
    return None if peak is None else peak / 2**30


def run_peak(cfg: Config, rt: Runtime) -> tuple[Optional[float], str]:
    """(per-device peak FLOP/s or None, a description for the log) for this run's device and precision.

    Order: the `mfu.hardware` override; on CPU a measured peak (every rank measures at once, under the
    same contention as training, and the mean is used); otherwise the detected accelerator's table entry.
    Unknown accelerators give None and one warning: MFU is then null, never a guess.
    """
    precision = cfg.train.precision
    override = cfg.mfu.hardware
    warn = warn_once if rt.is_main else (lambda key, message: None)  # one warning per run, not per rank
    if override != "auto":
        peak = table_peak(override, precision)
        if peak is None:
            warn(f"noprec:{override}", f"mfu: {PEAKS[override].name} has no published dense "
                      f"{matmul_precision(precision)} peak; MFU will be null (train in bf16 for an MFU figure)")
        return peak, f"{override} ({PEAKS[override].name}, from mfu.hardware), {matmul_precision(precision)} dense spec sheet"
    if rt.measures_peak:
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        rt.barrier()  # all ranks measure at once, sharing the cores as they will in training
        measured = torch.tensor([measure_matmul_flops(dtype, rt.device, sync=rt.sync)], dtype=torch.float64)
        peak = rt.all_reduce_sum(measured).item() / rt.world_size
        return peak, (f"MEASURED on {rt.hardware_name()}: a {str(dtype).replace('torch.', '')} matmul benchmark "
                      f"at start-up, {torch.get_num_threads()} thread(s) per rank (not a spec-sheet figure)")
    name = rt.hardware_name()
    key = detect_hardware(name, rt.power_limit_watts())
    if key is None:
        warn(f"unknown:{name}", f"mfu: unknown accelerator {name!r}: no dense peak in nanopt.mfu.PEAKS, so "
                  f"MFU is null. Set --mfu.hardware=KEY if it is one of: {', '.join(PEAKS)}")
        return None, f"unknown accelerator {name!r}"
    peak = table_peak(key, precision)
    if peak is None:
        warn(f"noprec:{key}", f"mfu: {PEAKS[key].name} has no published dense "
                  f"{matmul_precision(precision)} peak; MFU will be null")
    return peak, f"{key} ({name}), {matmul_precision(precision)} dense spec sheet"


def meter_for_run(cfg: Config, rt: Runtime, start_step: int = 0) -> MFUMeter:
    """Build the run's meter (measuring the CPU peak if needed) and log what MFU is relative to."""
    seq = cfg.train.seq_len
    fpt = flops_per_token(cfg.model, seq, cfg.mfu.causal_halving)
    fpt_6n = flops_per_token_6n(cfg.model)
    micro_tokens = cfg.train.micro_batch_size * seq  # what one loss call sees (per process, XLA included)
    fpt_hw = fpt + recompute_flops_per_token(cfg.model, micro_tokens, cfg.train.loss_chunk_tokens)
    peak, where = run_peak(cfg, rt)
    if rt.is_main:
        peak_text = "n/a" if peak is None else f"{peak / 1e12:.3f} TFLOP/s per device × {rt.num_devices}"
        log.info("mfu: peak %s (%s); FLOPs/token %s (6N+attention, causal %s) | 6N %s | hardware %s",
                 peak_text, where, f"{fpt:.4g}", "halved" if cfg.mfu.causal_halving else "full",
                 f"{fpt_6n:.4g}", f"{fpt_hw:.4g}")
    # num_devices: ranks on CUDA/CPU, every chip one SPMD process drives on XLA.
    return MFUMeter(fpt, fpt_6n, cfg.train.global_batch_tokens, peak, rt.num_devices, start_step,
                    cfg.mfu.warmup_steps, where, fpt_hw)
