"""The CPU peak is measured once per machine and setting, then read from a cache (hardware.cpu_peak): a changed
key measures anew, the highest measurement is kept, an entry is measured again after 10 uses or 7 days, and a
damaged file is ignored with one warning and rewritten. The benchmark is replaced by a list of figures."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import pytest
import torch

from nanopt import hardware
from nanopt.hardware import PEAK_AGE_S, PEAK_CACHE, PEAK_USES, cpu_peak


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("NANOPT_CACHE", str(tmp_path))
    monkeypatch.delenv("NANOPT_MEASURE_PEAK", raising=False)
    return tmp_path / PEAK_CACHE


def bench(*figures: float) -> Callable[[], float]:
    """A benchmark giving `figures` in turn; a call beyond them fails the test (a measurement that should not be)."""
    left = list(figures)
    return lambda: left.pop(0)


def peak(measure: Callable[[], float], **kw: object) -> tuple[float, str]:
    return cpu_peak(kw.pop("dtype", torch.float32), threads=kw.pop("threads", 2), measure=measure, **kw)


def test_measured_once_then_cached_with_its_uses(cache):
    assert peak(bench(5e10)) == (5e10, "measured now")
    entry = next(iter(json.loads(cache.read_text()).values()))
    assert entry["peak"] == 5e10 and entry["uses"] == 0
    value, how = peak(bench())
    assert value == 5e10 and how.startswith("cached (measured ") and how.endswith(", 1 uses)")
    assert peak(bench())[1].endswith(", 2 uses)")


@pytest.mark.parametrize("change, patch", [
    ({"threads": 4}, None), ({"ranks": 2}, None), ({"dtype": torch.bfloat16}, None),
    ({}, ("cpu_model_name", lambda: "Another CPU")), ({}, ("cpu_flags", lambda: "fpu sse avx512f")),
])
def test_a_changed_key_measures_anew(cache, monkeypatch, change, patch):
    peak(bench(5e10))
    with monkeypatch.context() as m:
        if patch:
            m.setattr(hardware, *patch)
        assert peak(bench(7e10), **change) == (7e10, "measured now")
    assert len(json.loads(cache.read_text())) == 2
    assert peak(bench())[0] == 5e10  # the first setting's entry stays


def test_a_new_torch_measures_anew(cache, monkeypatch):
    peak(bench(5e10))
    monkeypatch.setattr(torch, "__version__", "99.0")
    assert peak(bench(6e10)) == (6e10, "measured now")


def test_the_highest_measurement_is_kept(cache, monkeypatch):
    peak(bench(5e10))
    monkeypatch.setenv("NANOPT_MEASURE_PEAK", "1")  # forces a measurement: a busy machine's, lower
    value, how = peak(bench(2e10))
    assert value == 5e10 and how == "measured now (0.020 TFLOP/s; the higher 0.050 measured before is kept)"
    assert peak(bench(8e10)) == (8e10, "measured now")  # a higher one replaces it
    monkeypatch.delenv("NANOPT_MEASURE_PEAK")
    assert peak(bench())[0] == 8e10


def test_measured_again_after_its_uses_or_its_age(cache):
    peak(bench(5e10))
    for _ in range(PEAK_USES):
        assert peak(bench())[1].startswith("cached")
    assert peak(bench(6e10)) == (6e10, "measured now")  # the 11th start measures; the uses start again
    assert peak(bench())[1].endswith(", 1 uses)")
    data = json.loads(cache.read_text())
    for entry in data.values():
        entry["measured_at"] -= PEAK_AGE_S  # a week old
    cache.write_text(json.dumps(data))
    assert peak(bench(4e10)) == (6e10, "measured now (0.040 TFLOP/s; the higher 0.060 measured before is kept)")


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"k": {"peak": "fast", "measured_at": 0, "uses": 0}}',
                                    '{"k": {"peak": 0, "measured_at": 0, "uses": 0}}'])
def test_a_damaged_file_is_ignored_with_one_warning_and_rewritten(cache, caplog, damage):
    cache.write_text(damage)
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        assert peak(bench(5e10)) == (5e10, "measured now")
    assert [r.getMessage() for r in caplog.records] == [
        f"mfu: {cache} is damaged; ignoring it and measuring the CPU peak (the file is rewritten)"]
    assert [e["peak"] for e in json.loads(cache.read_text()).values()] == [5e10]
    caplog.clear()
    assert peak(bench())[1].startswith("cached") and not caplog.records


def test_ranks_agree_and_only_the_main_one_writes(cache):
    peak(bench(5e10), ranks=2)
    # Another rank wants a measurement (say it read the file late): every rank measures, none uses its cache.
    assert peak(bench(6e10), ranks=2, agree=lambda must: True) == (6e10, "measured now")
    assert peak(bench(9e10), ranks=2, agree=lambda must: True, main=False)[0] == 9e10
    assert [e["peak"] for e in json.loads(cache.read_text()).values()] == [6e10]  # not written by a non-main rank


def test_the_real_benchmark_fills_the_cache(cache):
    value, how = cpu_peak(torch.float32)  # measure_matmul_flops, ~0.3 s
    assert value > 1e9 and how == "measured now"
    key = hardware.peak_key(torch.float32, torch.get_num_threads(), 1)
    assert json.loads(cache.read_text())[key]["peak"] == value
    assert hardware.cpu_model_name() in key and torch.__version__ in key
