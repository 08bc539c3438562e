"""What a device can do: the dense spec-sheet peak table, device-name -> peak detection, the measured CPU matmul
peak and its per-machine cache. Torch-free at import (the measuring functions import it), so `nanopt estimate`
and config checks stay fast."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from nanopt.errors import ConfigError
from nanopt.io import cache_dir, write_json

log = logging.getLogger("nanopt")


@dataclass(frozen=True)
class Peak:
    """Dense (no 2:4 sparsity) peak FLOP/s of one device, per matmul precision; None where not published. And its
    memory as the spec sheet gives it, in GB read as 10^9 bytes (`memory_bytes`): below what the device reports
    (an H100 80GB shows 79.2 GiB = 85.0e9 bytes), so `nanopt estimate`'s "fits" leaves that margin for the CUDA
    context and the allocator's fragmentation."""
    name: str
    bf16: float
    tf32: Optional[float]
    source: str
    memory_gb: float

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)


TERA = 1e12
_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
_A100 = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
# NVIDIA's headline tensor-core figures (marked * below) assume 2:4 structured sparsity; dense training gets half
# of them, which is what is stored here. TPU figures are per chip and dense already. `tf32` is what an fp32 run
# gets on CUDA, because runtime.init enables TF32 tensor-core matmuls.
PEAKS: dict[str, Peak] = {
    # H100 datasheet, SXM5 / PCIe / NVL (per GPU): BF16 1,979* / 1,513* / 1,671*, TF32 989* / 756* / 835* TFLOPS;
    # GPU memory 80 / 80 / 94 GB.
    "h100-sxm": Peak("NVIDIA H100 SXM", 989.5 * TERA, 494.7 * TERA, _H100, 80),
    "h100-pcie": Peak("NVIDIA H100 PCIe", 756.5 * TERA, 378.0 * TERA, _H100, 80),
    "h100-nvl": Peak("NVIDIA H100 NVL", 835.5 * TERA, 417.5 * TERA, _H100, 94),
    # H200 product page, SXM / NVL: BF16 1,979* / 1,671*, TF32 989* / 835* TFLOPS (the H100's tensor cores);
    # GPU memory 141 GB both.
    "h200": Peak("NVIDIA H200 SXM", 989.5 * TERA, 494.5 * TERA, _H200, 141),
    "h200-nvl": Peak("NVIDIA H200 NVL", 835.5 * TERA, 417.5 * TERA, _H200, 141),
    # A100 datasheet (SXM4 and PCIe alike): BF16 312 TFLOPS (624* sparse), TF32 156 TFLOPS (312*); GPU memory
    # 80 GB, or 40 GB on the A100 40GB (the same peaks).
    "a100": Peak("NVIDIA A100 80GB", 312.0 * TERA, 156.0 * TERA, _A100, 80),
    "a100-40gb": Peak("NVIDIA A100 40GB", 312.0 * TERA, 156.0 * TERA, _A100, 40),
    # L4 datasheet: BF16 242 TFLOPS*, TF32 120 TFLOPS*; GPU memory 24 GB.
    "l4": Peak("NVIDIA L4", 121.0 * TERA, 60.0 * TERA, "https://www.nvidia.com/en-us/data-center/l4/", 24),
    # HGX B200 spec table, per GPU: FP16/BF16 4.5 PFLOPS*, TF32 2.2 PFLOPS*; memory 1,440 GB for the 8 GPUs.
    "b200": Peak("NVIDIA B200", 2250.0 * TERA, 1100.0 * TERA, "https://www.nvidia.com/en-us/data-center/hgx/", 180),
    # Cloud TPU system architecture pages, "Peak compute per chip (bf16)" and "HBM capacity" per chip. No TF32.
    "tpu-v4": Peak("Google TPU v4", 275.0 * TERA, None, "https://cloud.google.com/tpu/docs/v4", 32),
    "tpu-v5e": Peak("Google TPU v5e", 197.0 * TERA, None, "https://cloud.google.com/tpu/docs/v5e", 16),
    "tpu-v5p": Peak("Google TPU v5p", 459.0 * TERA, None, "https://cloud.google.com/tpu/docs/v5p", 95),
    "tpu-v6e": Peak("Google TPU v6e (Trillium)", 918.0 * TERA, None, "https://cloud.google.com/tpu/docs/v6e", 32),
}
# Lower-cased device name -> PEAKS key, first match wins. torch_xla's device kinds read "TPU v4", "TPU v5 lite",
# "TPU v5", "TPU v6 lite" or accelerator types ("TPU v5litepod-16"); \b keeps GH200, GB200 and L40(S) out.
_TPUS = ((r"v6(e|\s*lite)", "tpu-v6e"), (r"v5(e|\s*lite)", "tpu-v5e"), (r"v5(p|\b)", "tpu-v5p"), (r"v4\b", "tpu-v4"))
_GPUS = ((r"\bh100\b.*nvl", "h100-nvl"), (r"\bh100\b.*pcie", "h100-pcie"), (r"\bh100\b.*(hbm3|sxm)", "h100-sxm"),
         (r"\bh200\b.*nvl", "h200-nvl"), (r"\bh200\b", "h200"), (r"\ba100\b.*\b40\s*gb", "a100-40gb"),
         (r"\ba100\b", "a100"), (r"\bl4\b", "l4"), (r"\bb200\b", "b200"))


def matmul_precision(run_precision: str) -> str:
    """The peak column a run's train.precision is measured against: bf16 | tf32."""
    return "tf32" if run_precision == "fp32" else "bf16"


def table_peak(hardware: str, run_precision: str) -> Optional[float]:
    """Dense peak FLOP/s per device for a table key at the run's precision, or None if not published."""
    return getattr(PEAKS[hardware], matmul_precision(run_precision))


def detect_hardware(device_name: str, power_limit_w: Optional[float] = None) -> Optional[str]:
    """Map a device name (torch / torch_xla) to a PEAKS key; None when unknown, never a guess. H100 boards report
    "... H100 80GB HBM3" (SXM), "... PCIe" or "... NVL"; a bare "H100" is told apart by the board's default power
    limit (SXM 700 W, PCIe 350 W, NVL 400 W)."""
    name = device_name.lower()
    table = _TPUS if "tpu" in name else _GPUS
    if key := next((key for pattern, key in table if re.search(pattern, name)), None):
        return key
    if re.search(r"\bh100\b", name) and power_limit_w is not None:
        return "h100-sxm" if power_limit_w >= 500 else "h100-pcie" if power_limit_w <= 360 else None
    return None


# ---------------------------------------------------------------- measured peak (CPU)
def measure_matmul_flops(dtype: Any, device: Any = "cpu", budget_s: float = 0.3,
                         sync: Callable[[], None] = lambda: None, n: int = 1024) -> float:
    """Best square-matmul FLOP/s seen within about `budget_s` seconds: the measured peak. A fixed size (1024: every
    core busy, ~10 ms a product on a CPU), not one picked from a first timing, which a busy machine skews toward
    tiny sizes and a far too low peak. The fastest batch counts: interference only ever makes a batch slower."""
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
        out = a @ b  # warm-up: allocation, kernel selection
        sync()
        best = 0.0
        while True:
            t0 = time.perf_counter()
            for _ in range(3):
                torch.matmul(a, b, out=out)
            sync()
            best = max(best, 2 * n**3 * 3 / (time.perf_counter() - t0))  # N N @ N N: n³ multiply-adds, 3 products
            if time.perf_counter() - start > budget_s:
                return best


def _cpuinfo(*fields: str) -> Optional[str]:
    """The first /proc/cpuinfo line naming one of `fields`, its value; None where there is none (not Linux)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name.strip() in fields:
                return value.strip()
    return None


def cpu_model_name() -> str:
    """The CPU's marketing name from /proc/cpuinfo ("Intel(R) Xeon(R) Processor", "AMD EPYC 7B13", ...)."""
    return _cpuinfo("model name") or platform.processor() or "cpu"


def cpu_flags() -> str:
    """The CPU's instruction-set flags (x86 `flags`, Arm `Features`): the same name may hide another ISA."""
    return _cpuinfo("flags", "Features") or ""


# What a CPU's vector units compute natively, best first: (name, the /proc/cpuinfo flags that mean it, native bf16).
# Without bf16 hardware torch emulates bf16 matmuls through fp32 and conversions: on 2-core AVX2 AMD EPYCs a batched
# matmul of the CPU speedrun's width ran 45-59x slower in bf16 than in fp32 (docs/results.md, "CPU kinds").
CPU_ISAS = (("AMX", ("amx_bf16",), True), ("AVX512-BF16", ("avx512_bf16",), True), ("AVX512", ("avx512f",), False),
            ("AVX2", ("avx2",), False), ("ARM-BF16", ("bf16",), True))


def cpu_isa(flags: Optional[str] = None) -> tuple[str, bool]:
    """(the best matmul ISA this CPU has, whether it computes bf16 in hardware), from its flags: ("AVX2", False)
    on an AVX2-only EPYC, ("AMX", True) on a Sapphire Rapids Xeon; ("other", False) where none is known."""
    have = set((cpu_flags() if flags is None else flags).split())
    for name, needs, native_bf16 in CPU_ISAS:
        if have.issuperset(needs):
            return name, native_bf16
    return "other", False


# ---------------------------------------------------------------- the CPU peak, measured once per machine
PEAK_CACHE = "cpu_peak.json"  # under io.cache_dir(): {peak_key(): {"peak", "measured_at", "uses"}}
# A peak measured under load is too low: an entry keeps the highest measurement and is measured again after this
# many uses or seconds, whichever comes first, so a low one does not stick. NANOPT_MEASURE_PEAK=1 measures now.
PEAK_USES, PEAK_AGE_S = 10, 7 * 24 * 3600
# The full measurement's budget, and the quick one's that checks a cached peak at every start: 0 s is the warm-up
# product and one timed batch of three (0.03-0.06 s on 2 quiet AMD EPYC cores, up to 0.25 s when they were busy). A
# cached peak more than PLAUSIBLE times off the quick figure, either way, is not this machine's (a copied or edited
# file): it is measured again. A busy machine reads lower, but not by 4x: there the quick figure stayed within 2x of
# the full one.
PEAK_BUDGET_S, CHECK_BUDGET_S, PLAUSIBLE = 0.3, 0.0, 4.0
# A measurement's time may lie a little ahead of this clock (a home directory shared with another machine), not more.
CLOCK_SKEW_S = 24 * 3600
Measure = Callable[[float], float]  # budget in seconds -> FLOP/s, measured by every rank at once (their mean)


def peak_key(dtype: Any, threads: Optional[int], ranks: int) -> str:
    """What a measured peak depends on: the CPU (name, flags), threads per rank (None: torch's), ranks measuring at
    once, the dtype and torch's version (its kernels). Any change is another entry, measured anew."""
    import torch

    threads = torch.get_num_threads() if threads is None else threads
    flags = hashlib.sha256(cpu_flags().encode()).hexdigest()[:12]
    return f"{cpu_model_name()} | flags {flags} | {threads} threads x {ranks} ranks | {dtype} | {torch.__version__}"


def _entry_problem(entry: Any, now: float) -> Optional[str]:
    """Why a cache entry cannot be used as it stands (None when it can): JSON turns 1e400 into inf and NaN into
    nan, and a hand-edited or copied file holds anything."""
    if not isinstance(entry, dict):
        return "not an object"
    peak, at, uses = entry.get("peak"), entry.get("measured_at"), entry.get("uses")
    if type(peak) not in (int, float) or not math.isfinite(peak) or peak <= 0:
        return f"peak {peak!r} is not a finite positive FLOP/s"
    if type(at) not in (int, float) or not 0 < at <= now + CLOCK_SKEW_S:
        return f"measured_at {at!r} is not a time up to now"
    if type(uses) is not int or uses < 0:
        return f"uses {uses!r} is not a count"
    return None


def _read_peaks(path: Path, now: float, warn: Callable[[str], None]) -> dict[str, Any]:
    """The cache's usable entries. A damaged file or entry costs one warning naming it and is left out: its
    peak is measured again when asked for, and the caller's write replaces the file."""
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict):
        warn(f"mfu: {path} is damaged (not a JSON object of entries); ignoring it and measuring the CPU peak (the "
             f"file is rewritten)")
        return {}
    problems = {key: problem for key, entry in data.items() if (problem := _entry_problem(entry, now))}
    if problems:
        warn(f"mfu: {path} has damaged entries ({'; '.join(f'{k!r}: {p}' for k, p in problems.items())}); ignoring "
             f"them and measuring the CPU peak where needed (the file is rewritten)")
    return {key: entry for key, entry in data.items() if key not in problems}


def _plausible(a: float, b: float) -> bool:
    return b / PLAUSIBLE <= a <= b * PLAUSIBLE


def cpu_peak(key: str, measure: Measure, agree: Callable[[bool], bool] = lambda must: must,
             main: bool = True) -> tuple[float, str]:
    """(CPU matmul peak FLOP/s, how it was had: "cached (measured DATE, N uses)" or "measured now"), measured
    once per machine and key (peak_key) and then read from PEAK_CACHE, each read checked against a quick
    measurement. Several ranks: each calls this with `measure` their joint measurement and `agree` a collective
    (True on every rank when any rank's argument is), so all ranks measure together or none do; only `main` warns
    and writes."""
    path, now = cache_dir() / PEAK_CACHE, time.time()
    warn = log.warning if main else (lambda message: None)
    peaks = _read_peaks(path, now, warn)
    entry = peaks.get(key)
    stale = entry is None or entry["uses"] >= PEAK_USES or now - entry["measured_at"] >= PEAK_AGE_S
    must = agree(stale or os.environ.get("NANOPT_MEASURE_PEAK") == "1")
    if not must:  # every rank is here together (agree is a collective), so the quick measurement is joint too
        quick = measure(CHECK_BUDGET_S)
        if agree(not _plausible(entry["peak"], quick)):
            warn(f"mfu: the CPU peak in {path} ({entry['peak'] / TERA:.4g} TFLOP/s) is more than {PLAUSIBLE:g}x "
                 f"off a quick measurement now ({quick / TERA:.4g} TFLOP/s); measuring it again (the entry is "
                 f"rewritten)")
            must = True
    if must:
        # The higher of this and the earlier peak (a busy machine measures low), unless that is more than PLAUSIBLE
        # times off (not this machine's: replaced).
        value = measure(PEAK_BUDGET_S)
        old = entry["peak"] if entry and _plausible(entry["peak"], value) else 0.0
        how = "measured now" + ("" if value >= old else f" ({value / TERA:.3f} TFLOP/s; the higher "
                                                          f"{old / TERA:.3f} measured before is kept)")
        entry = {"peak": max(value, old), "measured_at": now, "uses": 0}
    else:
        entry = {**entry, "uses": entry["uses"] + 1}
        when = time.strftime("%Y-%m-%d", time.localtime(entry["measured_at"]))
        how = f"cached (measured {when}, {entry['uses']} uses)"
    if main:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, {**peaks, key: entry})
        except (OSError, ConfigError) as e:  # a read-only home (or a directory at the name): measured every start
            log.warning("mfu: cannot write %s (%s); the CPU peak is measured again next start", path, e)
    return entry["peak"], how
