"""`nanopt sweep` of real training processes on CPU: a 2x2 grid finishes and a re-run skips it, a killed sweep
resumes without redoing finished runs, SIGTERM stops it resumably, a run outlives its killed sweep only to
checkpoint, and a failing run is reported while the others finish."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

import pytest
import yaml
from conftest import TINY_CONFIG, small_overrides

from nanopt.lab import sweep

# ---------------------------------------------------------------- real sweeps
def _sweep_cmd(root: Path, *args: str, device: str = "cpu", **small: object) -> list[str]:
    return [sys.executable, "-m", "nanopt.cli", "sweep", TINY_CONFIG, "--dir", str(root), *args,
            *small_overrides(**{"train.max_steps": 4, "runtime.device": device, **small})]


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300)


def _sessions(run_dir: Path) -> int:
    """How many times the sweep started this run (each start writes a header line to its stdout.log)."""
    log = run_dir / sweep.LOG_FILE
    return log.read_text().count("=== nanopt sweep") if log.exists() else 0


@pytest.mark.slow
def test_a_2x2_sweep_finishes_and_a_rerun_skips_it(sweeps):
    started = sweeps["test_a_2x2_sweep_finishes_and_a_rerun_skips_it"]
    root = started.root
    code, out, err = started.ended()
    assert code == 0, out + err
    dirs = sorted(p for p in root.iterdir() if p.is_dir())
    assert [d.name for d in dirs] == ["train.lr=1e-3,seed=1337", "train.lr=1e-3,seed=1338",
                                      "train.lr=2e-3,seed=1337", "train.lr=2e-3,seed=1338"]
    seen = set()
    for d in dirs:
        assert json.loads((d / "summary.json").read_text())["steps"] == 4
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        seen.add((cfg["train"]["lr"], cfg["run"]["seed"]))
        assert cfg["run"]["dir"] == str(d)
    assert seen == {(1e-3, 1337), (1e-3, 1338), (2e-3, 1337), (2e-3, 1338)}
    meta = json.loads((root / "sweep.json").read_text())
    assert meta["set"] == {"train.lr": ["1e-3", "2e-3"]} and meta["seeds"] == [1337, 1338]
    assert [p["status"] for p in meta["points"]] == ["done"] * 4
    assert meta["points"][0]["values"] == {"train.lr": "1e-3"} and meta["points"][0]["seed"] == 1337
    assert "2 at a time (cpu: 1 thread)" in out  # 2 cores: 2 single-thread runs
    assert "final val loss" in out and out.count("  done ") >= 4

    mtimes = {d: (d / "summary.json").stat().st_mtime_ns for d in dirs}
    again = _run(started.cmd, root.parent)
    assert again.returncode == 0, again.stdout + again.stderr
    # Nothing to run: no device discovery (no "N at a time"), no training, each point skipped
    assert "4 already done, 0 to run\n" in again.stdout and again.stdout.count("skipped") == 4
    assert all(_sessions(d) == 1 for d in dirs)
    assert {d: (d / "summary.json").stat().st_mtime_ns for d in dirs} == mtimes


@dataclass
class Started:
    """A sweep started in the background, its output going to files (which never fill up as an unread pipe does)."""
    proc: subprocess.Popen
    root: Path  # its sweep directory
    cmd: list[str]
    out: IO[str]
    err: IO[str]

    def ended(self, timeout: float = 300) -> tuple[int, str, str]:
        self.proc.wait(timeout=timeout)
        return (self.proc.returncode, *self.output())

    def output(self) -> tuple[str, str]:
        self.out.seek(0), self.err.seek(0)
        return self.out.read(), self.err.read()


def _killed_sweep(root: Path) -> list[str]:
    # The 5-step run checkpoints at step 2, then waits after step 3 (test hook) until the whole sweep is killed.
    cmd = _sweep_cmd(root, "--set", "train.max_steps=2,5", "--parallel", "2", **{"checkpoint.every": 2})
    return [a for a in cmd if a != "--train.max_steps=4"]


def _paused_sweep(root: Path) -> list[str]:
    # Two seeds, one run at a time; the first run waits after step 3 (test hook) for a signal.
    return _sweep_cmd(root, "--seeds", "2", "--parallel", "1", **{"train.max_steps": 5})


# test name -> (its sweep's command, the test hook, a session of its own)
STARTED_TOGETHER = {
    # runtime.device=auto: the device is discovered as the runs will see it (CPU here)
    "test_a_2x2_sweep_finishes_and_a_rerun_skips_it":
        (lambda root: _sweep_cmd(root, "--set", "train.lr=1e-3,2e-3", "--seeds", "2", device="auto"), "", False),
    "test_a_killed_sweep_resumes_and_does_not_redo_finished_runs": (_killed_sweep, "pause:3", True),
    "test_sigterm_stops_the_sweep_with_every_run_checkpointed": (_paused_sweep, "pause:3", False),
    "test_a_run_outlives_its_killed_sweep_only_to_checkpoint": (_paused_sweep, "pause:3", False),
    "test_a_failing_run_is_reported_and_the_others_finish":
        (lambda root: _sweep_cmd(root, "--set", "data.source=embedded,/nonexistent/shards"), "", False),
}


@pytest.fixture(scope="module")
def sweeps(request, tmp_path_factory) -> Iterator[dict[str, Started]]:
    """The sweeps of the tests in STARTED_TOGETHER (those selected), all started when the first of those tests asks:
    their runs (ten, a process each, three of which then wait for a signal) start side by side on the 2 cores
    instead of one test after another, each test then acting on and asserting about its own sweep."""
    selected = {item.name for item in request.session.items if item.path == request.path}
    started = {}
    for test, (sweep_for, hook, own_session) in STARTED_TOGETHER.items():
        if test in selected:
            cwd = tmp_path_factory.mktemp("sweep")
            cmd, out, err = sweep_for(cwd / "sw"), tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, text=True, start_new_session=own_session,
                                    env={**os.environ, **({"NANOPT_TEST_HOOK": hook} if hook else {})})
            started[test] = Started(proc, cwd / "sw", cmd, out, err)
    yield started
    for each in started.values():
        if each.proc.poll() is None:  # a sweep its test did not end (-x after a failure): its runs get SIGTERM
            each.proc.kill()
            each.proc.wait()
        each.out.close(), each.err.close()


def _wait_for(paths: list[Path], started: Started, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if started.proc.poll() is not None:
            out, err = started.output()
            pytest.fail(f"the sweep ended (exit {started.proc.returncode}) before {paths} appeared:\n{out}\n{err}")
        assert time.monotonic() < deadline, f"timed out waiting for {paths}"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc: Linux)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _wait_gone(pids: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, f"processes {pids} were not reaped"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_killed_sweep_resumes_and_does_not_redo_finished_runs(sweeps):
    started = sweeps["test_a_killed_sweep_resumes_and_does_not_redo_finished_runs"]
    proc, root = started.proc, started.root
    short, long = root / "train.max_steps=2,seed=1337", root / "train.max_steps=5,seed=1337"
    try:
        _wait_for([short / "summary.json", long / ".test_paused.rank0"], started)
    finally:
        # The sweep and every run it started, no chance to clean up. Each run has its own session (a terminal's
        # Ctrl-C reaches only the sweep), so the sweep's process group is the sweep alone: the runs go first.
        runs = _children(proc.pid)
        for pid in runs:
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _wait_gone(runs)  # reaped, so the runs' lock files name dead processes (a zombie's pid still answers)
    assert not (long / "summary.json").exists() and (long / "checkpoints" / "latest").exists()
    short_mtime = (short / "summary.json").stat().st_mtime_ns

    again = _run(started.cmd, root.parent)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "1 already done, 1 to run" in again.stdout
    assert _sessions(short) == 1 and (short / "summary.json").stat().st_mtime_ns == short_mtime
    assert _sessions(long) == 2 and "resuming from" in (long / sweep.LOG_FILE).read_text()
    assert json.loads((long / "summary.json").read_text())["steps"] == 5
    records = [json.loads(line) for line in (long / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]  # step 3 again from the step-2 checkpoint


@pytest.mark.slow
def test_sigterm_stops_the_sweep_with_every_run_checkpointed(sweeps):
    started = sweeps["test_sigterm_stops_the_sweep_with_every_run_checkpointed"]
    first = started.root / "seed=1337"
    _wait_for([first / ".test_paused.rank0"], started)
    started.proc.send_signal(signal.SIGTERM)  # the sweep alone: it passes the signal on to its run
    code, out, err = started.ended(timeout=120)
    assert code == 75, out + err
    assert (first / "checkpoints" / "step_000003").is_dir()
    statuses = [p["status"] for p in json.loads((started.root / "sweep.json").read_text())["points"]]
    assert statuses == ["interrupted", "not started"]
    assert "interrupted (exit 75)" in out


@pytest.mark.slow
def test_a_run_outlives_its_killed_sweep_only_to_checkpoint(sweeps):
    """SIGKILL to the sweep alone: its runs get SIGTERM (PR_SET_PDEATHSIG), checkpoint and exit, so none is left
    running to clash with the same run started by the next sweep."""
    started = sweeps["test_a_run_outlives_its_killed_sweep_only_to_checkpoint"]
    first = started.root / "seed=1337"
    _wait_for([first / ".test_paused.rank0"], started)
    started.proc.kill()
    started.proc.wait()
    deadline = time.monotonic() + 60
    while "preempted by SIGTERM after step 3" not in (first / sweep.LOG_FILE).read_text():
        assert time.monotonic() < deadline, (first / sweep.LOG_FILE).read_text()
        time.sleep(0.1)
    assert (first / "checkpoints" / "step_000003").is_dir() and not (started.root / "seed=1338").exists()


@pytest.mark.slow
def test_a_failing_run_is_reported_and_the_others_finish(sweeps):
    started = sweeps["test_a_failing_run_is_reported_and_the_others_finish"]
    root = started.root
    code, out, err = started.ended()
    assert code == 1, out + err
    good, bad = root / "data.source=embedded,seed=1337", root / "data.source=_nonexistent_shards,seed=1337"
    assert json.loads((good / "summary.json").read_text())["steps"] == 4
    assert not (bad / "summary.json").exists()
    assert "failed (exit 2)" in out
    # the run's own error paragraph, from the tail of its stdout.log
    assert f"last lines of {bad / 'stdout.log'}" in out and "/nonexistent/shards" in out
    points = json.loads((root / "sweep.json").read_text())["points"]
    statuses = {p["name"]: (p["status"], p["exit_code"]) for p in points}
    assert statuses == {good.name: ("done", 0), bad.name: ("failed", 2)}
