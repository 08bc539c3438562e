"""The profiler in real runs: off it writes nothing; on, it writes per-rank Chrome traces that the real TensorBoard
PyTorch Profiler plugin serves, and a summary whose shares add up."""
from __future__ import annotations

import contextlib
import io
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import (REPO, free_port, resolved_small_config, small_overrides, stub_runtime, torchrun_started,
                      trace_files)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nanopt.main import run
from nanopt.training import profiling


def test_off_is_a_nullcontext_and_leaves_no_trace(tmp_path):
    prof = profiling.profiler(resolved_small_config(f"--run.dir={tmp_path}"), stub_runtime(world=1))
    assert isinstance(prof, contextlib.nullcontext)
    with prof as entered:
        entered.step()
        assert profiling.label(profiling.FORWARD) is profiling.label(profiling.DATA)  # the shared no-op
    assert run(small_overrides(**{"run.dir": str(tmp_path), "train.max_steps": 2})) == 0  # in-process: faster
    assert (tmp_path / "summary.json").exists()
    assert not (tmp_path / "tb" / "plugins").exists()
    assert not (tmp_path / "profile_summary.json").exists()


@pytest.fixture(scope="module")
def profiled(request, tmp_path_factory) -> SimpleNamespace:
    """A 6-step run with the profiler on (`dir`, its console output `out`): the default 10/5/20 schedule shrinks to
    wait 1, warmup 1, active 4 (steps 3-6). Meanwhile, on the other core and only when
    test_every_listed_rank_writes_its_own_trace is selected, a 3-step torchrun of 2 ranks with profile.ranks=all
    (wait 1, warmup 1, active 1) in `ranks_dir`, `ranks` its CompletedProcess."""
    run_dir, ranks_dir = tmp_path_factory.mktemp("profiled"), tmp_path_factory.mktemp("ranks")
    ranks = any(item.name == "test_every_listed_rank_writes_its_own_trace" for item in request.session.items) and \
        torchrun_started(2, small_overrides(**{"run.dir": str(ranks_dir), "profile.enabled": "true",
                                               "profile.ranks": "all", "train.max_steps": 3}))
    changes = {"run.dir": str(run_dir), "profile.enabled": "true", "profile.memory_snapshot": "true"}
    with contextlib.redirect_stdout(io.StringIO()) as out:  # nanopt logs to stdout
        assert run(small_overrides(**changes)) == 0
    return SimpleNamespace(dir=run_dir, out=out.getvalue(), ranks_dir=ranks_dir, ranks=ranks and ranks())


@pytest.mark.slow
def test_trace_is_chrome_json_in_the_plugin_layout(profiled):
    [trace] = trace_files(profiled.dir)
    assert trace.parent == profiled.dir / "tb" / "plugins" / "profile" / "step_000003"
    assert re.fullmatch(re.escape(socket.gethostname()) + r"_0\.\d+\.pt\.trace\.json", trace.name)
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {profiling.FORWARD, profiling.BACKWARD, profiling.OPTIMIZER, profiling.DATA} <= names
    assert sum(1 for n in names if n and n.startswith("ProfilerStep#")) == 4
    assert any(e.get("ph") == "X" and str(e.get("name", "")).startswith("aten::") for e in events)


def test_summary_shares_add_up_and_go_to_the_console_and_tensorboard(profiled):
    run_dir, output = profiled.dir, profiled.out
    s = json.loads((run_dir / "profile_summary.json").read_text())
    assert (s["first_step"], s["last_step"], s["profiled_steps"]) == (3, 6, 4)
    assert s["schedule"] == {"wait": 1, "warmup": 1, "active": 4}
    assert s["mode"] == "cpu-labels"
    shares = [s["host_overhead_share"], s["data_loader_share"], s["compute_share"]]
    assert all(0.0 <= x <= 1.0 for x in shares)
    assert sum(shares) == pytest.approx(1.0, abs=1e-6)
    # Every share is measured, but how big each is depends on the machine's load: no timing threshold here.
    assert s["compute_share"] > 0.0 and s["data_loader_share"] > 0.0
    # On CPU compute is exactly the time inside the forward/backward/optimizer labels (they never overlap).
    labels = s["label_ms"]
    assert labels["forward"] > 0 and labels["backward"] > 0 and labels["optimizer"] > 0
    compute_ms = labels["forward"] + labels["backward"] + labels["optimizer"]
    assert compute_ms == pytest.approx(s["compute_share"] * s["step_ms_total"], rel=1e-6)
    assert s["step_ms_mean"] == pytest.approx(s["step_ms_total"] / 4)
    top = s["top_ops"]
    assert 0 < len(top) <= 10
    assert [op["self_ms"] for op in top] == sorted((op["self_ms"] for op in top), reverse=True)
    assert all(not op["name"].startswith(("nanopt/", "ProfilerStep")) for op in top)
    assert any(op["name"] in ("aten::mm", "aten::addmm", "aten::bmm") for op in top)
    assert sum(op["self_ms"] for op in top) <= s["step_ms_total"]
    assert s["peak_memory_bytes"] > 0
    assert Path(s["trace_file"]) == trace_files(run_dir)[0]
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    [point] = acc.Scalars("profile/host_overhead_share")
    assert point.step == 6 and point.value == pytest.approx(s["host_overhead_share"], rel=1e-5)
    [text] = acc.Tensors("profile/summary/text_summary")
    assert "host overhead" in text.tensor_proto.string_val[0].decode()
    assert "schedule shrunk from wait/warmup/active 10/5/20 to 1/1/4" in output
    assert re.search(r"profile: steps 3-6 \(4 steps, [\d.]+ ms/step\) \| host overhead [\d.]+%", output)
    assert "profile: top ops by self time: aten::" in output
    assert "memory_snapshot is on but needs a CUDA device" in output  # and skipped off CUDA
    assert not list(run_dir.rglob("*.memory_snapshot.pickle"))


@pytest.mark.slow
def test_tensorboard_profiler_plugin_serves_the_run(profiled):
    port = free_port()
    base = f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler"

    def get(path: str, **query: str) -> object:
        with urllib.request.urlopen(f"{base}/{path}?" + urllib.parse.urlencode(query), timeout=10) as r:
            assert r.status == 200
            return json.loads(r.read())

    with subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(profiled.dir / "tb"), "--host",
                           "127.0.0.1", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, cwd=REPO) as server:
        try:
            runs, deadline = None, time.monotonic() + 90
            while time.monotonic() < deadline and not (runs and runs["runs"] and not runs["loading"]):
                assert server.poll() is None, server.stdout.read()
                with contextlib.suppress(OSError):  # not listening yet
                    runs = get("runs")
                time.sleep(0.5)
            assert runs and runs["runs"] == ["plugins/profile/step_000003"], runs
            q = {"run": runs["runs"][0]}
            assert "Overview" in get("views", **q)
            [worker] = get("workers", **q, view="Overview")
            assert worker == f"{socket.gethostname()}_0"
            [span] = get("spans", **q, worker=worker)
            overview = get("overview", **q, worker=worker, span=span)
            steps = overview["steps"]
            columns = [c.get("name") for c in steps["columns"]]
            assert [c for c in columns if c][0] == "Step" and "CPU Exec" in columns
            # One row per profiled step, in the plugin's own numbering (ProfilerStep#2..#5 = optimizer steps 3..6).
            assert [row[0] for row in steps["rows"]] == ["2", "3", "4", "5"]
            assert all(row[columns.index("CPU Exec")] > 0 for row in steps["rows"])
            assert overview["environments"][1] == {"title": "Device Type", "value": "CPU"}
            assert "performance" in overview and "recommendations" in overview
        finally:
            server.kill()


@pytest.mark.slow
def test_every_listed_rank_writes_its_own_trace(profiled):
    proc = profiled.ranks
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(re.sub(r"\.\d+\.pt\.trace\.json$", "", p.name) for p in trace_files(profiled.ranks_dir))
    assert names == [f"{socket.gethostname()}_{rank}" for rank in (0, 1)]
    for name in ("profile_summary.json", "profile_summary_rank1.json"):
        s = json.loads((profiled.ranks_dir / name).read_text())
        assert sum((s["host_overhead_share"], s["data_loader_share"], s["compute_share"])) == pytest.approx(1.0)
    assert "host overhead" in proc.stdout
