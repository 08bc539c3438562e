"""The XLA device path, on torch_xla's CPU device (PJRT_DEVICE=CPU) in its own venv (tests/xla_jobs.py), against the
same config trained by the system torch on the plain CPU device, and the errors a user sees without it. A venv that
cannot be built fails the tests (in CI and outside it); they never skip."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import xla_jobs
from conftest import run_module, small_overrides

from nanopt.distributed import xla

pytestmark = pytest.mark.slow  # every test here trains or launches processes


def _logged(run_dir: Path, *keys: str) -> list:
    """`keys` (loss by default) of every metrics.jsonl record that has the first: values, or tuples of several."""
    keys = keys or ("loss",)
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if keys[0] in r]
    return [r[keys[0]] if len(keys) == 1 else tuple(r[k] for k in keys) for r in rows]


@pytest.fixture(scope="module")
def runs() -> dict:
    """The XLA and CPU runs of tests/xla_jobs.py (started in the background when the session was collected)."""
    try:
        return xla_jobs.results()
    except xla_jobs.SetupError as e:
        pytest.fail(str(e))


def test_xla_training_matches_cpu_losses_compiling_twice_with_foreach_adamw(runs):
    cpu, xla = _logged(runs["root"] / "cpu"), _logged(runs["root"] / "xla1")
    assert len(cpu) == len(xla) == 12
    assert xla == pytest.approx(cpu, abs=5e-5), f"cpu {cpu}\nxla {xla}"
    assert xla[-1] < xla[0] - 0.5  # and it actually trained
    lrs = _logged(runs["root"] / "xla1", "lr")
    assert len(set(lrs)) >= 10, lrs  # a new learning rate nearly every step...
    r = runs["xla1"]
    assert r["step_calls"] == 12
    assert r["step_compiles"] == 2, r  # ...yet only step 0 (optimizer state init) and step 1 compiled
    assert r["recompiles"] == 0
    assert r["hardware"] == "XLA CPU"
    # torch picks foreach only on CUDA-like devices; the XLA backend asks for it (one traced op per tensor
    # list, not a Python loop over parameters), and the run still matches the CPU one.
    assert r["adamw_foreach"] is True


def test_xla_training_with_muon_matches_cpu_losses(runs):
    # torch.optim.Muon orthogonalises in bf16 (_zeropower_via_newtonschulz casts the update), and XLA's bf16
    # matmuls round differently from oneDNN's, so the two drift apart by ~1e-3 per step, not fp32's 1e-6.
    cpu, xla = _logged(runs["root"] / "cpu-muon"), _logged(runs["root"] / "xla1-muon")
    assert len(cpu) == len(xla) == 6
    assert xla == pytest.approx(cpu, abs=2e-2), f"cpu {cpu}\nxla {xla}"
    assert xla[-1] < xla[0] - 0.3 and cpu[0] != _logged(runs["root"] / "cpu")[0]  # it trained, with Muon, one layer


def test_an_interrupted_xla_run_resumes_bitwise_on_xla(runs):
    assert _logged(runs["root"] / "xla-xla") == _logged(runs["root"] / "xla1")
    r = runs["xla-xla"]
    assert "resuming from" in r["log"] and "step_000004" in r["log"]
    assert r["step_calls"] == 8 and r["step_compiles"] == 2 and r["recompiles"] == 0  # steps 5..12, one graph


@pytest.mark.parametrize("name, reference, tolerance", [
    ("cpu-xla", "cpu", 5e-5), ("xla-cpu", "cpu", 5e-5),
    # bf16 autocast on both: XLA's and oneDNN's bf16 matmuls round differently (measured: within 2e-3). Steps 5-12
    # ran on XLA (resumed from a CPU checkpoint), so they are the XLA path in bf16.
    ("cpu-xla-bf16", "cpu-bf16", 1e-2)])
def test_a_run_resumes_on_the_other_device_type(runs, name, reference, tolerance):
    # runtime.* may change on resume: the optimizer's implementation (fused on CPU, foreach on XLA) comes
    # from the new run, its moments and step counts from the checkpoint.
    got, want = _logged(runs["root"] / name), _logged(runs["root"] / reference)
    assert len(got) == len(want) == 12
    assert got == pytest.approx(want, abs=tolerance), f"{reference} {want}\n{name} {got}"
    assert got[-1] < got[0] - 0.5  # it trained
    assert "resuming from" in runs[name]["log"] and "step_000004" in runs[name]["log"]
    if name.startswith("cpu-xla"):
        assert runs[name]["step_compiles"] == 2 and runs[name]["recompiles"] == 0
    if name == "cpu-xla-bf16":  # and in bf16
        assert runs[name]["precision"] == "bf16" and want != _logged(runs["root"] / "cpu")


def test_spmd_over_four_devices_matches_cpu_and_xla_flash_falls_back_to_sdpa_off_tpu(runs):
    r = runs["xla4"]
    assert r["num_devices"] == 4
    assert "SPMD over 4 CPU device(s)" in r["log"]
    assert _logged(runs["root"] / "xla4") == pytest.approx(_logged(runs["root"] / "cpu"), abs=5e-5)
    assert r["step_compiles"] == 2 and r["recompiles"] == 0
    assert "xla_flash requested but Pallas kernels run only on TPU (PJRT_DEVICE=CPU)" in r["log"]
    assert "attention sdpa" in r["log"]


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


def test_downstream_scoring_on_xla_equals_the_host(runs):
    """lm-eval's `nanopt` model on XLA: the same log-likelihoods and greedy flags as on the host, in a few
    compiled shapes (lengths padded to power-of-two buckets), and the same greedy generation."""
    r = runs["score"]
    assert r["max_abs"] < 1e-4 and r["greedy_equal"] and r["generate_equal"], r
    assert r["compiles"] < r["requests"] // 2, r  # buckets, not one graph per request


# ---- without the venv: the errors a user sees before torch_xla is ever imported


@pytest.mark.parametrize("hide_torch_xla, words", [(False, "PJRT_DEVICE"), (True, 'pip install -e ".[tpu]"')])
def test_xla_without_pjrt_device_or_torch_xla_is_a_clean_error(tmp_path, monkeypatch, hide_torch_xla, words):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    if hide_torch_xla:  # a stand-in that fails to import, first on the path, whether or not torch_xla is here
        (tmp_path / "torch_xla").mkdir()
        (tmp_path / "torch_xla" / "__init__.py").write_text("raise ImportError('No module named torch_xla (hidden)')\n")
        monkeypatch.setenv("PJRT_DEVICE", "CPU")
        path = os.environ.get("PYTHONPATH")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), path]) if path else str(tmp_path))
    elif xla.tpu_attached():
        pytest.skip("a TPU is visible here: PJRT_DEVICE defaults to TPU with a warning instead")
    proc = run_module(["nanopt.main", *small_overrides(), "--runtime.device=xla"])
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr


def test_fsdp_on_the_torch_floor_averages_the_ranks_gradients(runs):
    """torch 2.9 (the floor, in the XLA venv), fsdp on 2 gloo ranks with accumulation equals one rank: gloo's
    FSDP2 once summed the ranks' gradients instead of averaging them (pytorch#162338), which would double the
    logged grad norm from step 1. nanopt also forces SUM reductions plus FSDP2's division under gloo."""
    one, two = (_logged(runs["root"] / name, "loss", "grad_norm") for name in ("torch29-one", "torch29-fsdp"))
    assert len(one) == len(two) == 12
    for (loss_a, norm_a), (loss_b, norm_b) in zip(one, two):
        assert abs(loss_a - loss_b) < 1e-5 and abs(norm_a - norm_b) < 5e-5 * norm_a, (one, two)
    assert "2 ranks x 2 accum" in runs["torch29-fsdp"]["log"]  # scripts/xla_venv.sh pins torch==2.9.*
