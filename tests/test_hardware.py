"""The CPU peak is measured once per machine and setting, then read from a cache (hardware.cpu_peak): a changed
key measures anew, the highest measurement is kept, an entry is measured again after 10 uses or 7 days, a
damaged file or entry is ignored with one warning and rewritten, and a cached peak more than 4x off a quick
measurement is measured again. The benchmark is replaced by a list of figures."""
from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from nanopt import hardware
from nanopt.hardware import CHECK_BUDGET_S, PEAK_AGE_S, PEAK_BUDGET_S, PEAK_CACHE, PEAK_USES, cpu_peak, peak_key


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("NANOPT_CACHE", str(tmp_path))
    monkeypatch.delenv("NANOPT_MEASURE_PEAK", raising=False)
    return tmp_path / PEAK_CACHE


class bench:
    """A benchmark giving `figures` in turn for full measurements (one beyond them fails the test: a measurement
    that should not be) and `quick` for the quick check of a cached peak; `budgets` records each call's budget."""

    def __init__(self, *figures: float, quick: float = 5e10):
        self.left, self.quick, self.budgets = list(figures), quick, []

    def __call__(self, budget_s: float) -> float:
        self.budgets.append(budget_s)
        return self.quick if budget_s == CHECK_BUDGET_S else self.left.pop(0)


def peak(measure: Callable[[float], float], dtype: torch.dtype = torch.float32, threads: int = 2, ranks: int = 1,
         **kw: object) -> tuple[float, str]:
    return cpu_peak(peak_key(dtype, threads, ranks), measure, **kw)


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


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]"])
def test_a_damaged_file_is_ignored_with_one_warning_and_rewritten(cache, caplog, damage):
    cache.write_text(damage)
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        assert peak(bench(5e10)) == (5e10, "measured now")
    assert [r.getMessage() for r in caplog.records] == [
        f"mfu: {cache} is damaged (not a JSON object of entries); ignoring it and measuring the CPU peak (the file "
        f"is rewritten)"]
    assert [e["peak"] for e in json.loads(cache.read_text()).values()] == [5e10]
    caplog.clear()
    assert peak(bench())[1].startswith("cached") and not caplog.records


# What the review wrote into the file (and more): each entry field's nonsense, as JSON text.
DAY = 24 * 3600
POISON = {
    "peak 1e300": ("peak", "1e300"), "peak 1e3": ("peak", "1e3"), "peak inf": ("peak", "Infinity"),
    "peak 1e400 (inf)": ("peak", "1e400"), "peak NaN": ("peak", "NaN"), "peak 0": ("peak", "0"),
    "peak -5e10": ("peak", "-5e10"), "peak a string": ("peak", '"fast"'), "peak true": ("peak", "true"),
    "measured in 2 days": ("measured_at", lambda now: repr(now + 2 * DAY)), "measured in 1e300 s": ("measured_at", "1e300"),
    "measured_at NaN": ("measured_at", "NaN"), "measured_at -1": ("measured_at", "-1"),
    "measured_at inf": ("measured_at", "Infinity"), "uses -1e18": ("uses", "-1000000000000000000"),
    "uses 2.5": ("uses", "2.5"), "uses NaN": ("uses", "NaN"), "an entry that is a list": (None, "[1, 2]"),
}


def _poison(cache: Path, field: str | None, text: str | Callable[[float], str]) -> str:
    """The cache's one entry with `field` set to the JSON `text` (or text(now)); its key."""
    ((key, entry),) = json.loads(cache.read_text()).items()
    value = text(time.time()) if callable(text) else text
    body = value if field is None else "{" + ", ".join(
        f'"{k}": {value if k == field else json.dumps(v)}' for k, v in entry.items()) + "}"
    cache.write_text("{" + json.dumps(key) + ": " + body + "}")
    return key


@pytest.mark.parametrize("poison", POISON)
def test_a_poisoned_entry_is_measured_again_with_a_warning_never_a_traceback(cache, caplog, poison):
    peak(bench(5e10))
    key = _poison(cache, *POISON[poison])
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        value, how = peak(bench(6e10, quick=6e10))
    assert (value, how) == (6e10, "measured now")  # the poisoned figure is neither used nor kept as "higher"
    (message,) = [r.getMessage() for r in caplog.records]
    assert str(cache) in message and "measuring" in message and "rewritten" in message
    entry = json.loads(cache.read_text())[key]
    assert entry["peak"] == 6e10 and entry["uses"] == 0 and abs(entry["measured_at"] - time.time()) < 60
    caplog.clear()
    assert peak(bench())[1].startswith("cached") and not caplog.records  # repaired: read as usual
    if POISON[poison][0] == "peak":
        assert "not a finite positive FLOP/s" in message or "4x off a quick measurement" in message


@pytest.mark.parametrize("cached, quick", [(1e300, 1.74e11), (1e3, 1.74e11), (5e10, 2.1e11), (5e10, 1.2e10)])
def test_a_cached_peak_more_than_4x_off_a_quick_measurement_is_measured_again(cache, caplog, cached, quick):
    key = peak_key(torch.float32, 2, 1)
    cache.write_text(json.dumps({key: {"peak": cached, "measured_at": time.time() - 60, "uses": 1}}))
    measure = bench(1.74e11, quick=quick)
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        assert peak(measure) == (1.74e11, "measured now")
    assert measure.budgets == [CHECK_BUDGET_S, PEAK_BUDGET_S]
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"mfu: the CPU peak in {cache} (") and "more than 4x off a quick measurement" in message
    assert json.loads(cache.read_text())[key]["peak"] == 1.74e11


def test_a_cached_peak_within_4x_of_the_quick_measurement_is_used_after_one_quick_check(cache):
    peak(bench(5e10))
    for quick in (1.3e10, 1.9e11):  # a busy machine's quick figure, or a lucky one: within 4x either way
        measure = bench(quick=quick)
        assert peak(measure)[0] == 5e10 and measure.budgets == [CHECK_BUDGET_S]


def test_a_quick_check_that_reads_a_busy_machine_keeps_a_plausible_higher_peak(cache):
    peak(bench(5e10))
    # The quick figure is more than 4x low (the machine was busy), so the peak is measured again; that full
    # measurement is within 4x of the cached one, which is this machine's after all: the higher is kept.
    value, how = peak(bench(2e10, quick=1e10))
    assert value == 5e10 and how.startswith("measured now (0.020 TFLOP/s; the higher 0.050")


def test_ranks_agree_and_only_the_main_one_writes(cache, caplog):
    peak(bench(5e10), ranks=2)
    # Another rank wants a measurement (say it read the file late): every rank measures, none uses its cache.
    assert peak(bench(6e10), ranks=2, agree=lambda must: True) == (6e10, "measured now")
    assert peak(bench(9e10), ranks=2, agree=lambda must: True, main=False)[0] == 9e10
    assert [e["peak"] for e in json.loads(cache.read_text()).values()] == [6e10]  # not written by a non-main rank
    # A poisoned entry: a non-main rank measures with the others but leaves the warning to the main one.
    _poison(cache, "peak", "1e300")
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        assert peak(bench(7e10), ranks=2, main=False) == (7e10, "measured now")
    assert not caplog.records


def test_the_real_benchmark_fills_the_cache_and_its_quick_check_agrees(cache, caplog):
    key = peak_key(torch.float32, None, 1)
    measure = lambda budget_s: hardware.measure_matmul_flops(torch.float32, budget_s=budget_s)  # noqa: E731
    value, how = cpu_peak(key, measure)  # ~0.3 s
    assert value > 1e9 and how == "measured now"
    assert json.loads(cache.read_text())[key]["peak"] == value
    assert hardware.cpu_model_name() in key and torch.__version__ in key
    # The review's poisoned file: 1e300 FLOP/s, measured in the future. Replaced by a measured, plausible peak.
    cache.write_text(json.dumps({key: {"peak": 1e300, "measured_at": time.time() + 1e9, "uses": 0}}))
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        again, how = cpu_peak(key, measure)
    assert how == "measured now" and math.isfinite(again) and value / 4 <= again <= value * 4
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    t0 = time.perf_counter()
    cpu_peak(key, measure)  # the quick check of a cached peak: a fraction of a second
    assert time.perf_counter() - t0 < 1.5


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
