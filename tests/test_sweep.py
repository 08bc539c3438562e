"""`nanopt sweep`: the grid, its names and device placement as pure functions, and bad flags; then, with fake runs (a
tiny child script stands in for `python -m nanopt.main`): one sweep per directory, "finished" by rundirs' one rule
(locally and on Modal), a point skipped or resumed only when it ran this config, and Ctrl-C reaching each run as
exactly one SIGTERM. Real sweeps: e2e/test_sweep_runs.py."""
from __future__ import annotations

import copy
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import pytest
from conftest import REPO, TINY_CONFIG, dead_pid, one_paragraph

from nanopt import cli, rundirs
from nanopt.config import load_config, to_yaml
from nanopt.errors import ConfigError
from nanopt.lab import sweep
from nanopt.lock import DirLock

# ---------------------------------------------------------------- pure functions
def test_grid_is_the_product_times_seeds_with_seeds_slowest():
    points = sweep.grid([("train.lr", ["1e-3", "2e-3"]), ("optim.name", ["adamw", "muon"])], [7, 8])
    assert len(points) == 8
    assert [p.seed for p in points] == [7] * 4 + [8] * 4  # every setting once before any second seed
    assert points[0].name == "train.lr=1e-3,optim.name=adamw,seed=7"
    assert points[3].values == {"train.lr": "2e-3", "optim.name": "muon"}
    assert points[3].overrides() == ["--train.lr=2e-3", "--optim.name=muon", "--run.seed=7"]
    assert len({p.name for p in points}) == 8
    assert sweep.grid([("data.source", ["/data/my shards"])], [0])[0].name == "data.source=_data_my_shards,seed=0"
    with pytest.raises(ConfigError, match="same directory name"):  # names are one safe path component
        sweep.grid([("data.source", ["a/b", "a_b"])], [0])


def test_plan_seeds_are_exact_integers_counting_up_from_the_config_seed_and_it_checks_every_point():
    points, configs = sweep.plan(TINY_CONFIG, ["optim.name=adamw,muon"], 2, ["--run.seed=10"])
    assert sorted({p.seed for p in points}) == [10, 11]
    assert configs["optim.name=muon,seed=11"].optim.name == "muon" and configs["optim.name=muon,seed=11"].run.seed == 11
    with pytest.raises(ConfigError, match=r"grid point optim.name=sgd,seed=1337: .*optim.name"):
        sweep.plan(TINY_CONFIG, ["optim.name=adamw,sgd"], 1, [])
    points, configs = sweep.plan(TINY_CONFIG, [], 2, ["--run.seed=4294967294"])
    assert [p.seed for p in points] == [4294967294, 4294967295]
    assert [configs[p.name].run.seed for p in points] == [4294967294, 4294967295]
    for seed in (4294967295, 2**40):  # the second seed is 2^32; or the first beyond it
        with pytest.raises(ConfigError, match=r"run\.seed"):
            sweep.plan(TINY_CONFIG, [], 2, [f"--run.seed={seed}"])


def test_a_points_file_lists_each_run_with_its_own_keys(tmp_path):
    ladder = tmp_path / "ladder.yaml"
    ladder.write_text("points:\n- {name: d2, set: {model.n_layers: 2, train.lr: 0.003, train.compile: false}}\n"
                      "- {name: d3, set: {model.n_layers: 3, train.max_steps: 7}}\n")
    points, configs = sweep.plan(TINY_CONFIG, [], 2, ["--run.seed=10"], points_file=ladder)
    assert [p.name for p in points] == ["d2,seed=10", "d3,seed=10", "d2,seed=11", "d3,seed=11"]
    assert points[0].values == {"model.n_layers": "2", "train.lr": "0.003", "train.compile": "false"}
    assert configs["d2,seed=10"].model.n_layers == 2 and configs["d2,seed=10"].train.lr == 0.003
    assert configs["d3,seed=11"].train.max_steps == 7 and configs["d3,seed=11"].run.seed == 11
    with pytest.raises(ConfigError, match="give one"):
        sweep.plan(TINY_CONFIG, ["train.lr=1,2"], 1, [], points_file=ladder)


@pytest.mark.parametrize("text, says", [
    (None, "no such file"), ("points: []\n", "the list is empty"),
    ("points:\n- {name: a/b, set: {}}\n", "`points[0].name`"),
    ("points:\n- {name: a, set: {train.lr: [1, 2]}}\n", "`points[0].set.train.lr`"),
    ("points:\n- {name: a, set: {}}\n- {name: a, set: {}}\n", "share a name"),
    ("runs: []\n", "`points` is missing"),
])
def test_a_points_file_it_cannot_use_is_one_paragraph(tmp_path, text, says):
    ladder = tmp_path / "ladder.yaml"
    if text is not None:
        ladder.write_text(text)
    with pytest.raises(ConfigError) as e:
        sweep.plan(TINY_CONFIG, [], 1, [], points_file=ladder)
    assert str(ladder) in str(e.value) and says in str(e.value) and "nanopt scaling plan" in str(e.value)


def test_place_fake_8_gpus_two_per_run_following_cuda_visible_devices_and_cpu_runs_splitting_the_cores():
    gpus = [str(i) for i in range(8)]
    slots = sweep.place("cuda", gpus, cores=64, nproc=2)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["0,1", "2,3", "4,5", "6,7"]
    assert all(s.overrides == () for s in slots)  # GPUs: no thread override
    assert len(sweep.place("cuda", gpus, 64, nproc=1, parallel=3)) == 3
    assert len(sweep.place("cuda", gpus, 64, nproc=1, runs=2)) == 2  # no idle slots
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in sweep.place("cuda", gpus, 64, nproc=3)] == ["0,1,2", "3,4,5"]
    with pytest.raises(ConfigError, match="--parallel 5"):
        sweep.place("cuda", gpus, 64, nproc=2, parallel=5)
    with pytest.raises(ConfigError, match="--nproc 4"):
        sweep.place("cuda", ["0", "1"], 64, nproc=4)
    assert sweep.visible_ids(2, "3,5") == ["3", "5"] and sweep.visible_ids(1, "") == ["0"]
    assert sweep.visible_ids(2, "GPU-aa, GPU-bb") == ["GPU-aa", "GPU-bb"]
    assert sweep.visible_ids(3, None) == ["0", "1", "2"]
    # CPU: the runs split the cores.
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
    cfg = load_config(TINY_CONFIG, [("train.max_steps", "5")])
    assert sweep.point_state(tmp_path, cfg) == "new"
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000002\n")
    for steps, state in ((3, "resume"), (5, "done")):  # 3: max_steps raised since, go on
        (tmp_path / "summary.json").write_text(json.dumps({"steps": steps}))
        assert sweep.point_state(tmp_path, cfg) == state


def test_progress_is_bars_on_a_terminal_and_plain_lines_otherwise(tmp_path):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True
    cfg = load_config(TINY_CONFIG)
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


@pytest.mark.parametrize("args, match", [
    (["--set", "train.lrr=1,2"], "unknown key `train.lrr`"),
    (["--set", "train.lr=1e-3,fast"], r"grid point train.lr=fast,seed=1337: .*must be a number"),
    *((["--set", text], match) for text, match in (
        ("train.lr", "--set 'train.lr'"), ("lr=1,2", "section.key"), ("train.lr=1,,2", "no empty value"),
        ("train.lr=1,1", "repeated"), ("run.seed=1,2", "--seeds N"), ("run.dir=a,b", "--name"),
        ("run.seed =1,2", "--seeds N"),  # a reserved key with spaces is still reserved
        *((text, "the sweep sets") for text in ("run.seed =1,2", " run.seed=1,2", "run. seed=1,2", " run.dir=a,b",
                                               "run.name =a,b")))),
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
    assert cli.run(["sweep", TINY_CONFIG, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanopt sweep: error: ") and err.strip().count("\n") == 0
    assert re.search(match, err), err
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- fake runs: the sweep owns its directory
GRID = ["--set", "train.lr=1e-3,2e-3"]
POINTS = ["train.lr=1e-3,seed=1337", "train.lr=2e-3,seed=1337"]

# A stand-in for a training run: `finish` writes the summary of a run trained to STEPS (after copying the
# sweep's lock file, to show who held it meanwhile); `signals` records each signal it gets and, on the first,
# takes 1.5 s to "save its checkpoint" before exiting 75, as a preempted run does.
FAKE_RUN = r'''
import os, shutil, signal, sys, time
from pathlib import Path
run_dir, mode = Path(sys.argv[1]), sys.argv[2]
run_dir.mkdir(parents=True, exist_ok=True)
if mode == "finish":
    lock = run_dir.parent / "lock.json"
    if lock.exists():
        shutil.copy(lock, run_dir / "held_lock.json")
    (run_dir / "summary.json").write_text('{"steps": %s}' % sys.argv[3])
    sys.exit(0)
got = []
def on_signal(signum, frame):
    got.append(signum)
    with open(run_dir / "signals", "a") as f:
        f.write(signal.Signals(signum).name + "\n")
signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
(run_dir / "ready").write_text(str(os.getpid()))
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(1.5)  # a slow checkpoint save: a second signal would arrive during it
sys.exit(75)
'''


@pytest.fixture
def fake_runs(tmp_path, monkeypatch) -> list[list[str]]:
    """Every run the sweep starts is FAKE_RUN finishing its max_steps; returns the real commands it would
    have started (for assertions on their overrides)."""
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    commands: list[list[str]] = []
    real = sweep.launch_command

    def launch(config: Optional[str], job: sweep.Job, overrides: list[str], nproc: int, slot: sweep.Slot) -> list[str]:
        commands.append(real(config, job, overrides, nproc, slot))
        return [sys.executable, str(script), str(job.dir), "finish", str(job.cfg.train.max_steps)]

    monkeypatch.setattr(sweep, "launch_command", launch)
    return commands


def _cli(root: Path, *args: str) -> int:
    return cli.run(["sweep", TINY_CONFIG, "--dir", str(root), *GRID, "--runtime.device=cpu", *args])


def _finished_point(root: Path, name: str, cfg: Any, steps: int, summary: Optional[dict] = None) -> Path:
    """A point's directory as a finished run leaves it: the config it ran and its summary."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / rundirs.CONFIG_FILE).write_text(to_yaml(cfg))
    (run_dir / rundirs.SUMMARY_FILE).write_text(json.dumps(summary or {"steps": steps}))
    return run_dir


def _planned(*overrides: str) -> dict[str, Any]:
    return sweep.plan(TINY_CONFIG, ["train.lr=1e-3,2e-3"], 1, ["--runtime.device=cpu", *overrides])[1]


def _states(root: Path, *overrides: str) -> dict[str, str]:
    return sweep.point_states([(n, root / n, cfg) for n, cfg in _planned(*overrides).items()], root)


def _done_points(root: Path) -> None:
    for name, cfg in _planned().items():
        _finished_point(root, name, cfg, cfg.train.max_steps)


# ---------------------------------------------------------------- one writer per sweep directory
def test_a_second_sweep_on_the_same_directory_exits_2_naming_the_holder(tmp_path, fake_runs, capsys):
    root = tmp_path / "sw"
    with DirLock(root, what="sweep"):  # a sweep running in this process, as far as the lock says
        assert _cli(root) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanopt sweep: error: the sweep directory") and err.strip().count("\n") == 0
    assert f"process {os.getpid()} on host {socket.gethostname()}" in err and str(root / rundirs.LOCK_FILE) in err
    assert fake_runs == [] and not any(p.is_dir() for p in root.iterdir())  # nothing started
    assert not (root / sweep.SWEEP_FILE).exists()


def test_a_sweep_takes_over_a_killed_sweeps_lock_normalises_its_overrides_and_prints_to_the_calls_stdout(
        tmp_path, fake_runs, capsys):
    assert sweep.normal_overrides(["--run.seed", "5", "--train.lr =1e-3", "-- eval.every= 3"]) == [
        "--run.seed=5", "--train.lr=1e-3", "--eval.every= 3"]
    with pytest.raises(ConfigError, match="--run.dir"):
        sweep.plan(TINY_CONFIG, ["train.lr=1,2"], 1, ["--run.dir =x"])
    with pytest.raises(ConfigError, match="both an override and a --set key"):
        sweep.plan(TINY_CONFIG, ["train.lr=1e-3,2e-3"], 1, ["--train.lr =1e-2"])
    root = tmp_path / "sw"
    root.mkdir()
    stale = {"host": socket.gethostname(), "pid": dead_pid(), "started": time.time() - 60,
             "heartbeat": time.time() - 60, "token": "killed-sweep"}
    (root / rundirs.LOCK_FILE).write_text(json.dumps(stale))
    assert _cli(root, "--train.max_steps =3") == 0  # the spaced key reaches every run spelled as the config's
    assert all("--train.max_steps=3" in c for c in fake_runs) and len(fake_runs) == 2
    assert json.loads((root / sweep.SWEEP_FILE).read_text())["overrides"][-1] == "--train.max_steps=3"
    for name in POINTS:  # each run saw the lock held by this sweep (this process), not the killed one
        held = json.loads((root / name / "held_lock.json").read_text())
        assert held["pid"] == os.getpid() and held["token"] != "killed-sweep"
    assert not (root / rundirs.LOCK_FILE).exists()  # released at the end
    # A default bound at import wrote to whatever sys.stdout was then: a stream a test's capture had closed since.
    out = capsys.readouterr().out
    assert "sweep " in out and "2 to run" in out and "sweep.json describes the sweep" in out


# ---------------------------------------------------------------- finished: one rule
@pytest.mark.parametrize("summary", [
    {"steps": 5}, {"steps": 7}, {"steps": 3}, {"steps": 3, "step_to_target": 3, "stopped_at_target": True},
    {"steps": 3, "step_to_target": 2, "stopped_at_target": False},  # saw the target, went on, then was stopped
])
def test_point_state_is_rundirs_finished(tmp_path, summary):
    cfg = load_config(TINY_CONFIG, [("train.max_steps", "5"), ("train.target_val_loss", "4.0"),
                                    ("train.stop_at_target", "true")])
    (tmp_path / rundirs.SUMMARY_FILE).write_text(json.dumps(summary))
    done = rundirs.finished(tmp_path, cfg.train.max_steps, cfg.train.stop_at_target) is not None
    assert (sweep.point_state(tmp_path, cfg) == "done") == done


@pytest.mark.parametrize("where, text", [
    (rundirs.SUMMARY_FILE, '{"steps": 150'),  # cut short
    (rundirs.SUMMARY_FILE, "[150]"), (rundirs.SUMMARY_FILE, '{"steps": "150"}'),
    (rundirs.CONFIG_FILE, "train: {lr: [\n"), (rundirs.CONFIG_FILE, "- just\n- a list\n"),
    ("point", None), (rundirs.SUMMARY_FILE, None), (rundirs.CONFIG_FILE, None), (sweep.SWEEP_FILE, None),
    (sweep.LOG_FILE, "a link"),
])
def test_a_damaged_or_misplaced_file_is_one_paragraph_and_nothing_starts(tmp_path, fake_runs, capsys, where, text):
    """A damaged file, or (text None) a file or directory in the wrong place, or a run's log that is a link. Before:
    a file at a point's directory was a FileExistsError traceback, a directory at sweep.json an IsADirectoryError
    one, a directory at a point's summary.json or config.yaml read as absent (the point was run again, or skipped
    unchecked), and the sweep appended the run's output to the file a log's link pointed to."""
    root, mine = tmp_path / "sw", tmp_path / "mine.log"
    cfg = _planned()[POINTS[0]]
    run_dir = _finished_point(root, POINTS[0], cfg, cfg.train.max_steps)
    named = run_dir if where == "point" else root / where if where == sweep.SWEEP_FILE else run_dir / where
    if where == sweep.LOG_FILE:  # an unfinished point, so that its run would start
        (run_dir / rundirs.SUMMARY_FILE).unlink()
        mine.write_text("the user's log\n")
        named.symlink_to(mine)
    elif text is not None:
        named.write_text(text)
    elif where == "point":
        shutil.rmtree(run_dir)
        run_dir.write_text("not a run")
    else:
        named.unlink(missing_ok=True)
        named.mkdir()
    assert _cli(root) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    if where == sweep.LOG_FILE:
        assert str(named) in err and "symbolic link" in err and "Remove the link" in err
        assert mine.read_text() == "the user's log\n"
    elif text is not None:
        assert err.startswith(f"nanopt sweep: error: grid point {POINTS[0]}: ")
        assert str(named) in err and "restore the file, or remove" in err
    else:
        assert f"{named} is a " in err, err
    assert fake_runs == [] and not (root / rundirs.LOCK_FILE).exists()


@pytest.mark.parametrize("command", [["sweep", TINY_CONFIG, "--set", "train.lr=1e-3,2e-3", "--dir"],
                                     ["scaling", "plan", TINY_CONFIG, "--budgets", "1e12", "--out"]])
def test_a_sweeps_directory_inside_a_runs_checkpoints_is_refused(tmp_path, capsys, command):
    """The run prunes its checkpoints as its own: `nanopt scaling plan --out` went there unchecked."""
    inside = tmp_path / "run" / rundirs.CHECKPOINTS_DIR / "step_000002" / "sw"
    assert cli.run([*command, str(inside)]) == 2
    assert f"{command[-1]} {inside} is inside" in one_paragraph(capsys.readouterr().err)
    assert not inside.exists()


# ---------------------------------------------------------------- a point is what it says
def test_a_point_that_ran_another_config_is_refused_before_anything_starts(tmp_path, fake_runs, capsys):
    root = tmp_path / "sw"
    _done_points(root)
    (root / sweep.SWEEP_FILE).write_text('{"overrides": ["--runtime.device=cpu"]}')
    assert _cli(root, "--train.weight_decay=0.0", "--optim.name=muon") == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "2 point(s)" in err
    for name in POINTS:
        assert f"{name} (optim.name: adamw -> muon, train.weight_decay: 0.1 -> 0.0)" in err
    assert "same config file and overrides" in err and "--name or --dir" in err and str(root / sweep.SWEEP_FILE) in err
    assert fake_runs == []
    assert (root / sweep.SWEEP_FILE).read_text() == '{"overrides": ["--runtime.device=cpu"]}'  # not rewritten
    assert not (root / rundirs.LOCK_FILE).exists()  # released on the refusal too
    # An edited config file is the same refusal (only the point whose directory differs is named).
    edited = tmp_path / "edited.yaml"
    edited.write_text(Path(TINY_CONFIG).read_text().replace("warmup_steps: 15", "warmup_steps: 20"))
    assert cli.run(["sweep", str(edited), "--dir", str(root), "--set", "train.lr=1e-3", "--seeds", "2",
                    "--runtime.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "1 point(s)" in err and "train.lr=1e-3,seed=1337 (train.warmup_steps: 15 -> 20)" in err


def test_a_finished_point_refuses_a_changed_result_key_an_unfinished_one_resumes_with_it(tmp_path):
    """Before, a done point was skipped under a new target (or corpus, profiling, tasks) that it never ran: the
    sweep's table would report the old runs as the new setting's. The rule of `nanopt train` (and Modal's sweep)."""
    root = tmp_path / "sw"
    _done_points(root)
    done, going = POINTS
    (root / going / rundirs.SUMMARY_FILE).write_text(json.dumps({"steps": 149}))  # interrupted
    (root / going / rundirs.CHECKPOINTS_DIR).mkdir()
    (root / going / rundirs.CHECKPOINTS_DIR / rundirs.LATEST_FILE).write_text("step_000100\n")
    with pytest.raises(ConfigError, match=rf"1 point\(s\) .*{re.escape(done)} \(train\.target_val_loss: null -> 1\.6\)"
                       r".*--checkpoint\.allow_changes=KEY") as refused:
        _states(root, "--train.target_val_loss=1.6")
    assert going not in str(refused.value)
    assert _states(root, "--train.target_val_loss=1.6", "--checkpoint.allow_changes=train.target_val_loss") == {
        done: "done", going: "resume"}


@pytest.mark.slow
def test_keys_a_resume_may_change_keep_skip_and_resume(tmp_path, fake_runs, capsys):
    root = tmp_path / "sw"
    _done_points(root)
    assert _states(root, "--runtime.threads=3") == {n: "done" for n in POINTS}  # runtime.* changes no result
    # A longer max_steps: a done point trains on from its checkpoint.
    (root / POINTS[0] / rundirs.CHECKPOINTS_DIR).mkdir()
    (root / POINTS[0] / rundirs.CHECKPOINTS_DIR / rundirs.LATEST_FILE).write_text("step_000150\n")
    assert _states(root, "--train.max_steps=300") == {POINTS[0]: "resume", POINTS[1]: "new"}
    assert _cli(root, "--train.max_steps=300") == 0
    meta = json.loads((root / sweep.SWEEP_FILE).read_text())
    assert meta["overrides"] == ["--runtime.device=cpu", "--train.max_steps=300"]  # what the runs now ran
    assert [p["steps"] for p in meta["points"]] == [300, 300]
    assert all("--train.max_steps=300" in c for c in fake_runs) and len(fake_runs) == 2


# ---------------------------------------------------------------- Ctrl-C: one signal per run
DRIVER = r'''
import sys
from pathlib import Path
from nanopt.lab import sweep
from nanopt.config import load_config, parse_overrides, resolve
root, script, config = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sweep.launch_command = lambda config, job, overrides, nproc, slot: [sys.executable, script, str(job.dir), "signals"]
points = sweep.grid([("train.lr", ["1e-3", "2e-3"])], [0])
configs = {p.name: resolve(load_config(config, [("runtime.device", "cpu")] + parse_overrides(p.overrides())), 1)
           for p in points}
sys.exit(sweep.run_sweep(config, root, points, configs, [], parallel=2, poll_s=0.05))
'''


@pytest.mark.slow
@pytest.mark.parametrize("target", ["terminal", "sweep"])
def test_ctrl_c_twice_reaches_each_run_as_exactly_one_sigterm(tmp_path, target):
    """terminal: SIGINT to the sweep's whole process group, as a terminal's Ctrl-C is sent (a run in that group
    would get it too, besides the sweep's SIGTERM); sweep: SIGINT to the sweep alone. Twice, 0.3 s apart: the
    repeat must not reach a run that is still saving its checkpoint."""
    root, script, driver = tmp_path / "sw", tmp_path / "fake_run.py", tmp_path / "driver.py"
    script.write_text(FAKE_RUN)
    driver.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(driver), str(root), str(script), TINY_CONFIG], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    runs = [root / f"train.lr={lr},seed=0" for lr in ("1e-3", "2e-3")]
    try:
        deadline = time.monotonic() + 60
        while not all((r / "ready").exists() for r in runs):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the fake runs did not start"
            time.sleep(0.05)
        for _ in range(2):
            if target == "terminal":
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 75, out + err
    for r in runs:
        assert (r / "signals").read_text().split() == ["SIGTERM"], r
    assert "already stopping" in out and out.count("interrupted (exit 75)") == 2


# ---------------------------------------------------------------- the Modal driver, offline
def _modal_sweep(monkeypatch, tmp_path: Path, train: mock.MagicMock, **kwargs: Any) -> None:
    """modal_app.sweep.local(**kwargs) with `train` (a mock) as the training function and tmp_path/vol as the
    Volume (test_modal_app.run_sweep_driver, without importing that module's Modal-only setup)."""
    import modal_app

    train.with_options.return_value.spawn.return_value.get.return_value = {"exit_code": 0}
    monkeypatch.setattr(modal_app, "train", train)
    monkeypatch.setattr(modal_app, "VOLUME_PATH", str(tmp_path / "vol"))
    monkeypatch.setattr(modal_app.volume, "reload", lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # .local() warns that the Volume is not mounted
        modal_app.sweep.local(config="configs/tiny.yaml", name="s", **kwargs)


TARGET_SETS = "train.target_val_loss=4.0;train.stop_at_target=true;optim.name=adamw,muon"


def _modal_points() -> dict[str, Any]:
    """The configs the Modal driver would run, by point name (resolved for 1 GPU, as it checks them)."""
    return sweep.plan(TINY_CONFIG, TARGET_SETS.split(";"), 1, [], 1)[1]


@pytest.mark.parametrize("damage", ["stopped at its target", "another config", "damaged summary"])
def test_modal_sweep_skips_a_point_stopped_at_its_target_and_refuses_another_config_or_damage_before_any_gpu(
        monkeypatch, tmp_path, capsys, damage):
    """Before, the driver skipped only a summary with steps == max_steps: a run stopped at its target was paid
    for again."""
    import modal_app

    configs = _modal_points()
    name = next(n for n in configs if "muon" in n)
    ran = copy.deepcopy(configs[name])
    ran.train.lr = 0.01 if damage == "another config" else ran.train.lr
    summary = {"steps": 60, "step_to_target": 60, "stopped_at_target": True} if damage.startswith("stopped") else None
    run_dir = _finished_point(tmp_path / "vol" / "runs" / "s", name, ran, ran.train.max_steps, summary)
    if damage == "damaged summary":
        (run_dir / rundirs.SUMMARY_FILE).write_text("{")
    train = mock.MagicMock(name="train")
    if summary:
        _modal_sweep(monkeypatch, tmp_path, train, sets=TARGET_SETS)
        assert [c.args[1] for c in train.with_options.return_value.spawn.call_args_list] == [
            f"s/{n}" for n in configs if n != name]
        assert f"s/{name}: finished before, skipped" in capsys.readouterr().out
        return
    words = (rf"1 point\(s\) .*s/{name} \(train\.lr: 0\.01 -> " if damage == "another config"
             else rf"grid point s/{name}: .*{rundirs.SUMMARY_FILE}")
    with pytest.raises(modal_app.SweepError, match="refused before any GPU started: " + words) as refused:
        _modal_sweep(monkeypatch, tmp_path, train, sets=TARGET_SETS)
    assert not train.mock_calls and "Traceback" not in str(refused.value)
