"""Model FLOPs utilisation in the loop: the run's peak (spec sheet or measured), and the meter that turns a
logging window's seconds into MFU, HFU and TFLOP/s. MFU = achieved model FLOP/s / (per-device dense peak ×
devices); the FLOPs per token come from flops.py, the peaks from hardware.py."""
from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

from nanopt.config import Config
from nanopt.flops import flops_per_token, flops_per_token_6n, recompute_flops_per_token
from nanopt.hardware import PEAKS, detect_hardware, matmul_precision, measure_matmul_flops, table_peak
from nanopt.runtime import Runtime

log = logging.getLogger("nanopt")


@functools.cache  # once per process and message
def warn_once(message: str) -> None:
    log.warning(message)


class MFUMeter:
    """Turns (steps, seconds) of a logging window into MFU, skipping warm-up steps.

    Work is counted per optimizer step over the whole world (every rank and micro-step) and the peak per
    device × devices, so MFU is one device's achieved FLOP/s over its own peak whatever the world size."""

    def __init__(self, flops_per_token: float, flops_per_token_6n: float, tokens_per_step: int,
                 peak_flops: Optional[float], world_size: int, start_step: int = 0, warmup_steps: int = 1,
                 peak_label: str = "", flops_per_token_hw: Optional[float] = None):
        self.flops_per_token, self.flops_per_token_6n = flops_per_token, flops_per_token_6n
        # What the hardware computes: the model's FLOPs plus recomputation (for HFU).
        self.flops_per_token_hw = flops_per_token if flops_per_token_hw is None else flops_per_token_hw
        self.tokens_per_step, self.world_size = tokens_per_step, world_size
        self.peak_flops = peak_flops  # per device
        self.first_counted_step = start_step + warmup_steps + 1
        self.peak_label = peak_label  # where the peak came from (spec sheet, measured, override)

    def summary(self) -> dict[str, Any]:
        """What every MFU figure of the run is relative to, for summary.json."""
        return {"mfu_peak_flops_per_device": self.peak_flops, "mfu_peak_source": self.peak_label,
                "flops_per_token": self.flops_per_token, "flops_per_token_6n": self.flops_per_token_6n,
                "flops_per_token_hardware": self.flops_per_token_hw}

    def update(self, step: int, window_steps: int, step_seconds: float) -> dict[str, Optional[float]]:
        """Metrics for the `window_steps` optimizer steps ending at `step`, which took `step_seconds` each; nulls
        for a window that includes a warm-up step (compilation, allocation, autotuning)."""
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


def run_peak(cfg: Config, rt: Runtime) -> tuple[Optional[float], str]:
    """(per-device peak FLOP/s or None, a description for the log): the `mfu.hardware` override, else on CPU a
    peak measured by every rank at once (the mean), else the detected accelerator's table entry. An unknown
    accelerator gives None and one warning: MFU is then null, never a guess."""
    precision, override = cfg.train.precision, cfg.mfu.hardware
    warn = warn_once if rt.is_main else (lambda message: None)  # one warning per run, not per rank
    if override == "auto" and rt.backend.measures_peak:
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        rt.barrier()  # all ranks measure at once, sharing the cores as they will in training
        measured = torch.tensor([measure_matmul_flops(dtype, rt.device, sync=rt.sync)], dtype=torch.float64)
        peak = rt.all_reduce_sum(measured).item() / rt.world_size
        return peak, (f"MEASURED on {rt.hardware_name()}: a {str(dtype).replace('torch.', '')} matmul benchmark "
                      f"at start-up, {torch.get_num_threads()} thread(s) per rank (not a spec-sheet figure)")
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
