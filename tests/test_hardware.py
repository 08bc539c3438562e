"""What a CPU is (its kind and whether it computes bf16, from its flags) and its measured matmul peak: measured at
every start (mfu.run_peak), a fraction of a second, so no cache can hold a stale, busy or copied figure."""
from __future__ import annotations

import math

import pytest
import torch

from nanopt.distributed import hardware


def test_the_real_benchmark_gives_a_plausible_peak_within_its_budget():
    value = hardware.measure_matmul_flops(torch.float32, budget_s=hardware.PEAK_BUDGET_S)
    assert math.isfinite(value) and value > 1e9
    assert hardware.cpu_model_name()


@pytest.mark.parametrize("flags,want", [
    ("fpu sse avx avx2 fma", ("AVX2", False)),  # the AVX2-only AMD EPYC: bf16 emulated
    ("avx2 avx512f avx512bw", ("AVX512", False)),
    ("avx2 avx512f avx512_bf16", ("AVX512-BF16", True)),  # the AVX-512 AMD EPYC
    ("avx2 avx512f avx512_bf16 amx_tile amx_bf16", ("AMX", True)),  # the Sapphire Rapids Xeon
    ("fp asimd bf16 i8mm", ("ARM-BF16", True)),  # an Arm core with BF16 (Graviton 3): /proc/cpuinfo's Features
    ("fp asimd", ("other", False)), ("", ("other", False)),
])
def test_the_cpu_kind_and_whether_it_computes_bf16_come_from_its_flags(flags, want):
    assert hardware.cpu_isa(flags) == want
