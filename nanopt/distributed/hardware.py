"""What a device can do: the dense spec-sheet peak table, device-name -> peak detection, the measured CPU matmul
peak. Torch-free at import (the measuring function imports it), so config checks stay fast."""
from __future__ import annotations

import contextlib
import platform
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional


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
# Measured at every start (every rank at once, mfu.run_peak): a fraction of a second, never a stale or copied figure.
PEAK_BUDGET_S = 0.3


def measure_matmul_flops(dtype: Any, device: Any = "cpu", budget_s: float = PEAK_BUDGET_S,
                         sync: Callable[[], None] = lambda: None, n: int = 1024) -> float:
    """Best square-matmul FLOP/s seen within about `budget_s` seconds: the measured peak. A fixed size (1024: every
    core busy, ~10 ms a product on a CPU), not one picked from a first timing, which a busy machine skews toward
    tiny sizes and a far too low peak; halved only while one product would outlast the budget (emulated bf16, AVX2:
    11 CPU s a run at 1024). The fastest batch counts: interference only ever makes a batch slower."""
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        a = torch.randn(n // 4, n // 4, dtype=dtype, device=device)
        for _ in range(2):  # a product at n/4 predicts one at n: the second timed, the first selects kernels
            t0 = time.perf_counter()
            a @ a
            sync()
        probe = time.perf_counter() - t0
        while n > a.shape[0] and probe * (n / a.shape[0]) ** 3 > budget_s:
            n //= 2
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


# What a CPU's vector units compute natively, best first: (name, the /proc/cpuinfo flags that mean it, native bf16).
# Without bf16 hardware torch emulates bf16 matmuls through fp32 and conversions: on 2-core AVX2 AMD EPYCs a batched
# matmul of the CPU speedrun's width ran 45-59x slower in bf16 than in fp32 (docs/results.md, "CPU kinds").
CPU_ISAS = (("AMX", ("amx_bf16",), True), ("AVX512-BF16", ("avx512_bf16",), True), ("AVX512", ("avx512f",), False),
            ("AVX2", ("avx2",), False), ("ARM-BF16", ("bf16",), True))


def cpu_isa(flags: Optional[str] = None) -> tuple[str, bool]:
    """(the best matmul ISA this CPU has, whether it computes bf16 in hardware), from its instruction-set flags (x86
    `flags`, Arm `Features`; the same model name may hide another ISA): ("AVX2", False) on an AVX2-only EPYC, ("AMX",
    True) on a Sapphire Rapids Xeon; ("other", False) where none is known."""
    have = set(((_cpuinfo("flags", "Features") or "") if flags is None else flags).split())
    for name, needs, native_bf16 in CPU_ISAS:
        if have.issuperset(needs):
            return name, native_bf16
    return "other", False
