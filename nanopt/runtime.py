"""THE device module: device kind, torchrun ranks, process group, autocast, sync, memory, hardware name.

Every branch on cuda / cpu / xla lives here; the rest of nanopt asks this module.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint

from nanopt import xla
from nanopt.errors import ConfigError
from nanopt.hardware import cpu_model_name

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
    xla: Optional[Any] = None  # nanopt.xla.XlaBackend when kind == "xla" (SPMD over all local chips)

    @property
    def num_devices(self) -> int:
        """Accelerators doing the work: one per rank, or every chip this process drives under SPMD."""
        return self.xla.num_devices if self.xla is not None else self.world_size

    @property
    def init_device(self) -> torch.device:
        """Where weights are initialised: on XLA the host, since RNG on the XLA device differs from (and
        with torch.Generator crashes on) the CPU's; the model then moves to `device`."""
        return torch.device("cpu") if self.kind == "xla" else self.device

    def compile_step(self, step_fn: Callable, optimizer: torch.optim.Optimizer) -> Callable:
        """The train step as the loop should call it: on XLA one compiled graph, reused every step."""
        return self.xla.compile_step(step_fn, optimizer) if self.xla is not None else step_fn

    def batch_to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host batch on the device; on XLA sharded along the batch dimension over the data mesh."""
        if self.xla is not None:
            return self.xla.shard_batch(t)
        return t.to(self.device, non_blocking=True)

    def warn_if_checkpoints_perishable(self, mirror: str) -> None:
        """At start-up: warn when checkpoints live only on a disk the VM takes with it (a spot or preemptible
        TPU VM, asked of its metadata server, and no checkpoint.mirror); nothing elsewhere."""
        message = self.xla.preemption_warning(mirror) if self.xla is not None else None
        if message:
            log.warning("%s", message)

    def mark_step(self) -> None:
        """End of a unit of lazy work (an eval batch): XLA compiles/runs the graph so far; no-op elsewhere."""
        if self.xla is not None:
            self.xla.mark_step()

    @property
    def measures_peak(self) -> bool:
        """True where MFU is measured against a matmul benchmark run at start-up (CPU: no spec sheet
        describes a shared, throttled, differently-vectorised host), not the spec-sheet table."""
        return self.kind == "cpu"

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
        elif self.xla is not None:
            self.xla.wait()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def gather_objects(self, obj: object) -> list:
        """Every rank's `obj`, in rank order (a list of one without a process group)."""
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def peak_memory_bytes(self) -> Optional[int]:
        """Peak allocated device memory since start, or None where the device cannot tell."""
        if self.kind == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.kind == "cpu":
            import resource  # peak resident set of this process; Linux reports KiB

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        if self.xla is not None:
            return self.xla.peak_memory_bytes()
        return None

    def peak_reserved_bytes(self) -> Optional[int]:
        """Peak memory the CUDA caching allocator reserved since start (what runs out: allocated plus the
        allocator's cached, fragmented blocks), or None on other devices."""
        if self.kind == "cuda":
            return int(torch.cuda.max_memory_reserved(self.device))
        return None

    # ---- profiler seams (nanopt/profiling.py asks these instead of branching on the device)

    def profiler_activities(self) -> Optional[list]:
        """torch.profiler activities: CPU always, CUDA on GPUs; None on XLA, whose profiler is a separate
        server (torch_xla.debug.profiler) that nanopt's profiler path does not drive."""
        if self.kind == "xla":
            return None
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if self.kind == "cuda" else [ProfilerActivity.CPU]

    def start_memory_history(self) -> bool:
        """Start recording the CUDA caching allocator's history; False where the device has none."""
        if self.kind != "cuda":
            return False
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        return True

    def dump_memory_snapshot(self, path: str) -> None:
        """Write the recorded allocator history (view at pytorch.org/memory_viz) and stop recording."""
        if self.kind == "cuda":
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)

    def hardware_name(self) -> str:
        if self.kind == "cuda":
            return torch.cuda.get_device_name(self.device)
        if self.kind == "cpu":
            return cpu_model_name()
        return self.xla.hardware_name() if self.xla is not None else "xla"

    def power_limit_watts(self) -> Optional[float]:
        """The GPU board's default power limit in watts, or None (not CUDA, or NVML/nvidia-smi silent).

        nanopt/mfu.py uses it to tell an H100 SXM (700 W) from a PCIe card (350 W) when the name is bare.
        """
        if self.kind != "cuda":
            return None
        return _cuda_default_power_limit(self.device)


def _cuda_default_power_limit(device: torch.device) -> Optional[float]:
    # Address the board by UUID: CUDA_VISIBLE_DEVICES renumbers devices, NVML and nvidia-smi do not.
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
    nvml_id = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    try:
        import pynvml  # nvidia-ml-py, optional

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(nvml_id)
        return pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle) / 1000.0  # milliwatts
    except Exception:  # not installed, or NVML unavailable: ask nvidia-smi
        pass
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=power.default_limit", "--format=csv,noheader,nounits", "-i", nvml_id],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
        return float(out.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def static_shapes(device: torch.device) -> bool:
    """True where every new tensor shape is a new compiled graph (XLA): sampling pads to fixed lengths."""
    return torch.device(device).type == "xla"


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
    return requested


def init(device: str = "auto", precision: str = "bf16", threads: int = 0) -> Runtime:
    """Read torchrun's environment, pick the device, and start the process group when world > 1."""
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    kind = detect_kind(device)
    if kind == "xla":
        return _init_xla(rank, world, precision)
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
        timeout = datetime.timedelta(minutes=30)
        dist.init_process_group(
            backend=backend, timeout=timeout,
            device_id=dev if kind == "cuda" else None, **_restart_store(timeout),
        )
    return Runtime(kind, dev, rank, local_rank, world, local_world, precision)


def _restart_store(timeout: datetime.timedelta) -> dict:
    """After a torchrun --max-restarts restart, a store namespaced by the attempt (else {}: torch's default).

    torchrun's agent keeps one store across restarts, so a restarted group would read the dead attempt's
    peer addresses from it and fail to connect (seen with gloo on torch 2.13; pytorch/pytorch#167288).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    if attempt == "0":
        return {}
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    return {"store": dist.PrefixStore(f"nanopt_attempt_{attempt}", store), "rank": rank, "world_size": world}


def _init_xla(rank: int, world: int, precision: str) -> Runtime:
    """One process drives every local chip through SPMD (xr.use_spmd + a ('data',) mesh); torch_xla is
    imported only here. Multi-process XLA (torchrun / xmp.spawn) is not how nanopt runs it."""
    if world > 1:
        raise ConfigError(
            f"`runtime.device` is xla but this process is rank {rank} of {world} (launched by torchrun). On XLA one "
            f"process drives all of a host's chips through SPMD: run `python -m nanopt.main ...` without torchrun."
        )
    backend = xla.XlaBackend(precision)
    log.info("xla: SPMD over %d %s device(s), mesh ('data',)", backend.num_devices, backend.pjrt_device)
    return Runtime("xla", backend.device, 0, 0, 1, 1, precision, xla=backend)


def flash_unavailable_reason(device_type: str, precision: str = "bf16") -> Optional[str]:
    """Why flash-attn (CUDA only, fp16/bf16 only) cannot be used for this run, or None when it can."""
    if device_type != "cuda":
        return f"flash-attn needs a CUDA device (this run is on {device_type})"
    if precision == "fp32":  # its kernels reject fp32 q/k/v, and an fp32 run has no autocast to cast them
        return "flash-attn computes in fp16/bf16 only and train.precision is fp32"
    try:
        import flash_attn  # noqa: F401
    except ImportError as e:
        return f"flash-attn is not importable ({e}); install the `gpu` extra"
    return None


def sdpa_gqa_unfused_reason(device_type: str, precision: str) -> Optional[str]:
    """Why SDPA with enable_gqa would fall to its math kernel here (T x T scores in memory), or None.

    On CUDA in fp32 the flash kernel refuses fp32 and the memory-efficient kernel refuses enable_gqa, so
    the math kernel runs: 8 GiB of scores per layer at 1B shapes (bench/gpu_check.py measures it).
    """
    if device_type == "cuda" and precision == "fp32":
        return "SDPA's fused CUDA kernels take either fp32 or enable_gqa, not both"
    return None


def adamw_options(device_type: str) -> dict[str, bool]:
    """The AdamW implementation flags for this device: fused on CUDA and CPU (one kernel per step), the
    XLA backend's choice there (torch would otherwise pick its per-parameter loop)."""
    if device_type == "xla":
        return dict(xla.ADAMW_OPTIONS)
    return {"fused": device_type in ("cuda", "cpu")}


def ddp_device_ids(rt: "Runtime") -> Optional[list[int]]:
    """DDP wants the local GPU index on CUDA and nothing on CPU."""
    return [rt.local_rank] if rt.kind == "cuda" else None


def device_rng_state() -> dict[str, Any]:
    """This rank's own GPU generator (CUDA), for exact resume; empty elsewhere.

    One state, not get_rng_state_all(): every rank sees all 8 GPUs of its node, and restoring 8 states
    on a resume with fewer visible GPUs would index generators that do not exist.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"cuda": torch.cuda.get_rng_state(torch.cuda.current_device())}
    return {}


def set_device_rng_state(state: dict[str, Any]) -> None:
    saved = state.get("cuda")
    if saved is None or not torch.cuda.is_available():
        return
    if isinstance(saved, (list, tuple)):  # written by nanopt before this was per rank: one state per GPU
        index = torch.cuda.current_device()
        if index >= len(saved):
            return
        saved = saved[index]
    torch.cuda.set_rng_state(saved, torch.cuda.current_device())


def rng_state() -> dict[str, Any]:
    """This process's RNG states, in types torch.load(weights_only=True) accepts."""
    _, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    state.update(device_rng_state())  # CUDA generators where a GPU is in use
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    npy = state["numpy"]
    if isinstance(npy, dict):
        npy = ("MT19937", npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    np.random.set_state(npy)
    torch.set_rng_state(state["torch"])
    set_device_rng_state(state)


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def recompute(fn: Callable, *args: torch.Tensor) -> torch.Tensor:
    """Activation checkpointing: run `fn` now without keeping its activations, and again in backward.

    On XLA torch's own checkpoint fails (it looks up a `torch.xla` module) and XLA's common-subexpression
    pass would fold the recompute away anyway: torch_xla's version adds an optimisation barrier.
    """
    if args[0].device.type == "xla":
        return xla.recompute(fn, *args)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def xla_flash_unavailable_reason(device_type: str) -> Optional[str]:
    """Why `model.attention: xla_flash` (Pallas, TPU only) cannot run on this device, or None when it can."""
    if device_type != "xla":
        return f"xla_flash needs `runtime.device: xla` on a TPU (this run is on {device_type})"
    return xla.flash_unavailable_reason()


def teardown(rt: Optional[Runtime] = None, wait_for_peers: bool = False) -> None:
    """Leave the process group (a no-op when there is none or it is already gone).

    wait_for_peers: on a successful exit, wait for every rank first: a rank that destroys its gloo
    connections while a peer is still finishing (rank 0 writing files) can abort that peer ("terminate
    called without an active exception", seen here). On an error path do not wait: the peers may never
    arrive, and torchrun stops them when this rank exits non-zero.
    """
    if dist.is_available() and dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
