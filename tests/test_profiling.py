"""The profiler's pieces (nanopt/training/profiling.py): its schedule, the top ops, bad keys, the no-op profiler and a
window cut short. Profiled runs: e2e/test_profiled_run.py."""
from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import resolved_small_config, stub_runtime, trace_files
from torch.autograd import DeviceType

from nanopt.config import ConfigError
from nanopt.training import profiling


def test_schedule_is_kept_when_it_fits_and_shrunk_to_the_run_otherwise():
    # A short run keeps one skipped step and one warmup step, and records the rest.
    assert [profiling.fit_schedule(10, 5, 20, n) for n in (100, 35, 6)] == [(10, 5, 20), (10, 5, 20), (1, 1, 4)]
    for steps in range(1, 40):
        wait, warmup, active = profiling.fit_schedule(10, 5, 20, steps)
        assert active >= 1 and wait + warmup + active <= steps
    assert profiling.fit_schedule(10, 5, 20, 1) == (0, 0, 1) and profiling.fit_schedule(0, 0, 3, 2) == (0, 0, 2)


def test_top_ops_leave_out_command_buffer_full_which_counts_its_kernels_twice():
    """An H100 profile's rows (bench/results/gpu_check_h100_shipped.json): "Command Buffer Full" was credited with
    the device time of kernels that aten::mm already counts, and the shares added up to 128%."""

    def op(name: str, device_us: float, device=DeviceType.CPU, annotation=False):
        return SimpleNamespace(key=name, device_type=device, is_user_annotation=annotation,
                               self_device_time_total=device_us, self_cpu_time_total=5.0)

    events = [op("aten::mm", 630), op("Command Buffer Full", 390), op("aten::_cudnn_attention_backward", 140),
              op(profiling.FORWARD, 900, annotation=True), op("sm90_gemm_kernel", 630, device=DeviceType.CUDA),
              op("aten::mm", 0)]
    top = profiling.top_ops(events, device_mode=True, total_us=1000)
    assert [(o["name"], o["calls"], o["self_share"]) for o in top] == [("aten::mm", 2, 0.63),
                                                                      ("aten::_cudnn_attention_backward", 1, 0.14)]
    assert sum(o["self_share"] for o in top) <= 1


def test_bad_profile_keys_are_config_errors_and_an_unlisted_rank_and_xla_get_the_no_op_profiler(caplog):
    for bad in ("--profile.ranks=first", "--profile.active=0", "--profile.wait=-1",
                "--profile.record_shape=true"):  # the last: an unknown key (a typo) stays an error
        with pytest.raises(ConfigError, match=bad[2:].split("=")[0]):
            resolved_small_config(bad)
    cfg = resolved_small_config("--profile.enabled=true", "--profile.ranks=0,3")
    with pytest.raises(ConfigError, match="2 rank"):
        profiling.profiler(cfg, stub_runtime(world=2))
    cfg = resolved_small_config("--profile.enabled=true", "--profile.ranks=1")
    assert isinstance(profiling.profiler(cfg, stub_runtime(rank=0)), profiling.Off)
    assert isinstance(profiling.profiler(cfg, stub_runtime(rank=1)), profiling.Profile)
    cfg = resolved_small_config("--profile.enabled=true", "--profile.ranks=all")
    with caplog.at_level("WARNING", logger="nanopt"):
        assert isinstance(profiling.profiler(cfg, stub_runtime(kind="xla")), profiling.Off)
    assert "does not support xla" in caplog.text and "torch_xla.debug.profiler" in caplog.text


def test_a_window_cut_short_is_still_written_and_counts_only_whole_steps(tmp_path, capfd):
    """The run ends (target reached, preemption) while recording: stop() still saves and summarises; kineto's
    start and stop markers stay off stderr."""
    cfg = resolved_small_config(f"--run.dir={tmp_path}", "--profile.enabled=true", "--train.max_steps=10")
    prof = profiling.profiler(cfg, stub_runtime(world=1))
    assert (prof.wait, prof.warmup, prof.active) == (2, 1, 7)  # 10/5/20 shrunk to 10 steps
    layer = torch.nn.Linear(16, 16)
    with prof:
        for _ in range(5):  # steps 1-2 wait, 3 warmup, 4-5 recorded, then the run "ends"
            with profiling.label(profiling.DATA):
                x = torch.randn(8, 16)
            with profiling.label(profiling.FORWARD):
                loss = layer(x).square().mean()
            with profiling.label(profiling.BACKWARD):
                loss.backward()
            prof.step()
        with torch.profiler.record_function("after_the_last_step"):  # not a step: must not be counted as one
            time.sleep(0.05)
    s = json.loads((tmp_path / "profile_summary.json").read_text())
    assert (s["first_step"], s["last_step"], s["profiled_steps"]) == (4, 5, 2)
    events = json.loads(trace_files(tmp_path)[0].read_text())["traceEvents"]
    steps = sorted((e["ts"], e["dur"]) for e in events if e.get("name", "").startswith("ProfilerStep#"))
    [tail] = [e for e in events if e.get("name") == "after_the_last_step"]
    assert len(steps) == 3 and steps[-1][0] <= tail["ts"]  # the range cut at stop() holds the tail
    assert s["step_ms_total"] == pytest.approx(sum(dur for _, dur in steps[:2]) / 1e3, rel=1e-3)
    assert sum((s["host_overhead_share"], s["data_loader_share"], s["compute_share"])) == pytest.approx(1.0)
    assert len(trace_files(tmp_path)) == 1 and not profiling._active and "USDT" not in capfd.readouterr().err


def test_kineto_markers_are_dropped_and_everything_else_on_stderr_kept(tmp_path, capfd):
    marker = b"USDT:2026-11-27 02:01:20 8297:8297 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    for _ in range(2):  # each block's own: nothing is written back twice
        with profiling.kineto_markers_dropped():
            os.write(2, b"before\n" + marker + marker.replace(b"start", b"stop"))
            os.write(2, b"ERROR:2026-11-27 kineto's own error\nUSDT: profiler_start is a word here\n")
    kept = "before\nERROR:2026-11-27 kineto's own error\nUSDT: profiler_start is a word here\n"
    assert capfd.readouterr().err == 2 * kept
