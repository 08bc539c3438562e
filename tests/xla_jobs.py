"""The training runs behind tests/e2e/test_xla_runs.py: mostly XLA compile time on one thread each, so conftest.py
starts them when collection ends, at nice 19, to fill the core the rest of the suite leaves idle; the `runs`
fixture waits for them (and starts them when conftest did not). torch_xla 2.9 runs only beside torch 2.9, so
scripts/xla_venv.sh builds (once, cached outside the repo) a venv with both; tests/xla_driver.py runs there. A venv
that cannot be built fails the tests: only absent hardware may skip, and this needs none (PyPI only)."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from conftest import REPO, small_overrides

from nanopt.data.shards import embedded_shards

VENV_BUILD_TIMEOUT_S = 1800  # cold: ~7 GB of wheels; minutes on a good link
RUN_TIMEOUT_S = 1200  # one process, at nice 19 beside the rest of the suite
DRIVER = str(REPO / "tests" / "xla_driver.py")

# fp32 so XLA and CPU agree to float rounding (measured: within 1e-6); 12 steps of warmup + cosine: a new LR each step.
OVERRIDES = small_overrides(**{
    "train.max_steps": 12, "train.warmup_steps": 3, "train.precision": "fp32", "eval.every": 0,
})
# Interrupted runs: killed in step 6 (after the checkpoint of step 4), resumed on the same or the other device.
RESUME = ["--checkpoint.every=4"]
BF16 = ["--train.precision=bf16"]
# Muon on XLA compiles ~2 graphs per matrix per step for its first two steps (~1 s each here): one layer, 6 steps.
MUON = ["--optim.name=muon", "--model.n_layers=1", "--train.max_steps=6", "--train.warmup_steps=2"]

Step = tuple[list[str], dict, int]  # command, environment, expected exit code


class SetupError(RuntimeError):
    """The torch_xla venv could not be built: the tests fail with this message."""


def venv_env(**env: str) -> dict[str, str]:
    """This environment less any XLA, PJRT or TPU settings, one thread, this checkout on the path, and `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_", "TPU_"))}
    return {**clean, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}


def xla_env(devices: int) -> dict[str, str]:
    return venv_env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices),
                    XLA_FLAGS="--xla_backend_optimization_level=0")  # compiles ~3x faster; the numbers don't change


def phase(device: str, run_dir: Path, args: list[str], python: str, kill_in_step: int = 0,
          sample: bool = False) -> Step:
    """One training process on `device` (xla on 1 device, or cpu), optionally SIGKILLed in step
    `kill_in_step`; `sample`: the XLA run also checks sampling (its own graphs: checked once)."""
    if device == "xla":
        cmd, env = [python, DRIVER, "train" if sample else "train-only", str(run_dir), *args], xla_env(1)
    else:
        cmd = [sys.executable, "-m", "nanopt.main", *args, "--runtime.device=cpu", f"--run.dir={run_dir}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if kill_in_step:
        env = {**env, "NANOPT_TEST_HOOK": f"kill-in-step:{kill_in_step}"}
    return cmd, env, -9 if kill_in_step else 0


def jobs(root: Path, python: str) -> dict[str, list[Step]]:
    """Each job a chain of processes: XLA on 1 device, SPMD on 4 devices (with xla_flash asked for, which must
    fall back on CPU, and a chunked loss), the recompile guard, Muon, interrupted runs resumed on XLA,
    CPU -> XLA (also in bf16: the XLA path in bf16) and XLA -> CPU, and the CPU references."""
    def resumed(name: str, first: str, then: str, *extra: str) -> list[Step]:
        args = [*OVERRIDES, *RESUME, *extra]
        return [phase(first, root / name, args, python, kill_in_step=6), phase(then, root / name, args, python)]

    return {
        # The slowest chains first: they start before the pool is full.
        "xla1-muon": [phase("xla", root / "xla1-muon", [*OVERRIDES, *MUON], python)],
        "xla1": [phase("xla", root / "xla1", OVERRIDES, python, sample=True)],
        # The loss in chunks here (torch_xla's checkpoint, chunks spanning the sharded batch); the CPU
        # reference computes it whole, so matching losses check the chunked path on XLA too.
        "xla4": [([python, DRIVER, "train-only", str(root / "xla4"), *OVERRIDES,
                   "--model.attention=xla_flash", "--train.loss_chunk_tokens=32"], xla_env(4), 0)],
        "xla-xla": resumed("xla-xla", "xla", "xla"),
        "cpu-xla": resumed("cpu-xla", "cpu", "xla"),
        "xla-cpu": resumed("xla-cpu", "xla", "cpu"),
        "cpu-xla-bf16": resumed("cpu-xla-bf16", "cpu", "xla", *BF16),
        "guard": [([python, DRIVER, "guard"], xla_env(1), 0)],
        "score": [([python, DRIVER, "score"], xla_env(1), 0)],
        "cpu": [phase("cpu", root / "cpu", OVERRIDES, python)],
        "cpu-muon": [phase("cpu", root / "cpu-muon", [*OVERRIDES, *MUON], python)],
        "cpu-bf16": [phase("cpu", root / "cpu-bf16", [*OVERRIDES, *BF16], python)],
        # torch 2.9, the floor, whose gloo FSDP2 once summed the ranks' gradients (pytorch#162338): one rank, then
        # fsdp on two, both in this venv on the plain CPU device.
        "torch29-fsdp": [floor_step(python, root / "torch29-one", ranks=1),
                         floor_step(python, root / "torch29-fsdp", ranks=2)],
    }


# Accumulation on both sides: 4 micro-steps on one rank, 2 per rank on two.
FLOOR_ARGS = [*OVERRIDES, "--train.global_batch_tokens=512", "--runtime.device=cpu"]


def floor_step(python: str, run_dir: Path, ranks: int) -> Step:
    """nanopt.main with the venv's torch (2.9) on the plain CPU device: one process, or fsdp under torchrun (gloo)."""
    launch = ["torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m"] if ranks > 1 else []
    fsdp = ["--runtime.parallel=fsdp"] if ranks > 1 else []
    return [python, "-m", *launch, "nanopt.main", *FLOOR_ARGS, *fsdp, f"--run.dir={run_dir}"], venv_env(), 0


class Background:
    """The venv build and every chain, in threads; each process at nice 19 and killed if the session ends first."""

    def __init__(self, workers: int = 4) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="nanopt-xla-tests-"))
        self.workers = workers  # a few at a time: each process finishes sooner, and memory stays bounded
        self.procs: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stopped = False
        self.started = time.perf_counter()
        self.future: Future = ThreadPoolExecutor(max_workers=1).submit(self._all)

    def _run(self, name: str, step: Step, timeout: float = RUN_TIMEOUT_S) -> str:
        """One process's output (stdout and stderr); it must exit as the step expects."""
        cmd, env, expected = step
        with self.lock:
            if self.stopped:
                raise AssertionError(f"{name}: the session ended before it ran")
            proc = subprocess.Popen(["nice", "-n", "19", *cmd], cwd=REPO, text=True, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)
            self.procs.add(proc)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"{name} timed out after {timeout} s:\n{proc.communicate()[0][-4000:]}") from None
        finally:
            with self.lock:
                self.procs.discard(proc)
        assert proc.returncode == expected, f"{name} exited {proc.returncode}, not {expected}:\n{out[-4000:]}"
        return out

    def _chain(self, name: str, steps: list[Step]) -> dict:
        text, result, t0 = "", {}, time.perf_counter()
        for step in steps:
            out = self._run(name, step)
            text += out
            found = [line for line in out.splitlines() if line.startswith("XLA_RESULT ")]
            result = json.loads(found[-1][len("XLA_RESULT "):]) if found else result
        return {"log": text, "seconds": time.perf_counter() - t0, **result}

    def _all(self) -> dict:
        try:  # the venv, built on first use (the session's end kills a build in progress)
            out = self._run("scripts/xla_venv.sh", (["bash", str(REPO / "scripts" / "xla_venv.sh")], None, 0),
                            VENV_BUILD_TIMEOUT_S)
        except AssertionError as e:
            raise SetupError(f"scripts/xla_venv.sh could not build the torch_xla venv ({e})") from None
        venv_s = time.perf_counter() - self.started
        chains = jobs(self.root, str(Path(out.strip().splitlines()[-1]) / "bin" / "python"))  # its last line: the venv
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            futures = {name: pool.submit(self._chain, name, steps) for name, steps in chains.items()}
            out = {"root": self.root, **{name: f.result() for name, f in futures.items()}}
        times = ", ".join(f"{name} {out[name]['seconds']:.0f}" for name in chains)
        print(f"\nxla: venv ready in {venv_s:.0f} s, runs done {time.perf_counter() - self.started:.0f} s after the "
              f"start (per chain, s: {times})", file=sys.stderr)
        return out

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            for proc in self.procs:
                proc.kill()
        self.future.exception()  # wait for the threads to notice
        shutil.rmtree(self.root, ignore_errors=True)


@functools.cache
def start() -> Background:
    """Start the runs (once per session)."""
    embedded_shards("byte")  # the corpus cache, built once here rather than raced for by the runs
    return Background()


def results() -> dict:
    """Every chain's log, seconds and XLA_RESULT fields, and "root" (the run directories); waits for them."""
    return start().future.result()


def stop() -> None:
    if start.cache_info().currsize:
        start().stop()
