"""What a device can do: the dense spec-sheet peak table, device-name -> peak detection, the measured CPU matmul
peak. Torch-free at import (measure_matmul_flops imports it), so `nanopt estimate` and config checks stay fast."""
from __future__ import annotations

import platform
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Peak:
    """Dense (no 2:4 sparsity) peak FLOP/s of one device, per matmul precision; None where not published."""
    name: str
    bf16: float
    tf32: Optional[float]
    source: str


TERA = 1e12
_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
# NVIDIA's headline tensor-core figures (marked * below) assume 2:4 structured sparsity; dense training gets half
# of them, which is what is stored here. TPU figures are per chip and dense already. `tf32` is what an fp32 run
# gets on CUDA, because runtime.init enables TF32 tensor-core matmuls.
PEAKS: dict[str, Peak] = {
    # H100 datasheet, SXM5 / PCIe / NVL (per GPU): BF16 1,979* / 1,513* / 1,671*, TF32 989* / 756* / 835* TFLOPS.
    "h100-sxm": Peak("NVIDIA H100 SXM", 989.4 * TERA, 494.7 * TERA, _H100),
    "h100-pcie": Peak("NVIDIA H100 PCIe", 756.5 * TERA, 378.0 * TERA, _H100),
    "h100-nvl": Peak("NVIDIA H100 NVL", 835.5 * TERA, 417.5 * TERA, _H100),
    # H200 product page, SXM / NVL: BF16 1,979* / 1,671*, TF32 989* / 835* TFLOPS (the H100's tensor cores).
    "h200": Peak("NVIDIA H200 SXM", 989.5 * TERA, 494.5 * TERA, _H200),
    "h200-nvl": Peak("NVIDIA H200 NVL", 835.5 * TERA, 417.5 * TERA, _H200),
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
# Lower-cased device name -> PEAKS key, first match wins. torch_xla's device kinds read "TPU v4", "TPU v5 lite",
# "TPU v5", "TPU v6 lite" or accelerator types ("TPU v5litepod-16"); \b keeps GH200, GB200 and L40(S) out.
_TPUS = ((r"v6(e|\s*lite)", "tpu-v6e"), (r"v5(e|\s*lite)", "tpu-v5e"), (r"v5(p|\b)", "tpu-v5p"), (r"v4\b", "tpu-v4"))
_GPUS = ((r"\bh100\b.*nvl", "h100-nvl"), (r"\bh100\b.*pcie", "h100-pcie"), (r"\bh100\b.*(hbm3|sxm)", "h100-sxm"),
         (r"\bh200\b.*nvl", "h200-nvl"), (r"\bh200\b", "h200"), (r"\ba100\b", "a100"), (r"\bl4\b", "l4"),
         (r"\bb200\b", "b200"))


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


def cpu_model_name() -> str:
    """The CPU's marketing name from /proc/cpuinfo ("Intel(R) Xeon(R) Processor", "AMD EPYC 7B13", ...)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"
