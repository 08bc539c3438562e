"""THE device module: torchrun ranks, the process group, autocast, sync, memory, RNG, activation recompute.

What differs between device types sits behind one small backend per type (CpuBackend, CudaBackend, xla.py's
XlaBackend), chosen once by init(): Runtime delegates instead of branching, so adding a device is adding a backend."""
from __future__ import annotations

import contextlib
import ctypes.util
import datetime
import logging
import os
import random
import resource
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.profiler import ProfilerActivity

from nanopt.distributed import xla
from nanopt.distributed.hardware import cpu_isa, cpu_model_name, measure_matmul_flops
from nanopt.errors import ConfigError

log = logging.getLogger("nanopt")


class Backend:
    """One device type's answers. These defaults are those of a device that has none of the thing asked about."""

    num_devices = 1  # devices this process drives
    measures_peak = False  # MFU against a matmul benchmark at start-up rather than a spec sheet
    profiler_activities: Optional[list] = None  # None where torch.profiler does not drive the device
    process_group_options: dict[str, Any] = {"backend": "gloo"}
    ddp_device_ids: Optional[list[int]] = None
    fp8: Optional[str] = None  # train.fp8: "native" (FP8 tensor cores), "emulated" (torchao: the numerics), None
    # optim.BatchedMuon's cut-off: larger matrices are orthogonalised one at a time, the rest batched per shape.
    muon_batch_max_numel: Optional[int] = None  # None: every shape batches
    native_bf16 = False  # bf16 matmuls run in hardware; False where torch would emulate them through fp32

    def __init__(self, device: torch.device) -> None:
        self.device = self.init_device = device  # init_device: where weights are initialised, then moved

    @property
    def reduced_dtype(self) -> torch.dtype:
        """The cheapest float dtype this device computes natively, for work that tolerates bf16's rounding
        (Muon's Newton-Schulz and its messages): bf16, or fp32 where bf16 would be emulated and far slower."""
        return torch.bfloat16 if self.native_bf16 else torch.float32

    def sync(self) -> None:
        """Wait for queued device work, so host timers measure it."""

    def batch_to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def compile_step(self, step_fn: Callable, optimizer: torch.optim.Optimizer, shapes: int = 1) -> Callable:
        """The train step as the loop should call it; `shapes`: how many step shapes the run has (its stages)."""
        return step_fn

    def mark_step(self) -> None:
        """End of a unit of lazy work (an eval batch)."""

    def preemption_warning(self, mirror: str) -> Optional[str]:
        """Why checkpoints on local disk may not outlive this machine, or None."""
        return None

    def peak_memory_bytes(self) -> Optional[int]:
        """Peak device memory since start (CUDA: allocated; CPU: resident set; XLA: the busiest chip's), or None."""
        return None

    def peak_reserved_bytes(self) -> Optional[int]:
        """Peak memory a caching allocator reserved (what runs out: allocated plus cached, fragmented blocks)."""
        return None

    def start_memory_history(self) -> bool:
        """Start recording the allocator's history; False where there is none."""
        return False

    def dump_memory_snapshot(self, path: str) -> None:
        """Write the recorded allocator history (view at pytorch.org/memory_viz) and stop recording."""

    def hardware_name(self) -> str:
        return self.device.type

    def power_limit_watts(self) -> Optional[float]:
        """The board's default power limit (tells an H100 SXM from a PCIe card when the name is bare), or None."""
        return None

    def rng_state(self) -> dict[str, Any]:
        """Device generators to checkpoint beside the host's."""
        return {}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore what rng_state() saved (a checkpoint of another device type holds none of it)."""


class CpuBackend(Backend):
    """The host. MFU is measured: no spec sheet describes a shared, throttled, differently vectorised host."""

    measures_peak = True
    profiler_activities = [ProfilerActivity.CPU]
    fp8 = "emulated"  # to test FP8 runs' numerics without a GPU

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.isa, self.native_bf16 = cpu_isa()
        # bench/muon_step.py --cut-off (6 matrices, 2 cores): batched bf16 pays up to 384x384 on an AVX512-BF16
        # EPYC (2.6x at 128x128, 0.97x at 512x512); fp32 on an AVX2 EPYC up to ~128x344 (0.87-0.97x from 147k up).
        self.muon_batch_max_numel = 3 * 2**16 if self.native_bf16 else 2**16

    @classmethod
    def start(cls, local_rank: int, local_world: int, threads: int, precision: str) -> CpuBackend:
        # Each rank gets its share of the cores; oversubscription costs more than it gives.
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // max(1, local_world)))
        keep_freed_memory()
        return cls(torch.device("cpu"))

    def peak_memory_bytes(self) -> Optional[int]:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # this process's peak RSS; Linux says KiB

    def hardware_name(self) -> str:
        """The model name and what it computes natively: "AMD EPYC (AVX2, bf16 emulated, torch AVX2)"."""
        return (f"{cpu_model_name()} ({self.isa}, bf16 {'native' if self.native_bf16 else 'emulated'}, "
                f"torch {torch.backends.cpu.get_cpu_capability()})")


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed blocks up to 32 MiB instead of unmapping them: otherwise every step's activations
    are fresh pages the kernel faults in and zeroes, ~5% of the CPU speedrun's time (docs/results.md). The peak is
    the same, held until exit. False where there is no glibc."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # musl, macOS: no such knob
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


class CudaBackend(Backend):
    """One GPU per rank, through its torch device module (torch.cuda)."""

    profiler_activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    # muon_batch_max_numel None: every shape batches (one Newton-Schulz per matrix is hundreds of small launches);
    # bench/gpu_check.py --quick's `muon` section measures the cut-off to set here.

    @classmethod
    def start(cls, local_rank: int, local_world: int, threads: int, precision: str) -> CudaBackend:
        torch.cuda.set_device(local_rank)
        # TF32 for any fp32 matmul that remains: the MFU peaks assume tensor cores.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return cls(torch.device("cuda", local_rank))

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.module = torch.get_device_module(device)
        self.process_group_options = {"backend": "nccl", "device_id": device}
        self.ddp_device_ids = [device.index]

    @property
    def fp8(self) -> Optional[str]:  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and later
        return "native" if self.module.get_device_capability(self.device) >= (8, 9) else None

    @property
    def native_bf16(self) -> bool:  # type: ignore[override]
        return self.module.get_device_capability(self.device) >= (8, 0)  # bf16 tensor cores: Ampere and later

    def sync(self) -> None:
        self.module.synchronize(self.device)

    def peak_memory_bytes(self) -> Optional[int]:
        return int(self.module.max_memory_allocated(self.device))

    def peak_reserved_bytes(self) -> Optional[int]:
        return int(self.module.max_memory_reserved(self.device))

    def start_memory_history(self) -> bool:
        self.module.memory._record_memory_history(max_entries=100_000)
        return True

    def dump_memory_snapshot(self, path: str) -> None:
        self.module.memory._dump_snapshot(path)
        self.module.memory._record_memory_history(enabled=None)

    def hardware_name(self) -> str:
        return self.module.get_device_name(self.device)

    def power_limit_watts(self) -> Optional[float]:
        # Address the board by UUID: CUDA_VISIBLE_DEVICES renumbers devices, NVML and nvidia-smi do not.
        uuid = str(getattr(self.module.get_device_properties(self.device), "uuid", "") or "")
        nvml_id = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        try:  # nvidia-smi comes with the driver (NVML's Python binding is not a dependency); once per start
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=power.default_limit", "--format=csv,noheader,nounits", "-i", nvml_id],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout
            return float(out.strip().splitlines()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    def rng_state(self) -> dict[str, Any]:
        # This rank's GPU only, not get_rng_state_all(): every rank sees all GPUs of its node, and a resume with
        # fewer visible would restore generators that do not exist.
        return {"cuda": self.module.get_rng_state(self.device)}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        if "cuda" in state:
            self.module.set_rng_state(state["cuda"], self.device)


class SpmdXlaBackend(xla.XlaBackend, Backend):
    """xla.py's backend, with Backend's answers where XLA has none of its own (torch.profiler, allocator history)."""


BACKENDS: dict[str, type[Backend]] = {"cpu": CpuBackend, "cuda": CudaBackend, "xla": SpmdXlaBackend}


@dataclass
class Runtime:
    kind: str  # cuda | cpu | xla
    device: torch.device
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    precision: str  # bf16 | bf16-pure | fp32
    backend: Optional[Backend] = None  # init() passes it; otherwise made from `kind`

    def __post_init__(self) -> None:
        if self.backend is None:
            self.backend = BACKENDS[self.kind](self.device)

    @property
    def num_devices(self) -> int:
        """Accelerators doing the work: one per rank, or every chip this process drives under SPMD."""
        return self.backend.num_devices * self.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """Every rank's group (torch's default one) under torchrun, None in one process."""
        return dist.group.WORLD if self.distributed else None

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-pure" else torch.float32

    def reduced_dtype(self, choice: str = "auto") -> torch.dtype:
        """A config's dtype choice for reduced-precision work (optim.muon_dtype): auto = the backend's."""
        return {"auto": self.backend.reduced_dtype, "bf16": torch.bfloat16, "fp32": torch.float32}[choice]

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast for matmuls (weights stay fp32) or nothing for fp32 / pure bf16."""
        bf16 = self.precision == "bf16"
        return torch.autocast(device_type=self.kind, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def sync(self) -> None:
        self.backend.sync()

    def warn_if_checkpoints_perishable(self, mirror: str) -> None:
        """Warn when checkpoints live only on a disk the machine takes with it (a spot TPU VM, no mirror)."""
        if message := self.backend.preemption_warning(mirror):
            log.warning("%s", message)

    def hardware_name(self) -> str:
        return self.backend.hardware_name()

    def rng_state(self) -> dict[str, Any]:
        """This process's RNG states (host and device), in types torch.load(weights_only=True) accepts."""
        return {**host_rng_state(), **self.backend.rng_state()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        set_host_rng_state(state)
        self.backend.set_rng_state(state)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def peak_memory_by_rank(self) -> tuple[Optional[list[int]], Optional[list[int]]]:
        """Every rank's peak (allocated, reserved) bytes in rank order, each None where the device cannot tell:
        one all_reduce of 2 × world_size integers on the device, so call it at the log cadence, not per step."""
        mine = (self.backend.peak_memory_bytes(), self.backend.peak_reserved_bytes())
        if not self.distributed:  # no device work: on XLA a tensor here would be one more graph per log line
            return tuple(None if v is None else [v] for v in mine)  # type: ignore[return-value]
        table = torch.zeros(2, self.world_size, dtype=torch.int64, device=self.device)
        table[:, self.rank] = torch.tensor([-1 if v is None else v for v in mine], dtype=torch.int64)
        rows = self.all_reduce_sum(table).tolist()
        return tuple(None if min(row) < 0 else row for row in rows)  # type: ignore[return-value]

    def gather_objects(self, obj: object) -> list:
        """Every rank's `obj`, in rank order (a list of one without a process group)."""
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def on_main(self, fn: Callable[[], Any], errors: tuple[type[Exception], ...] = (ConfigError,)) -> Any:
        """fn() on rank 0 alone (its result there, None elsewhere); what it raised of `errors` every rank raises."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except errors as e:
                error = e
        if (error := self.gather_objects(error)[0]) is not None:
            raise error
        return result


def static_shapes(device: torch.device) -> bool:
    """True where every new tensor shape is a new compiled graph (XLA): sampling pads to fixed lengths."""
    return torch.device(device).type == "xla"


def torchrun_world() -> tuple[int, int, int, int]:
    """(rank, local rank, world size, ranks per node) from torchrun's environment; one process without it."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    return rank, _env_int("LOCAL_RANK", 0), world, _env_int("LOCAL_WORLD_SIZE", world)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name) or str(default)
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer (it is set by torchrun).") from None


def detect_kind(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("`runtime.device` is cuda but torch sees no CUDA device (torch "
                          f"{torch.__version__}); use `--runtime.device=cpu` or install a CUDA build of torch.")
    return requested


def init(device: str = "auto", precision: str = "bf16", threads: int = 0) -> Runtime:
    """Read torchrun's environment, start the device's backend, and the process group when world > 1."""
    rank, local_rank, world, local_world = torchrun_world()
    kind = detect_kind(device)
    if kind == "xla" and world > 1:  # multi-process XLA (torchrun, xmp.spawn) is not how nanopt runs it
        raise ConfigError(f"`runtime.device` is xla but this process is rank {rank} of {world} (launched by torchrun). "
                          "On XLA one process drives all of a host's chips through SPMD: run `python -m nanopt.main "
                          "...` without torchrun.")
    backend = BACKENDS[kind].start(local_rank, local_world, threads, precision)
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(minutes=30)
        dist.init_process_group(timeout=timeout, **backend.process_group_options, **_restart_store(timeout))
    return Runtime(kind, backend.device, rank, local_rank, world, local_world, precision, backend)


def init_to_evaluate(device: str, asked: str, trained: str, threads: int = 0) -> Runtime:
    """The runtime that evaluates a run: `asked` (fp32 | bf16), or "run": as it trained (bf16-pure: fp32), except in
    fp32 on a device that would emulate bf16 (~45x slower on an AVX2 CPU), said once."""
    precision = trained if asked == "run" else asked
    rt = init(device, "bf16" if precision == "bf16" else "fp32", threads)
    if asked == "run" and rt.precision == "bf16" and not rt.backend.native_bf16:
        log.info("evaluating in fp32: the run trained under bf16 autocast, which %s would emulate (--precision bf16 "
                 "evaluates as it trained)", rt.hardware_name())
        rt.precision = "fp32"
    return rt


def bf16_slowdown(width: int, device: torch.device) -> float:
    """How many times longer a width x width matmul takes in bf16 than in fp32 here (~0.1 s to measure)."""
    fp32, bf16 = (measure_matmul_flops(dtype, device, 0.05, n=width) for dtype in (torch.float32, torch.bfloat16))
    return fp32 / bf16


def _restart_store(timeout: datetime.timedelta) -> dict:
    """After a torchrun --max-restarts restart, a store namespaced by the attempt (else {}: torch's default): the
    agent keeps one store across restarts, where a restarted group would read the dead attempt's peer addresses
    (gloo on torch 2.13; pytorch/pytorch#167288)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    if attempt == "0":
        return {}
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    return {"store": dist.PrefixStore(f"nanopt_attempt_{attempt}", store), "rank": rank, "world_size": world}


def host_rng_state() -> dict[str, Any]:
    """Python's, numpy's and torch's CPU RNG states, in types torch.load(weights_only=True) accepts."""
    _, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    numpy_state = {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                   "cached_gaussian": float(cached)}
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}


def set_host_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    npy = state["numpy"]
    np.random.set_state(("MT19937", npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def recompute(fn: Callable, *args: torch.Tensor) -> torch.Tensor:
    """Activation checkpointing: run `fn` now without keeping its activations, and again in backward. On XLA
    torch's own fails (it looks up `torch.xla`), and XLA would fold the recompute away: torch_xla's has a barrier."""
    if args[0].device.type == "xla":
        return xla.recompute(fn, *args)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def teardown(wait_for_peers: bool = False) -> None:
    """Leave the process group, if any. wait_for_peers (a successful exit): a rank that drops its gloo links while a
    peer still writes files can abort it ("terminate called without an active exception"). On an error path the
    peers may never arrive (torchrun stops them)."""
    if dist.is_available() and dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
