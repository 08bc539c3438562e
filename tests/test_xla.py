"""The XLA device path, on torch_xla's CPU device (PJRT_DEVICE=CPU) in its own venv.

torch_xla 2.9 runs only beside torch 2.9, so scripts/xla_venv.sh builds (once, cached outside the repo)
a venv with both and this checkout on its path; tests/xla_driver.py runs there. The reference is the
same config trained by the system torch on the plain CPU device. Cold: ~4 minutes for the venv; warm:
well under a minute of XLA runs. A venv that cannot be built fails the tests (in CI and outside it); they never skip.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, run_module, small_overrides

VENV_BUILD_TIMEOUT_S = 1800  # cold: ~7 GB of wheels; minutes on a good link
RUN_TIMEOUT_S = 600

# fp32 so XLA and CPU agree to float rounding (measured: within 1e-6); 12 steps of warmup + cosine: the LR changes every step.
OVERRIDES = small_overrides(**{
    "train.max_steps": 12, "train.warmup_steps": 3, "train.precision": "fp32", "eval.every": 0,
})


@pytest.fixture(scope="session")
def xla_python() -> Path:
    """The venv's python (built on first use, reused afterwards)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(["bash", str(REPO / "scripts" / "xla_venv.sh")], capture_output=True, text=True,
                              timeout=VENV_BUILD_TIMEOUT_S)
        error = None if proc.returncode == 0 else f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {VENV_BUILD_TIMEOUT_S} s"
    if error is not None:
        # A failure, never a skip: only absent hardware may skip, and this needs none (PyPI access only).
        pytest.fail(f"scripts/xla_venv.sh could not build the torch_xla venv ({error})")
    print(f"\nxla venv ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return Path(proc.stdout.strip().splitlines()[-1]) / "bin" / "python"


def _xla_env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_", "TPU_"))}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), OMP_NUM_THREADS="1",
               XLA_FLAGS="--xla_backend_optimization_level=0",  # compiles ~3x faster; the numbers don't change
               PYTHONPATH=str(REPO))
    return env


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _lrs(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["lr"] for r in rows if "lr" in r]


@pytest.fixture(scope="module")
def runs(xla_python, corpus_dir, tmp_path_factory) -> dict:
    """Every process at once (2 cores, mostly compile time): XLA on 1 device, SPMD on 4 devices (with
    xla_flash asked for, which must fall back on CPU, and a chunked loss), the recompile guard, Muon on 1
    device, and the CPU references."""
    root = tmp_path_factory.mktemp("xla")
    driver = str(REPO / "tests" / "xla_driver.py")
    jobs = {
        "xla1": ([str(xla_python), driver, "train", str(root / "xla1"), *OVERRIDES], _xla_env(1)),
        # The loss in chunks here (torch_xla's checkpoint, chunks spanning the sharded batch); the CPU
        # reference computes it whole, so matching losses check the chunked path on XLA too.
        "xla4": ([str(xla_python), driver, "train", str(root / "xla4"), *OVERRIDES,
                  "--model.attention=xla_flash", "--train.loss_chunk_tokens=32"], _xla_env(4)),
        "guard": ([str(xla_python), driver, "guard"], _xla_env(1)),
        "cpu": ([sys.executable, "-m", "nanopt.main", *OVERRIDES, "--runtime.device=cpu",
                 f"--run.dir={root / 'cpu'}"], {**os.environ, "OMP_NUM_THREADS": "1"}),
        # Muon on XLA (its Newton-Schulz runs partly on the host there: ~1 minute for 12 tiny steps).
        "xla1-muon": ([str(xla_python), driver, "train", str(root / "xla1-muon"), *OVERRIDES, "--optim.name=muon"],
                      _xla_env(1)),
        "cpu-muon": ([sys.executable, "-m", "nanopt.main", *OVERRIDES, "--optim.name=muon", "--runtime.device=cpu",
                      f"--run.dir={root / 'cpu-muon'}"], {**os.environ, "OMP_NUM_THREADS": "1"}),
    }
    t0 = time.perf_counter()
    procs = {name: subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for name, (cmd, env) in jobs.items()}
    out = {"root": root}
    for name, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        assert proc.returncode == 0, f"{name} failed (exit {proc.returncode}):\n{text[-4000:]}"
        results = [line for line in text.splitlines() if line.startswith("XLA_RESULT ")]
        out[name] = {"log": text, **(json.loads(results[-1][len("XLA_RESULT "):]) if results else {})}
    print(f"\nxla runs took {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def test_xla_training_matches_cpu_losses(runs):
    cpu, xla = _losses(runs["root"] / "cpu"), _losses(runs["root"] / "xla1")
    assert len(cpu) == len(xla) == 12
    assert xla == pytest.approx(cpu, abs=5e-5), f"cpu {cpu}\nxla {xla}"
    assert xla[-1] < xla[0] - 0.5  # and it actually trained


def test_xla_training_with_muon_matches_cpu_losses(runs):
    # torch.optim.Muon orthogonalises in bf16 (_zeropower_via_newtonschulz casts the update), and XLA's bf16
    # matmuls round differently from oneDNN's, so the two drift apart by ~1e-3 per step, not fp32's 1e-6.
    cpu, xla = _losses(runs["root"] / "cpu-muon"), _losses(runs["root"] / "xla1-muon")
    assert len(cpu) == len(xla) == 12
    assert xla == pytest.approx(cpu, abs=2e-2), f"cpu {cpu}\nxla {xla}"
    assert xla[-1] < xla[0] - 0.5 and cpu != _losses(runs["root"] / "cpu")  # it trained, and with Muon, not AdamW


def test_train_step_compiles_twice_then_reuses_while_lr_changes(runs):
    lrs = _lrs(runs["root"] / "xla1")
    assert len(set(lrs)) >= 10, lrs  # a new learning rate nearly every step...
    r = runs["xla1"]
    assert r["step_calls"] == 12
    assert r["step_compiles"] == 2, r  # ...yet only step 0 (optimizer state init) and step 1 compiled
    assert r["recompiles"] == 0
    assert r["hardware"] == "XLA CPU"


def test_spmd_over_four_devices_matches_cpu(runs):
    r = runs["xla4"]
    assert r["num_devices"] == 4
    assert "SPMD over 4 CPU device(s)" in r["log"]
    assert _losses(runs["root"] / "xla4") == pytest.approx(_losses(runs["root"] / "cpu"), abs=5e-5)
    assert r["step_compiles"] == 2 and r["recompiles"] == 0


def test_xla_flash_falls_back_to_sdpa_off_tpu_with_the_reason(runs):
    log = runs["xla4"]["log"]
    assert "xla_flash requested but Pallas kernels run only on TPU (PJRT_DEVICE=CPU)" in log
    assert "attention sdpa" in log


def test_sampling_on_xla_does_not_recompile_per_token(runs):
    r = runs["xla1"]
    first, second = r["sample_compiles"]
    assert first <= 1, r  # 12 tokens, one graph
    assert second == 0, r  # another prompt length in the same bucket reuses it
    assert r["sample_matches_cpu"] == [True, True]  # greedy tokens equal the CPU KV-cache sampler's


def test_recompile_guard_stops_a_run_that_keeps_recompiling(runs):
    r = runs["guard"]
    assert r["stopped"], r
    assert r["calls_before_stop"] == 2 + r["limit"]  # two warm-up compilations, then `limit` tolerated
    assert "recompiled" in r["message"] and "PT_XLA_DEBUG_LEVEL" in r["message"]


# ---- without the venv: the errors a user sees before torch_xla is ever imported


def test_xla_without_pjrt_device_is_a_clean_error():
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    proc = run_module(["nanopt.main", *small_overrides(), "--runtime.device=xla"], env=env)
    if any(Path("/dev").glob("accel*")):
        pytest.skip("a TPU is visible here: PJRT_DEVICE defaults to TPU with a warning instead")
    assert proc.returncode == 2, proc.stderr
    assert "PJRT_DEVICE" in proc.stderr and "Traceback" not in proc.stderr


def test_xla_without_torch_xla_is_a_clean_error(tmp_path):
    # A stand-in package that fails to import, first on the path: the test runs whether or not this
    # interpreter has the real torch_xla.
    (tmp_path / "torch_xla").mkdir()
    (tmp_path / "torch_xla" / "__init__.py").write_text("raise ImportError('No module named torch_xla (hidden)')\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = run_module(["nanopt.main", *small_overrides(), "--runtime.device=xla"],
                      env={"PJRT_DEVICE": "CPU", "PYTHONPATH": path})
    assert proc.returncode == 2, proc.stderr
    assert 'pip install -e ".[tpu]"' in proc.stderr and "Traceback" not in proc.stderr


def test_xla_flash_off_xla_falls_back_to_sdpa_with_the_reason(caplog):
    from nanopt.attention import choose, sdpa

    with caplog.at_level("WARNING", logger="nanopt"):
        name, kernel = choose("xla_flash", "cpu")
    assert (name, kernel) == ("sdpa", sdpa)
    assert "xla_flash requested but xla_flash needs `runtime.device: xla`" in caplog.text
