"""The XLA (TPU) device path behind runtime.py: PJRT selection, the SPMD data mesh, one compiled graph per
train step with a recompile guard, and Pallas flash attention. torch_xla is imported only inside functions,
when `runtime.device` is xla (or the xla_flash kernel runs), so CUDA and CPU runs never load it."""
from __future__ import annotations

import logging
import math
import os
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from nanopt.errors import ConfigError, TrainingError
from nanopt.io import cache_dir

log = logging.getLogger("nanopt")

# Compilations per step shape before one counts as a recompile: step 0 traces the optimizer's state initialisation,
# step 1 the steady-state graph. Each stage of a batch / seq_len schedule may bring one new step shape.
WARMUP_STEP_COMPILES = 2
MAX_RECOMPILES = int(os.environ.get("NANOPT_XLA_MAX_RECOMPILES", "3"))  # tolerated after warm-up: each stalls the chips
# AdamW: torch picks foreach only on CUDA-like devices, and its per-parameter loop traces a dozen ops per parameter.
# foreach keeps step counts on the host and lr a Python float, a graph input under XLA_NO_SPECIAL_SCALARS.
ADAMW_OPTIONS = {"foreach": True}


def tpu_attached(dev: Path = Path("/dev")) -> bool:
    """Whether this machine shows TPU chips: /dev/accel* (v2 to v4) or /dev/vfio/N (v5e, v5p, v6e). Not
    /dev/vfio/vfio alone: that is the VFIO control node, present wherever the vfio driver is, chips or not."""
    return any(dev.glob("accel*")) or any(p.name != "vfio" for p in (dev / "vfio").glob("*"))


def _select_pjrt_device() -> str:
    """PJRT_DEVICE decides where XLA runs; torch_xla silently falls back to CPU without it, so we don't."""
    if pjrt := os.environ.get("PJRT_DEVICE", ""):
        return pjrt.upper()
    if tpu_attached():
        log.warning("xla: PJRT_DEVICE is not set; TPU chips are visible, so using PJRT_DEVICE=TPU "
                    "(export PJRT_DEVICE=TPU to silence this)")
        os.environ["PJRT_DEVICE"] = "TPU"
        return "TPU"
    raise ConfigError("`runtime.device` is xla but the environment variable PJRT_DEVICE is not set and no TPU is "
                      "visible; torch_xla would silently run on the host CPU. On a TPU VM run `export "
                      "PJRT_DEVICE=TPU`; to try the XLA path on this machine's CPU set PJRT_DEVICE=CPU "
                      "(CPU_NUM_DEVICES=N gives N devices).")


class XlaBackend:
    """One process drives every local chip through SPMD: parameters replicated, batches sharded on 'data'."""

    # Weights are initialised on the host: RNG on the XLA device differs from (with a Generator, crashes on) the CPU's.
    init_device = torch.device("cpu")
    native_bf16 = True  # TPUs' matrix units are bf16; XLA's CPU device (the tests) runs what the TPU would

    @classmethod
    def start(cls, local_rank: int, local_world: int, threads: int, precision: str) -> XlaBackend:
        backend = cls(precision)
        log.info("xla: SPMD over %d %s device(s), mesh ('data',)", backend.num_devices, backend.pjrt_device)
        return backend

    def __init__(self, precision: str = "bf16") -> None:
        # Python scalars (lr, loss scale, ...) become graph inputs instead of constants: no recompiles.
        os.environ.setdefault("XLA_NO_SPECIAL_SCALARS", "1")
        self.pjrt_device = _select_pjrt_device()
        try:
            import torch_xla
            import torch_xla.runtime as xr
        except ImportError as e:
            raise ConfigError(f"`runtime.device` is xla but torch_xla cannot be imported ({e}). Install it beside its "
                              "matching torch: `pip install -e \".[tpu]\"` (torch 2.9 + torch_xla 2.9).") from None
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met
        import torch_xla.distributed.spmd as xs

        self._torch_xla, self._xm, self._xs, self._met = torch_xla, xm, xs, met
        # SPMD must be switched on before anything touches the runtime (device queries included).
        xr.use_spmd()
        if xr.process_count() > 1:
            raise ConfigError(f"`runtime.device` is xla on a multi-host TPU slice ({xr.process_count()} hosts). nanopt "
                              "drives the chips of one host through SPMD; pod slices are not supported. Use a "
                              "single-host slice (e.g. v6e-4 or v6e-8).")
        if precision == "fp32":
            # On TPU an fp32 matmul is one bf16 pass by default; an fp32 run should compute in fp32.
            import torch_xla.backends

            torch_xla.backends.set_mat_mul_precision("highest")
        if self.pjrt_device == "TPU":
            cache = cache_dir() / "xla-compile-cache"
            cache.mkdir(parents=True, exist_ok=True)
            xr.initialize_cache(str(cache), readonly=False)  # compiled graphs survive restarts
            log.info("xla: persistent compilation cache at %s", cache)
        self.num_devices = xr.global_runtime_device_count()
        self.mesh = xs.Mesh(np.arange(self.num_devices), (self.num_devices,), ("data",))
        xs.set_global_mesh(self.mesh)
        self.device = torch_xla.device()
        # The busiest chip's peak, from the first source that answers.
        self.peak_memory_bytes = PeakMemory([("PJRT memory info", self._pjrt_peak_bytes),
                                             ("tpu-info", tpu_info_hbm_bytes)])
        self.step_calls = self.step_compiles = 0  # train-step calls, and the compilations charged to them
        self.shape_calls: dict[tuple, int] = {}  # train-step calls per step shape (a schedule's stages)
        self.expected_shapes = 1  # step shapes the run's schedule brings (compile_step's `shapes`)
        self.recompiles = 0  # of those, the ones after warm-up

    def compile_count(self) -> int:
        """Graphs compiled so far in this process (train steps, eval, sampling), from torch_xla's metrics."""
        data = self._met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def hardware_name(self) -> str:
        """'TPU v6e', 'TPU v5litepod', ... (what nanopt.recipe.mfu's peak table matches), or 'XLA CPU'."""
        if self.pjrt_device == "TPU":
            try:
                from torch_xla._internal import tpu

                return f"TPU {tpu.get_tpu_type()}"
            except Exception as e:  # metadata server unreachable: MFU will be null rather than guessed
                log.warning("xla: cannot tell the TPU generation (%s)", e)
                return "TPU"
        return f"XLA {self.pjrt_device}"

    def _pjrt_peak_bytes(self) -> int:
        real = self._torch_xla.real_devices()[0]
        info = self._torch_xla._XLAC._xla_memory_info(real)  # refused for SPMD's virtual device
        return int(info.get("peak_bytes_used", info["bytes_used"]))

    def preemption_warning(self, mirror: str) -> Optional[str]:
        return preemption_warning(mirror) if self.pjrt_device == "TPU" else None

    def batch_to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host tensor -> device, split along dim 0 over the 'data' axis of the mesh."""
        if t.shape[0] % self.num_devices:
            raise ConfigError(f"a batch of {t.shape[0]} sequences cannot be split over {self.num_devices} XLA devices; "
                              f"make `train.micro_batch_size` a multiple of {self.num_devices} (on XLA it is per "
                              "process, i.e. summed over the chips this process drives).")
        t = t.to(self.device)
        self._xs.mark_sharding(t, self.mesh, ("data",) + (None,) * (t.dim() - 1))
        return t

    def mark_step(self) -> None:
        """Cut the lazy graph here and run it (between eval batches, after init)."""
        self._torch_xla.sync()

    def sync(self) -> None:
        self._xm.wait_device_ops()

    def compile_step(self, step_fn: Callable, optimizer: torch.optim.Optimizer, shapes: int = 1) -> Callable:
        """train_step(model, optimizer, micro_batches, rt, grad_clip) as one reusable XLA graph. Micro-batches are
        sharded outside it; a non-foreach group's lr is a device tensor for the call, so a schedule keeps the graph."""
        for group in (optimizer.defaults, *optimizer.param_groups):  # defaults: for groups added later
            if "capturable" in group and not group.get("foreach"):  # only optimizers that define the flag
                group["capturable"] = True  # step count on the device: bias corrections need no .item()
        compiled = self._torch_xla.compile(step_fn, name="train_step")
        self.expected_shapes = shapes

        def run(model: torch.nn.Module, opt: torch.optim.Optimizer, micro_batches: list, rt: Any,
                grad_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
            if hasattr(model, "_orig_mod"):  # a torch.compile wrapper
                raise ConfigError("`train.compile` is torch.compile (CUDA/CPU); on XLA the step is already one "
                                  "compiled graph. Use `--train.compile=false`.")
            batches = [(self.batch_to_device(x), self.batch_to_device(y)) for x, y in micro_batches]
            lrs = [group["lr"] for group in opt.param_groups]
            for group, lr in zip(opt.param_groups, lrs):
                if not group.get("foreach"):
                    group["lr"] = torch.tensor(float(lr), dtype=torch.float32).to(self.device)
            self.mark_step()  # whatever is pending from outside the step is not the step's graph
            before = self.compile_count()
            try:
                loss, grad_norm = compiled(model, opt, batches, rt, grad_clip)
            finally:
                for group, lr in zip(opt.param_groups, lrs):
                    group["lr"] = lr  # the loop, the logger and checkpoints see plain floats
            shape = (len(batches), tuple(batches[0][0].shape))
            self.shape_calls[shape] = self.shape_calls.get(shape, 0) + 1
            self._count(self.compile_count() - before, self.shape_calls[shape])
            return loss, grad_norm

        return run

    def _count(self, new_compiles: int, shape_calls: int) -> None:
        """Charge a call's compilations: warm-up for the first calls of each expected step shape, else recompiles."""
        self.step_calls += 1
        self.step_compiles += new_compiles
        if not new_compiles:
            return
        stage_warmup = shape_calls <= WARMUP_STEP_COMPILES and len(self.shape_calls) <= self.expected_shapes
        if self.step_calls <= WARMUP_STEP_COMPILES or stage_warmup:
            log.info("xla: train step call %d compiled %d graph(s) (%d so far, expected %d per step shape then none)",
                     self.step_calls, new_compiles, self.step_compiles, WARMUP_STEP_COMPILES)
            return
        self.recompiles += new_compiles
        log.warning("xla: train step call %d RECOMPILED (%d recompile(s) after warm-up); each one stalls the run. "
                    "PT_XLA_DEBUG_LEVEL=2 prints why.", self.step_calls, self.recompiles)
        if self.recompiles > MAX_RECOMPILES:
            raise TrainingError(f"the XLA train step recompiled {self.recompiles} times after warm-up (limit "
                                f"{MAX_RECOMPILES}, NANOPT_XLA_MAX_RECOMPILES changes it): something in the step "
                                "changes shape or is baked in as a constant each step. Run with PT_XLA_DEBUG_LEVEL=2 "
                                "to see which op differs.")


class PeakMemory:
    """Peak device bytes from the first source (a callable returning bytes or raising) that answers. PJRT's memory
    info has a true peak but refuses SPMD's virtual device; tpu-info reads the HBM in use, so its peak is the highest
    seen so far. A source that fails is not asked again; with none left: None and one warning."""

    def __init__(self, sources: list[tuple[str, Callable[[], int]]]) -> None:
        self.sources = list(sources)
        self.failures: list[str] = []
        self.peak: Optional[int] = None

    def __call__(self) -> Optional[int]:
        while self.sources:
            name, read = self.sources[0]
            try:
                used = int(read())
            except Exception as e:  # not installed, no chip, server down, refused: the next source, for good
                self.failures.append(f"{name}: {e}")
                del self.sources[0]
                if not self.sources:
                    log.warning("peak memory unavailable on this device (%s); peak_memory_gib stays null",
                                "; ".join(self.failures))
                continue
            self.peak = used if self.peak is None else max(self.peak, used)
            return self.peak
        return None


def tpu_info_hbm_bytes() -> int:
    """HBM in use now on the busiest local TPU chip, from libtpu's metrics server through tpu-info; raises when
    it cannot tell."""
    from tpu_info import device, metrics  # tpu-info, a dependency of torch_xla[tpu]

    chip, count = device.get_local_chips()
    if chip is None or not count:
        raise RuntimeError("tpu-info sees no TPU chip")
    return max(usage.memory_usage for usage in metrics.get_chip_usage(chip))


METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/scheduling/"


def gce_metadata(key: str, timeout_s: float = 1.0) -> Optional[str]:
    """instance/scheduling/<key> from the GCE metadata server, or None when it does not answer in time (off
    Google Cloud there is no such host); never raises, so no run fails for it."""
    request = urllib.request.Request(METADATA_URL + key, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read().decode(errors="replace").strip()
    except (OSError, ValueError):  # URLError, HTTPError, timeouts, refused connections are all OSErrors
        return None


def preemption_warning(mirror: str, fetch: Callable[[str], Optional[str]] = gce_metadata) -> Optional[str]:
    """A warning when this VM is spot or preemptible (as its metadata server says) and checkpoint.mirror is
    unset, else None: a preempted VM is recreated with a new boot disk, and local checkpoints are gone."""
    spot = not mirror and (fetch("provisioning-model") or "").upper() == "SPOT"
    if mirror or not spot and (fetch("preemptible") or "").upper() != "TRUE":
        return None
    return (f"this is {'a spot' if spot else 'a preemptible'} TPU VM and checkpoint.mirror is unset: a preempted VM "
            "comes back with a new boot disk, so its local checkpoints are lost and the run starts over. Set "
            "`--checkpoint.mirror=gs://BUCKET/PATH` (gcsfs comes with the `tpu` extra) to resume from a copy.")


def recompute(fn: Callable, *args: torch.Tensor) -> torch.Tensor:
    """torch_xla's activation checkpointing (reentrant only), with the barrier that keeps the recompute."""
    from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint

    return xla_checkpoint(fn, *args)


def flash_unavailable_reason(device_type: str, precision: str = "bf16") -> Optional[str]:
    """Why `model.attention: xla_flash` (torch_xla's Pallas flash attention) cannot run here, or None when it can."""
    if device_type != "xla":
        return f"xla_flash needs `runtime.device: xla` on a TPU (this run is on {device_type})"
    pjrt = os.environ.get("PJRT_DEVICE", "").upper()  # set (or checked) by XlaBackend
    if pjrt != "TPU":
        return f"Pallas kernels run only on TPU (PJRT_DEVICE={pjrt or 'unset'})"
    try:
        import jax  # noqa: F401  (Pallas kernels are traced through JAX: the torch_xla[pallas] extra)
        from torch_xla.experimental.custom_kernel import flash_attention  # noqa: F401
    except ImportError as e:
        return f"torch_xla's Pallas kernels are not importable ({e}); install the `tpu` extra"
    return None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    causal_offset: int = 0) -> Optional[torch.Tensor]:
    """q, k, v: B H T D (the kernel wants as many KV heads as query heads) -> B H T D with the Pallas kernel,
    sharded like the batch; None where it does not apply (decoding with a cache: Tq != Tk), and the caller
    (attention.xla_flash) takes sdpa, which XLA lowers natively."""
    if causal_offset or q.shape[2] != k.shape[2]:
        return None
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.custom_kernel import flash_attention as pallas_flash

    mesh = xs.get_global_mesh()
    if mesh is not None and q.shape[0] % mesh.size():
        # The kernel is sharded over the batch: a batch the mesh does not divide (sampling a couple of
        # sequences at the end of a run) would come back padded to a multiple of the mesh size.
        return None
    spec = ("data", None, None, None) if mesh is not None else None
    return pallas_flash(q, k, v, causal=True, sm_scale=1.0 / math.sqrt(q.shape[-1]), partition_spec=spec, mesh=mesh)
