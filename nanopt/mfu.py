"""Model FLOPs utilisation: FLOPs per token, dense spec-sheet peaks, the in-loop meter, time-to-train.

MFU = achieved model FLOP/s / (per-device dense peak × world size). "Model" FLOPs are the FLOPs the
model needs per token whatever the implementation does (recomputation is not counted), so MFU compares
runs across kernels, batch shapes and hardware. HFU (hardware FLOPs utilisation) adds the FLOPs this
implementation recomputes, so it says how busy the hardware was rather than how useful the work was.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:  # keep import light: config pulls in yaml only, torch is imported where it is used
    import torch

    from nanopt.config import Config, ModelConfig
    from nanopt.runtime import Runtime

log = logging.getLogger("nanopt")

# ---------------------------------------------------------------- FLOPs per token


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the Llama in model.py, by what they do per token."""

    embedding: int  # the lookup table, vocab × dim: a gather, no FLOPs
    lm_head: int  # the vocab × dim output matmul: FLOPs per token even when tied to the embedding
    block_matmuls: int  # wq, wk, wv, wo, w1, w2, w3 of every layer
    norms: int  # RMSNorm gains (dim × (2 layers + 1)); an elementwise multiply, ~0.005% of the 1B model
    total: int  # unique parameters, a tied head counted once (== Llama.num_params())

    @property
    def n_6n(self) -> int:
        """N of the 6N rule: everything a token passes through once, the LM head included, the lookup not.

        Norm gains are included so that with tied embeddings N is exactly the familiar parameter count
        (Llama-3.2-1B: 1,235,814,400); they change FLOPs by 5 parts in 100,000.
        """
        return self.block_matmuls + self.norms + self.lm_head


def param_counts(m: ModelConfig) -> ParamCounts:
    """Count parameters from the config alone (no model is built)."""
    q_dim = m.n_heads * m.head_dim
    kv_dim = m.n_kv_heads * m.head_dim
    attention = m.dim * q_dim + 2 * m.dim * kv_dim + q_dim * m.dim  # wq, wk + wv, wo
    mlp = 3 * m.dim * m.ffn_dim  # w1 (gate), w3 (up), w2 (down)
    block_matmuls = m.n_layers * (attention + mlp)
    norms = m.dim * (2 * m.n_layers + 1)
    embedding = lm_head = m.vocab_size * m.dim
    total = embedding + block_matmuls + norms + (0 if m.tie_embeddings else lm_head)
    return ParamCounts(embedding, lm_head, block_matmuls, norms, total)


def flops_per_token_6n(m: ModelConfig) -> int:
    """Training FLOPs per token in the 6N convention.

    Each weight does one multiply-add (2 FLOPs) per token in the forward pass, and twice that in the
    backward pass (gradient w.r.t. the input and w.r.t. the weight): 2 + 4 = 6 FLOPs per parameter.
    Activation recomputation (e.g. the chunked loss recomputing logits) is not counted: it is work the
    implementation chose, not work the model needs.
    """
    return 6 * param_counts(m).n_6n


def attention_flops_per_token(m: ModelConfig, seq_len: int, causal_halving: bool = True) -> int:
    """Training FLOPs per token of the two attention matmuls (scores Q·Kᵀ and the weighted sum P·V).

    Per layer and token, forward: 2·T·d (scores against T keys) + 2·T·d (values), d = n_heads × head_dim
    (GQA shares K/V heads but every query head still does its own products); backward doubles it:
    12·L·T·d in all. With causal_halving=True (our default) only the unmasked half of the T×T score
    matrix is counted, 6·L·T·d: causal kernels (flash, sdpa is_causal) skip the masked half, so counting
    it would credit work nobody does. PaLM (appendix B), nanoGPT and torchtitan count the full square
    (causal_halving=False): use that when comparing with their MFU figures.
    """
    full = 12 * m.n_layers * seq_len * m.n_heads * m.head_dim
    return full // 2 if causal_halving else full


def flops_per_token(m: ModelConfig, seq_len: int, causal_halving: bool = True) -> int:
    """Training FLOPs per token in the 6N + attention convention (the `mfu` we log)."""
    return flops_per_token_6n(m) + attention_flops_per_token(m, seq_len, causal_halving)


def recompute_flops_per_token(m: ModelConfig, micro_batch_tokens: int, loss_chunk_tokens: int) -> int:
    """FLOPs per token that nanopt computes twice: the chunked loss (model.py, `train.loss_chunk_tokens`)
    runs the LM head forward again in backward, 2·vocab·dim per token, whenever a micro-batch holds more
    positions than one chunk. Nothing else is recomputed (no activation checkpointing in the blocks)."""
    chunked = 0 < loss_chunk_tokens < micro_batch_tokens
    return 2 * param_counts(m).lm_head if chunked else 0


# ---------------------------------------------------------------- dense peaks


@dataclass(frozen=True)
class Peak:
    """Dense (no 2:4 sparsity) peak FLOP/s of one device, per matmul precision; None where not published."""

    name: str
    bf16: float
    tf32: Optional[float]
    source: str


TERA = 1e12
# NVIDIA's headline tensor-core figures assume 2:4 structured sparsity; dense training gets half of
# them, which is what is stored here. TPU figures are per chip and dense already. `tf32` is what an
# fp32 run gets on CUDA, because runtime.init enables TF32 tensor-core matmuls.
PEAKS: dict[str, Peak] = {
    # H100 SXM5 datasheet: BF16 1,979 TFLOPS*, TF32 989 TFLOPS* (*with sparsity).
    "h100-sxm": Peak("NVIDIA H100 SXM", 989.4 * TERA, 494.7 * TERA,
                     "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
    # H100 PCIe, same datasheet: BF16 1,513 TFLOPS*, TF32 756 TFLOPS*.
    "h100-pcie": Peak("NVIDIA H100 PCIe", 756.5 * TERA, 378.0 * TERA,
                      "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
    # H100 NVL (per GPU), same datasheet: BF16 1,671 TFLOPS*, TF32 835 TFLOPS*.
    "h100-nvl": Peak("NVIDIA H100 NVL", 835.5 * TERA, 417.5 * TERA,
                     "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
    # H200 SXM product page: BF16 1,979 TFLOPS*, TF32 989 TFLOPS* (the H100 SXM's tensor cores).
    "h200": Peak("NVIDIA H200 SXM", 989.5 * TERA, 494.5 * TERA, "https://www.nvidia.com/en-us/data-center/h200/"),
    # H200 NVL, same page: BF16 1,671 TFLOPS*, TF32 835 TFLOPS*.
    "h200-nvl": Peak("NVIDIA H200 NVL", 835.5 * TERA, 417.5 * TERA, "https://www.nvidia.com/en-us/data-center/h200/"),
    # A100 datasheet (SXM4 and PCIe alike): BF16 312 TFLOPS (624* sparse), TF32 156 TFLOPS (312*).
    "a100": Peak("NVIDIA A100", 312.0 * TERA, 156.0 * TERA,
                 "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                 "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    # L4 datasheet: BF16 242 TFLOPS*, TF32 120 TFLOPS*.
    "l4": Peak("NVIDIA L4", 121.0 * TERA, 60.0 * TERA, "https://www.nvidia.com/en-us/data-center/l4/"),
    # HGX B200 spec table, per GPU: FP16/BF16 4.5 PFLOPS*, TF32 2.2 PFLOPS*.
    "b200": Peak("NVIDIA B200", 2250.0 * TERA, 1100.0 * TERA, "https://www.nvidia.com/en-us/data-center/hgx/"),
    # Cloud TPU system architecture pages, "Peak compute per chip (bf16)". No TF32 on TPUs.
    "tpu-v4": Peak("Google TPU v4", 275.0 * TERA, None, "https://cloud.google.com/tpu/docs/v4"),
    "tpu-v5e": Peak("Google TPU v5e", 197.0 * TERA, None, "https://cloud.google.com/tpu/docs/v5e"),
    "tpu-v5p": Peak("Google TPU v5p", 459.0 * TERA, None, "https://cloud.google.com/tpu/docs/v5p"),
    "tpu-v6e": Peak("Google TPU v6e (Trillium)", 918.0 * TERA, None, "https://cloud.google.com/tpu/docs/v6e"),
}


def matmul_precision(run_precision: str) -> str:
    """The peak column a run's train.precision is measured against: bf16 | tf32."""
    return "tf32" if run_precision == "fp32" else "bf16"


def table_peak(hardware: str, run_precision: str) -> Optional[float]:
    """Dense peak FLOP/s per device for a table key at the run's precision, or None if not published."""
    return getattr(PEAKS[hardware], matmul_precision(run_precision))


def detect_hardware(device_name: str, power_limit_w: Optional[float] = None) -> Optional[str]:
    """Map a device name (torch / torch_xla) to a PEAKS key; None when unknown. Never guesses.

    H100 boards report "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe" or "NVIDIA H100 NVL"; a bare
    "H100" is told apart by the board's default power limit (SXM 700 W, PCIe 350 W, NVL 400 W).
    """
    name = device_name.lower()
    if "tpu" in name:  # torch_xla device kinds: "TPU v4", "TPU v5 lite", "TPU v5", "TPU v6 lite"
        if re.search(r"v6(e|\s*lite)", name):
            return "tpu-v6e"
        if re.search(r"v5(e|\s*lite)", name):
            return "tpu-v5e"
        if re.search(r"v5(p|\b)", name):
            return "tpu-v5p"
        if re.search(r"v4\b", name):
            return "tpu-v4"
        return None
    if re.search(r"\bh100\b", name):
        if "nvl" in name:
            return "h100-nvl"
        if "pcie" in name:
            return "h100-pcie"
        if "hbm3" in name or "sxm" in name:
            return "h100-sxm"
        if power_limit_w is not None and power_limit_w >= 500:
            return "h100-sxm"
        if power_limit_w is not None and power_limit_w <= 360:
            return "h100-pcie"
        return None
    if re.search(r"\bh200\b", name):  # \b keeps the GH200 superchip out
        return "h200-nvl" if "nvl" in name else "h200"
    if re.search(r"\ba100\b", name):
        return "a100"
    if re.search(r"\bl4\b", name):  # not L40 / L40S
        return "l4"
    if re.search(r"\bb200\b", name):  # not GB200
        return "b200"
    return None


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


# ---------------------------------------------------------------- measured peak (CPU)


def measure_matmul_flops(dtype: torch.dtype, device: Any = "cpu", budget_s: float = 0.3,
                         sync: Callable[[], None] = lambda: None, n: int = 1024) -> float:
    """Best square-matmul FLOP/s seen within about `budget_s` seconds: the measured peak.

    A fixed size (1024: big enough to keep every core busy, small enough for ~10 ms per product on a
    CPU) rather than one picked from a first timing, which a busy machine skews toward tiny sizes and
    a peak far too low. Timed batches repeat until the budget is spent; the fastest is reported,
    since interference only ever makes a batch slower.
    """
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        out = a @ b  # warm-up: allocation, kernel selection
        sync()
        best = 0.0
        while True:
            t0 = time.perf_counter()
            for _ in range(3):
                torch.matmul(a, b, out=out)
            sync()
            elapsed = time.perf_counter() - t0
            best = max(best, 2 * n**3 * 3 / elapsed)  # N N @ N N: n³ multiply-adds, 3 products
            if time.perf_counter() - start > budget_s:
                return best


# ---------------------------------------------------------------- the in-loop meter


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
    """This rank's peak device memory (CUDA: allocated; CPU: resident set) in GiB, or None."""
    peak = rt.peak_memory_bytes()
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
    if rt.kind == "cpu":
        import torch

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


# ---------------------------------------------------------------- time to train


def estimate(m: ModelConfig, seq_len: int, tokens: int, hardware: str, gpus: int, mfu: float,
             precision: str = "bf16", price_per_gpu_hour: Optional[float] = None,
             causal_halving: bool = True) -> dict[str, Any]:
    """Wall time, GPU-hours and cost to train `tokens` tokens at a given MFU (6N + attention FLOPs)."""
    counts = param_counts(m)
    fpt = flops_per_token(m, seq_len, causal_halving)
    peak = table_peak(hardware, precision)
    if peak is None:
        raise ValueError(f"{hardware} has no dense {matmul_precision(precision)} peak")
    total_flops = tokens * fpt
    seconds = total_flops / (gpus * peak * mfu)
    hours = seconds / 3600
    return {
        "params": counts.total, "n_6n": counts.n_6n,
        "flops_per_token": fpt, "flops_per_token_6n": 6 * counts.n_6n, "causal_halving": causal_halving,
        "seq_len": seq_len, "tokens": tokens, "tokens_per_param": tokens / counts.total,
        "total_flops": total_flops, "hardware": hardware, "precision": matmul_precision(precision),
        "peak_flops_per_gpu": peak, "gpus": gpus, "mfu": mfu,
        "hours": hours, "gpu_hours": hours * gpus,
        "price_per_gpu_hour": price_per_gpu_hour,
        "cost_usd": None if price_per_gpu_hour is None else hours * gpus * price_per_gpu_hour,
    }


_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_tokens(text: str, params: int) -> int:
    """`24714985472`, `2.5e10`, `25B` / `300M` / `1.2T`, or `20x` (tokens per parameter)."""
    from nanopt.config import ConfigError

    s = text.strip().lower().replace("_", "").replace(",", "")
    try:
        if s.endswith("x"):
            value = float(s[:-1]) * params
        elif s and s[-1] in _SUFFIX:
            value = float(s[:-1]) * _SUFFIX[s[-1]]
        else:
            value = float(s)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"`--tokens {text}` is not a token count; write e.g. 25000000000, 2.5e10, 25B or "
                          f"20x (tokens per parameter).")
    return int(round(value))


def _hours_text(hours: float) -> str:
    if hours >= 1:
        return f"{hours:,.1f} h ({hours / 24:,.1f} days)"
    return f"{hours * 60:.1f} min" if hours * 60 >= 1 else f"{hours * 3600:.2f} s"


def estimate_command(argv: list[str]) -> int:
    """`nanopt estimate`: how long and how much to train a config, before renting anything."""
    from nanopt.config import ConfigError, load_config, parse_overrides

    parser = argparse.ArgumentParser(
        prog="nanopt estimate", allow_abbrev=False,
        description="Time, GPU-hours and cost to train a config at an assumed MFU (6N + causal attention "
                    "FLOPs, dense peaks). Extra --section.key=value overrides apply to the config.",
    )
    parser.add_argument("config_path", nargs="?", metavar="CONFIG", help="config YAML (or use --config)")
    parser.add_argument("--config", dest="config_flag", metavar="CONFIG", help="config YAML")
    parser.add_argument("--hardware", default="h100-sxm", help=f"one of: {', '.join(PEAKS)} (default h100-sxm)")
    parser.add_argument("--gpus", type=int, default=8, help="number of devices (default 8)")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed MFU, 0-1 (default 0.4)")
    parser.add_argument("--tokens", help="tokens to train (25B, 2.5e10, 20x = per parameter); "
                                         "default: the config's budget, train.max_steps × train.global_batch_tokens")
    parser.add_argument("--price-per-gpu-hour", type=float, default=None, help="USD; without it cost is null")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args, rest = parser.parse_known_args(argv)
    if args.config_path and args.config_flag:
        raise ConfigError(f"command line: two config files given ({args.config_path} and {args.config_flag}); pass one.")
    cfg = load_config(args.config_path or args.config_flag, parse_overrides(rest))
    if args.hardware not in PEAKS:
        raise ConfigError(f"`--hardware {args.hardware}` is not in the peak table; valid: {', '.join(PEAKS)}.")
    if args.gpus <= 0:
        raise ConfigError(f"`--gpus` must be positive, got {args.gpus}.")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"`--mfu` is a fraction in (0, 1], e.g. 0.4 for 40%; got {args.mfu}.")
    if args.price_per_gpu_hour is not None and args.price_per_gpu_hour < 0:
        raise ConfigError(f"`--price-per-gpu-hour` must be zero or positive, got {args.price_per_gpu_hour}.")
    if table_peak(args.hardware, cfg.train.precision) is None:
        raise ConfigError(f"{PEAKS[args.hardware].name} has no published dense {matmul_precision(cfg.train.precision)} "
                          f"peak; estimate a bf16 run (--train.precision=bf16).")
    t = cfg.train
    params = param_counts(cfg.model).total
    if args.tokens is None:
        tokens = t.max_steps * t.global_batch_tokens
        source = f"config budget: {t.max_steps:,} steps × {t.global_batch_tokens:,} tokens/step"
    else:
        tokens = parse_tokens(args.tokens, params)
        source = f"--tokens {args.tokens}"
    result = estimate(cfg.model, t.seq_len, tokens, args.hardware, args.gpus, args.mfu, t.precision,
                      args.price_per_gpu_hour, cfg.mfu.causal_halving)
    result["tokens_source"] = source
    if args.json:
        print(json.dumps(result))
        return 0
    r = result
    cost = (f"${r['cost_usd']:,.2f} at ${r['price_per_gpu_hour']:.2f}/GPU-hour" if r["cost_usd"] is not None
            else "pass --price-per-gpu-hour for a cost")
    print("\n".join([
        f"{cfg.run.name}: {r['gpus']} × {PEAKS[r['hardware']].name} "
        f"({r['peak_flops_per_gpu'] / 1e12:.1f} TFLOP/s dense {r['precision']} each) at {100 * r['mfu']:.0f}% MFU",
        f"  parameters     {r['params']:,} (N for 6N: {r['n_6n']:,})",
        f"  FLOPs/token    {r['flops_per_token']:.4g} (6N + causal attention at seq {r['seq_len']}); 6N alone "
        f"{r['flops_per_token_6n']:.4g}",
        f"  tokens         {r['tokens']:,} ({source}; {r['tokens_per_param']:.1f} tokens/parameter)",
        f"  total FLOPs    {r['total_flops']:.3g}",
        f"  wall time      {_hours_text(r['hours'])}",
        f"  GPU-hours      {r['gpu_hours']:,.{1 if r['gpu_hours'] >= 10 else 3}f}",
        f"  cost           {cost}",
    ]))
    return 0


if __name__ == "__main__":
    sys.exit(estimate_command(sys.argv[1:]))
