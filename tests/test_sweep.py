"""`nanopt sweep`: the grid, its names and device placement as pure functions; then real sweeps of real
training processes on CPU: a 2x2 grid finishes and a re-run skips it, a killed sweep resumes without
redoing finished runs, SIGTERM stops it resumably, a failing run is reported while the rest finish,
and bad flags stop it before anything starts."""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, small_overrides
from nanopt import cli, sweep
from nanopt.config import load_config
from nanopt.errors import ConfigError

CONFIG = str(REPO / "configs" / "tiny.yaml")


# ---------------------------------------------------------------- pure functions


def test_grid_is_the_product_times_seeds_with_seeds_slowest():
    points = sweep.grid([("train.lr", ["1e-3", "2e-3"]), ("optim.name", ["adamw", "muon"])], [7, 8])
    assert len(points) == 8
    assert [p.seed for p in points] == [7] * 4 + [8] * 4  # every setting once before any second seed
    assert points[0].name == "train.lr=1e-3,optim.name=adamw,seed=7"
    assert points[3].values == {"train.lr": "2e-3", "optim.name": "muon"}
    assert points[3].overrides() == ["--train.lr=2e-3", "--optim.name=muon", "--run.seed=7"]
    assert len({p.name for p in points}) == 8


def test_point_names_are_one_safe_path_component():
    assert sweep.point_name({"data.source": "/data/my shards"}, 0) == "data.source=_data_my_shards,seed=0"
    with pytest.raises(ConfigError, match="same directory name"):
        sweep.grid([("data.source", ["a/b", "a_b"])], [0])


@pytest.mark.parametrize("text, match", [
    ("train.lr", "--set 'train.lr'"), ("lr=1,2", "section.key"), ("train.lr=1,,2", "no empty value"),
    ("train.lr=1,1", "repeated"), ("run.seed=1,2", "--seeds N"), ("run.dir=a,b", "--name"),
])
def test_parse_set_refuses_what_it_cannot_read(text, match):
    with pytest.raises(ConfigError, match=match):
        sweep.parse_set(text)


def test_plan_seeds_count_up_from_the_config_seed_and_checks_every_point():
    points, configs = sweep.plan(CONFIG, ["optim.name=adamw,muon"], 2, ["--run.seed=10"])
    assert sorted({p.seed for p in points}) == [10, 11]
    assert configs["optim.name=muon,seed=11"].optim.name == "muon"
    assert configs["optim.name=muon,seed=11"].run.seed == 11
    with pytest.raises(ConfigError, match=r"grid point optim.name=sgd,seed=1337: .*optim.name"):
        sweep.plan(CONFIG, ["optim.name=adamw,sgd"], 1, [])


def test_place_fake_8_gpus_two_per_run():
    slots = sweep.place("cuda", [str(i) for i in range(8)], cores=64, nproc=2)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["0,1", "2,3", "4,5", "6,7"]
    assert all(s.overrides == () for s in slots)  # GPUs: no thread override
    assert len(sweep.place("cuda", [str(i) for i in range(8)], 64, nproc=1, parallel=3)) == 3
    assert len(sweep.place("cuda", [str(i) for i in range(8)], 64, nproc=1, runs=2)) == 2  # no idle slots
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in sweep.place("cuda", [str(i) for i in range(8)], 64, nproc=3)] \
        == ["0,1,2", "3,4,5"]
    with pytest.raises(ConfigError, match="--parallel 5"):
        sweep.place("cuda", [str(i) for i in range(8)], 64, nproc=2, parallel=5)
    with pytest.raises(ConfigError, match="--nproc 4"):
        sweep.place("cuda", ["0", "1"], 64, nproc=4)


def test_visible_ids_follow_cuda_visible_devices():
    assert sweep.visible_ids(2, "3,5") == ["3", "5"]
    assert sweep.visible_ids(2, "GPU-aa, GPU-bb") == ["GPU-aa", "GPU-bb"]
    assert sweep.visible_ids(3, None) == ["0", "1", "2"]
    assert sweep.visible_ids(1, "") == ["0"]


def test_place_cpu_splits_the_cores():
    two = sweep.place("cpu", [], cores=2, parallel=2)
    assert len(two) == 2
    assert all(s.env == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"} for s in two)
    assert two[0].overrides == ("--runtime.threads=1",)
    one = sweep.place("cpu", [], cores=2, parallel=1)
    assert one[0].env == {"OMP_NUM_THREADS": "2"} and one[0].overrides == ("--runtime.threads=2",)  # alone: ACTIVE
    assert len(sweep.place("cpu", [], cores=2)) == 2  # default: one run per core (docs/experiments.md "Sweeps")
    assert sweep.place("cpu", [], cores=2, runs=1)[0].overrides == ("--runtime.threads=2",)
    assert sweep.place("cpu", [], cores=16, nproc=2, parallel=4)[0].overrides == ("--runtime.threads=2",)
    assert sweep.place("cpu", [], cores=2, parallel=4)[0].overrides == ("--runtime.threads=1",)  # at least 1
    assert sweep.place("cpu", [], cores=8, parallel=2, threads=1)[0].env["OMP_NUM_THREADS"] == "1"  # the user's
    assert sweep.discover("cpu") == ("cpu", [])


def test_point_state_reads_the_run_directory(tmp_path):
    cfg = load_config(CONFIG, [("train.max_steps", "5")])
    assert sweep.point_state(tmp_path, cfg) == "new"
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000002\n")
    assert sweep.point_state(tmp_path, cfg) == "resume"
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 3}))  # max_steps raised since: go on
    assert sweep.point_state(tmp_path, cfg) == "resume"
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 5}))
    assert sweep.point_state(tmp_path, cfg) == "done"


def test_progress_is_bars_on_a_terminal_and_plain_lines_otherwise(tmp_path):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True
    cfg = load_config(CONFIG)
    jobs = [sweep.Job(p, tmp_path / p.name, cfg) for p in sweep.grid([("train.lr", ["1", "2", "3"])], [0])]
    (tmp_path / jobs[0].point.name).mkdir()
    (tmp_path / jobs[0].point.name / "metrics.jsonl").write_text('{"step": 3, "loss": 4.5}\n{"step": 3, "val_loss": 4.25}\n')
    slots = [sweep.Slot("cpu: 1 thread"), sweep.Slot("cpu: 1 thread")]
    for out in (Tty(), io.StringIO()):
        for j in jobs:
            j.status, j.exit_code = "queued", None
        progress = sweep.Progress(jobs, out, len(slots))
        jobs[0].status, jobs[0].slot, jobs[0].started = "running", 0, time.monotonic()
        progress.note(progress.line(jobs[0], slots))
        jobs[1].status, jobs[1].exit_code = "failed", 2
        progress.note(progress.line(jobs[1], slots))
        progress.redraw()
        progress.close()
        text = out.getvalue()
        assert "train.lr=1,seed=0  running      [cpu: 1 thread]" in text and "failed       exit 2" in text
        if isinstance(out, Tty):  # runs finished (running, failed), then a bar per slot: its run's step and loss
            assert "1 running, 1 failed" in text and "1/3" in text and "idle" in text
            assert re.search(r"train.lr=1,seed=0: .* 3/150, loss 4.5000  val loss 4.2500", text), text
        else:  # a log file: the two lines and nothing else, no control characters
            assert text.count("\n") == 2 and "\x1b" not in text and "\r" not in text


# ---------------------------------------------------------------- real sweeps


def _sweep_cmd(root: Path, *args: str, device: str = "cpu", **small: object) -> list[str]:
    return [sys.executable, "-m", "nanopt.cli", "sweep", CONFIG, "--dir", str(root), *args,
            *small_overrides(**{"train.max_steps": 4, "runtime.device": device, **small})]


def _run(cmd: list[str], tmp_path: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _sessions(run_dir: Path) -> int:
    """How many times the sweep started this run (each start writes a header line to its stdout.log)."""
    log = run_dir / sweep.LOG_FILE
    return log.read_text().count("=== nanopt sweep") if log.exists() else 0


@pytest.mark.slow
def test_a_2x2_sweep_finishes_and_a_rerun_skips_it(tmp_path):
    root = tmp_path / "sw"
    # runtime.device=auto: the device is discovered as the runs will see it (CPU here)
    first = _run(_sweep_cmd(root, "--set", "train.lr=1e-3,2e-3", "--seeds", "2", device="auto"), tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
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
    assert "2 at a time (cpu: 1 thread)" in first.stdout  # 2 cores: 2 single-thread runs
    assert "final val loss" in first.stdout and first.stdout.count("  done ") >= 4

    mtimes = {d: (d / "summary.json").stat().st_mtime_ns for d in dirs}
    again = _run(_sweep_cmd(root, "--set", "train.lr=1e-3,2e-3", "--seeds", "2", device="auto"), tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    # Nothing to run: no device discovery (no "N at a time"), no training, each point skipped
    assert "4 already done, 0 to run\n" in again.stdout and again.stdout.count("skipped") == 4
    assert all(_sessions(d) == 1 for d in dirs)
    assert {d: (d / "summary.json").stat().st_mtime_ns for d in dirs} == mtimes


def _wait_for(paths: list[Path], proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the sweep ended (exit {proc.returncode}) before {paths} appeared:\n{out}\n{err}")
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
def test_a_killed_sweep_resumes_and_does_not_redo_finished_runs(tmp_path):
    root = tmp_path / "sw"
    args = ["--set", "train.max_steps=2,5", "--parallel", "2"]
    short, long = root / "train.max_steps=2,seed=1337", root / "train.max_steps=5,seed=1337"
    # The 5-step run checkpoints at step 2, then waits after step 3 (test hook) until the whole sweep is killed.
    cmd = [a for a in _sweep_cmd(root, *args, **{"checkpoint.every": 2}) if a != "--train.max_steps=4"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "NANOPT_TEST_HOOK": "pause:3"})
    try:
        _wait_for([short / "summary.json", long / ".test_paused.rank0"], proc)
    finally:
        # The sweep and every run it started, no chance to clean up. Each run has its own session (a terminal's
        # Ctrl-C reaches only the sweep), so the sweep's process group is the sweep alone: the runs go first.
        runs = _children(proc.pid)
        for pid in runs:
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        _wait_gone(runs)  # reaped, so the runs' lock files name dead processes (a zombie's pid still answers)
    assert not (long / "summary.json").exists() and (long / "checkpoints" / "latest").exists()
    short_mtime = (short / "summary.json").stat().st_mtime_ns

    again = _run(cmd, tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "1 already done, 1 to run" in again.stdout
    assert _sessions(short) == 1 and (short / "summary.json").stat().st_mtime_ns == short_mtime
    assert _sessions(long) == 2 and "resuming from" in (long / sweep.LOG_FILE).read_text()
    assert json.loads((long / "summary.json").read_text())["steps"] == 5
    records = [json.loads(line) for line in (long / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]  # step 3 again from the step-2 checkpoint


@pytest.mark.slow
def test_sigterm_stops_the_sweep_with_every_run_checkpointed(tmp_path):
    root = tmp_path / "sw"
    cmd = _sweep_cmd(root, "--seeds", "2", "--parallel", "1", **{"train.max_steps": 5})
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NANOPT_TEST_HOOK": "pause:3"})
    first = root / "seed=1337"
    _wait_for([first / ".test_paused.rank0"], proc)
    proc.send_signal(signal.SIGTERM)  # the sweep alone: it passes the signal on to its run
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, out + err
    assert (first / "checkpoints" / "step_000003").is_dir()
    statuses = [p["status"] for p in json.loads((root / "sweep.json").read_text())["points"]]
    assert statuses == ["interrupted", "not started"]
    assert "interrupted (exit 75)" in out


@pytest.mark.slow
def test_a_run_outlives_its_killed_sweep_only_to_checkpoint(tmp_path):
    """SIGKILL to the sweep alone: its runs get SIGTERM (PR_SET_PDEATHSIG), checkpoint and exit, so none is left
    running to clash with the same run started by the next sweep."""
    root = tmp_path / "sw"
    proc = subprocess.Popen(_sweep_cmd(root, "--seeds", "2", "--parallel", "1", **{"train.max_steps": 5}), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "NANOPT_TEST_HOOK": "pause:3"})
    first = root / "seed=1337"
    _wait_for([first / ".test_paused.rank0"], proc)
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 60
    while "preempted by SIGTERM after step 3" not in (first / sweep.LOG_FILE).read_text():
        assert time.monotonic() < deadline, (first / sweep.LOG_FILE).read_text()
        time.sleep(0.1)
    assert (first / "checkpoints" / "step_000003").is_dir() and not (root / "seed=1338").exists()


@pytest.mark.slow
def test_a_failing_run_is_reported_and_the_others_finish(tmp_path):
    root = tmp_path / "sw"
    result = _run(_sweep_cmd(root, "--set", "data.source=embedded,/nonexistent/shards"), tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    good, bad = root / "data.source=embedded,seed=1337", root / "data.source=_nonexistent_shards,seed=1337"
    assert json.loads((good / "summary.json").read_text())["steps"] == 4
    assert not (bad / "summary.json").exists()
    assert "failed (exit 2)" in result.stdout
    # the run's own error paragraph, from the tail of its stdout.log
    assert f"last lines of {bad / 'stdout.log'}" in result.stdout and "/nonexistent/shards" in result.stdout
    statuses = {p["name"]: (p["status"], p["exit_code"]) for p in json.loads((root / "sweep.json").read_text())["points"]}
    assert statuses == {good.name: ("done", 0), bad.name: ("failed", 2)}


@pytest.mark.parametrize("args, match", [
    (["--set", "train.lrr=1,2"], "unknown key `train.lrr`"),
    (["--set", "train.lr=1e-3,fast"], r"grid point train.lr=fast,seed=1337: .*must be a number"),
    (["--set", "train.lr"], "--set 'train.lr'"),
    (["--set", "run.seed=1,2"], "--seeds N"),
    (["--set", "train.lr=1e-3,2e-3", "--seeds", "0"], "--seeds 0"),
    (["--set", "train.lr=1e-3,2e-3", "--parallel", "two"], "--parallel"),
    (["--set", "train.lr=1e-3,2e-3", "--run.dir=x"], "--run.dir"),
    (["--set", "train.lr=1e-3,2e-3", "--train.lr=1e-2"], "both an override and a --set key"),
    (["--set", "train.lr=1e-3,2e-3", "--bogus"], "cannot read `--bogus`"),
    (["--set", "train.lr=1e-3,2e-3", "--checkpoint.resume=false"], "checkpoint.resume is false .* Drop it"),
    ([], "nothing to sweep"),
])
def test_bad_input_is_one_paragraph_and_exit_2_before_anything_starts(args, match, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.run(["sweep", CONFIG, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanopt sweep: error: ") and err.strip().count("\n") == 0
    assert re.search(match, err), err
    assert not (tmp_path / "runs").exists()
