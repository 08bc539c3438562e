"""THE device module: device kind, torchrun ranks, process group, autocast, sync, memory, hardware name.

Every branch on cuda / cpu / xla lives here; the rest of nanopt asks this module.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from nanopt.config import ConfigError

log = logging.getLogger("nanopt")


@dataclass
class Runtime:
    kind: str  # cuda | cpu | xla
    device: torch.device
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    precision: str  # bf16 | bf16-pure | fp32

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-pure" else torch.float32

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast for matmuls (weights stay fp32) or nothing for fp32 / pure bf16."""
        if self.precision != "bf16":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.kind, dtype=torch.bfloat16)

    def sync(self) -> None:
        """Wait for queued device work, so host timers measure it."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def peak_memory_bytes(self) -> Optional[int]:
        """Peak allocated device memory since start, or None where the device cannot tell."""
        if self.kind == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.kind == "cpu":
            import resource  # peak resident set of this process; Linux reports KiB

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        return None

    def hardware_name(self) -> str:
        if self.kind == "cuda":
            return torch.cuda.get_device_name(self.device)
        if self.kind == "cpu":
            return _cpu_model_name()
        return "xla"


def _cpu_model_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer (it is set by torchrun).") from None


def detect_kind(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "`runtime.device` is cuda but torch sees no CUDA device (torch "
            f"{torch.__version__}); use `--runtime.device=cpu` or install a CUDA build of torch."
        )
    if requested == "xla":
        raise ConfigError(
            "`runtime.device` is xla, but the XLA path is not part of this build yet; "
            "use `--runtime.device=cpu` or `cuda`."
        )
    return requested


def init(device: str = "auto", precision: str = "bf16", threads: int = 0) -> Runtime:
    """Read torchrun's environment, pick the device, and start the process group when world > 1."""
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    kind = detect_kind(device)
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        # TF32 for any fp32 matmul that remains: the MFU peaks assume tensor cores.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        dev = torch.device("cpu")
        # Each rank gets its share of the cores; oversubscription costs more than it gives.
        n = threads or max(1, (os.cpu_count() or 1) // max(1, local_world))
        torch.set_num_threads(n)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if kind == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend, timeout=datetime.timedelta(minutes=30),
            device_id=dev if kind == "cuda" else None,
        )
    return Runtime(kind, dev, rank, local_rank, world, local_world, precision)


def teardown(rt: Optional[Runtime] = None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
