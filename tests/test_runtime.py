"""runtime.py's CPU backend (what it sets up for a CPU process), and every RNG state through a weights-only
checkpoint (a GPU rank's own generator only)."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch
from conftest import CPU, REPO

from nanopt.distributed import runtime

# 8 activation-sized tensors (2048 x 344 fp32, 2.8 MB each) made and freed 30 times, as steps do, with minor page
# faults counted before and after. glibc's thresholds move with what the process freed before (imports can raise
# them), so the "before" sets its documented defaults, 128 KiB, explicitly.
FAULTS = """
import ctypes, ctypes.util, resource, torch
from nanopt.distributed.runtime import keep_freed_memory

mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(30):
        live = [torch.ones(2048, 344) for _ in range(8)]
        del live
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults()
default = faults()
kept = keep_freed_memory()
faults()
print(default, kept, faults())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator knob is glibc's; this system has none")
def test_the_cpu_backend_keeps_freed_activations_instead_of_faulting_them_in_again():
    out = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, cwd=REPO, check=True)
    default, kept, after = out.stdout.split()
    # glibc's defaults hand each freed 2.8 MB block back and fault ~700 fresh pages in for the next one.
    assert int(default) > 30 * 8 * 300, out.stdout
    assert kept == "True" and int(after) < int(default) / 100, out.stdout


# ---------------------------------------------------------------- RNG state in a checkpoint
def test_every_rng_round_trips_through_a_weights_only_checkpoint(tmp_path):
    """Nothing in today's step draws random numbers, so the weights cannot show a lost RNG: check it here."""
    import random

    import numpy as np

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    torch.save({"ranks": [runtime.host_rng_state()]}, tmp_path / "rng.pt")
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    runtime.set_host_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["ranks"][0])
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected


def test_a_gpu_rank_saves_and_restores_only_its_own_generator(monkeypatch):
    """CPU twin of the CUDA RNG round trip: torch.cuda's state calls are replaced by recorders, so what is
    checked is which generator is read and written (the real ones need a GPU); a CPU checkpoint has none."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.tensor([device.index], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append((int(state), device)))
    rank3 = runtime.CudaBackend(torch.device("cuda", 3))
    state = rank3.rng_state()
    assert list(state) == ["cuda"]  # one state, this rank's: not every GPU the node shows
    rank3.set_rng_state(state)
    rank3.set_rng_state({})  # a CPU checkpoint
    assert calls == [(3, torch.device("cuda", 3))]
    runtime.CpuBackend(torch.device("cpu")).set_rng_state(state)  # a GPU checkpoint resumed on CPU: ignored
    assert len(calls) == 1


def test_one_process_reports_its_own_peak_memory_as_the_only_rank():
    allocated, reserved = CPU.peak_memory_by_rank()
    assert len(allocated) == 1 and allocated[0] > 0 and reserved is None  # CPU: resident set, no allocator cache


@pytest.mark.parametrize("isa", [("AVX2", False), ("AVX512-BF16", True)])
def test_the_cpu_backend_names_its_kind_and_keeps_bf16_where_the_cpu_computes_it(isa, monkeypatch):
    """Newton-Schulz's dtype (reduced_dtype) is bf16 only with bf16 hardware; the name says which kind this is,
    for the start line and summary.json's hardware entry."""
    monkeypatch.setattr(runtime, "cpu_isa", lambda: isa)
    backend = runtime.CpuBackend(torch.device("cpu"))
    assert backend.native_bf16 is isa[1]
    assert backend.reduced_dtype == (torch.bfloat16 if isa[1] else torch.float32)
    name = backend.hardware_name()
    assert name.startswith(runtime.cpu_model_name()) and isa[0] in name
    assert ("bf16 native" if isa[1] else "bf16 emulated") in name
    rt = runtime.Runtime("cpu", torch.device("cpu"), 0, 0, 1, 1, "fp32", backend)
    assert rt.reduced_dtype("auto") == backend.reduced_dtype  # optim.muon_dtype: auto is the backend's,
    assert rt.reduced_dtype("bf16") == torch.bfloat16 and rt.reduced_dtype("fp32") == torch.float32  # else as set


@pytest.mark.parametrize("asked,trained,native,want", [
    ("run", "bf16", False, "fp32"),  # a default: fp32 where bf16 would be emulated, said in the log
    ("run", "bf16", True, "bf16"), ("run", "bf16-pure", True, "fp32"), ("run", "fp32", True, "fp32"),
    ("bf16", "fp32", False, "bf16"),  # the user's explicit choice stands
])
def test_an_evaluation_runs_as_the_run_trained_except_in_emulated_bf16(asked, trained, native, want, monkeypatch):
    monkeypatch.setattr(runtime, "cpu_isa", lambda: ("AVX512-BF16", True) if native else ("AVX2", False))
    assert runtime.init_to_evaluate("cpu", asked, trained).precision == want
