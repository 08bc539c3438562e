"""runtime.py's CPU backend: what it sets up for a CPU process."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from conftest import REPO

# 8 activation-sized tensors (2048 x 344 fp32, 2.8 MB each) made and freed 30 times, as steps do, with minor page
# faults counted before and after. glibc's thresholds move with what the process freed before (imports can raise
# them), so the "before" sets its documented defaults, 128 KiB, explicitly.
FAULTS = """
import ctypes, ctypes.util, resource, torch
from nanopt.runtime import keep_freed_memory

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
