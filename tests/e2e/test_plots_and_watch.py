"""Pictures and evaluation while training, on real runs: every run's curves.png, `nanopt plot` overlays, a profiled
run's offline profile.html, and `nanopt eval --watch` beside a real training process."""
from __future__ import annotations

import base64
import contextlib
import html
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, dead_pid, small_overrides
from matplotlib import image

from nanopt.cli import run as cli
from nanopt.evals import checkpoint_eval as watch
from nanopt.lab import plots
from nanopt.lock import DirLock
from nanopt.main import run as main_run
from nanopt.rundirs import WATCH_LOCK_FILE

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train(run_dir: Path, **changes: object) -> None:
    """A real training run in this process (a fresh interpreter would pay torch's import again)."""
    with contextlib.redirect_stdout(io.StringIO()):
        assert main_run(small_overrides(**{"run.dir": str(run_dir), "log.curves": "true", **changes})) == 0


def decode(png: Path | bytes) -> np.ndarray:
    """H W C floats in [0, 1]; fails unless the bytes are a real PNG."""
    data = png if isinstance(png, bytes) else png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return image.imread(io.BytesIO(data), format="png")


def assert_drawn(pixels: np.ndarray, width: int, height: int, colours: tuple[str, ...]) -> None:
    """The size asked for, and a picture: marks over a white page, with pixels of each of `colours` (the
    lines or bars drawn; empty axes are only greys)."""
    assert pixels.shape[:2] == (height, width)
    rgb = (pixels[..., :3] * 255).round().astype(np.int16)
    non_white = (rgb < 250).any(axis=-1).mean()
    assert 0.02 < non_white < 0.6, non_white
    for colour in colours:
        target = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
        near = (np.abs(rgb - target).max(axis=-1) <= 12).sum()
        assert near > 50, (colour, near)


BLUE, ORANGE, GREEN = "#1f77b4", "#ff7f0e", "#2ca02c"  # matplotlib's first three line colours


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A directory of two real runs (different learning rates), validation and checkpoints every 2 steps; lr_high
    profiled (6 steps: the schedule shrinks to 1/1/4)."""
    root = tmp_path_factory.mktemp("sweep")
    for name, lr, profiled in (("lr_low", 0.001, "false"), ("lr_high", 0.004, "true")):
        train(root / name, **{"train.lr": lr, "eval.every": 2, "checkpoint.every": 2, "profile.enabled": profiled})
    return root


@pytest.fixture
def run_dir(sweep, tmp_path) -> Path:
    """A copy of lr_low, for a test to change."""
    return shutil.copytree(sweep / "lr_low", tmp_path / "run")


# ---------------------------------------------------------------- curves.png
def test_every_run_writes_its_curves_whose_axes_are_the_runs_own_numbers(sweep):
    for run_dir in (sweep / "lr_low", sweep / "lr_high"):
        assert_drawn(decode(run_dir / plots.CURVES_FILE), 1500, 800, (BLUE, ORANGE, GREEN))
    recs = plots.stepped_records(sweep / "lr_low")
    summary = json.loads((sweep / "lr_low" / "summary.json").read_text())
    xs, ys = plots.series(recs, "val_loss", "tokens")
    assert xs == [0, 512, 1024, 1536]  # eval at steps 0, 2, 4, 6 of 256 tokens
    assert ys[-1] == pytest.approx(summary["final_val_loss"])
    steps, train_loss = plots.series(recs, "loss", "steps")
    assert steps == [1, 2, 3, 4, 5, 6] and train_loss[0] > train_loss[-1]
    # Training seconds from the logged step times, not wall time: close to the run's own clock.
    seconds, _ = plots.series(recs, "loss", "seconds")
    assert seconds == sorted(seconds) and seconds[-1] == pytest.approx(summary["train_seconds"], rel=0.5)


def test_without_matplotlib_no_picture_is_drawn_but_the_profile_page_has_its_table(sweep, tmp_path, monkeypatch,
                                                                                   caplog):
    shutil.copy(sweep / "lr_low" / "metrics.jsonl", tmp_path)
    summary = json.loads((sweep / "lr_high" / "profile_summary.json").read_text())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets where it is not installed
    with caplog.at_level("INFO", logger="nanopt"):
        assert plots.curves_quietly(tmp_path) is None
    assert "curves.png skipped: matplotlib is not installed" in caplog.text
    assert not (tmp_path / plots.CURVES_FILE).exists()
    assert cli(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    page = plots.profile_page(summary, tmp_path / "p.html").read_text()
    assert "matplotlib is not installed" in page and "<img" not in page
    assert all(html.escape(op["name"]) in page for op in summary["top_ops"])


# ---------------------------------------------------------------- nanopt plot
def test_plot_overlays_a_sweeps_runs_and_refuses_what_is_not_a_run(sweep, tmp_path, monkeypatch, capsys):
    assert plots.runs_to_plot([sweep]) == [sweep / "lr_high", sweep / "lr_low"]
    assert plots.run_labels(plots.runs_to_plot([sweep])) == ["lr_high", "lr_low"]
    out = tmp_path / "overlay.png"
    assert cli(["plot", str(sweep), "-o", str(out), "--x", "tokens", "--metric", "val_loss"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert_drawn(decode(out), 1000, 600, (BLUE, ORANGE))  # one line per run
    assert cli(["plot", str(sweep), "--metric", "val_losss", "-o", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "no run logged 'val_losss'" in err and "val_loss" in err and "tokens_per_s" in err
    assert not (tmp_path / "p.png").exists()
    # Runs named one by one, training loss against seconds, the default file name.
    monkeypatch.chdir(tmp_path)
    assert cli(["plot", str(sweep / "lr_low"), str(sweep / "lr_high"), "--metric", "loss", "--x", "seconds"]) == 0
    assert_drawn(decode(tmp_path / "plot_loss_seconds.png"), 1000, 600, (BLUE, ORANGE))
    (tmp_path / "empty").mkdir()
    for path, says in (("missing", "is not a directory"), ("empty", "holds no run")):
        assert cli(["plot", str(tmp_path / path)]) == 2
        assert says in capsys.readouterr().err


# ---------------------------------------------------------------- the offline profile page
def test_a_profiled_run_writes_a_page_that_needs_no_network(sweep):
    page = (sweep / "lr_high" / plots.PROFILE_PAGE).read_text()
    summary = json.loads((sweep / "lr_high" / "profile_summary.json").read_text())
    assert "http://" not in page and "https://" not in page  # nothing to fetch: no CDN, no fonts, no charts API
    assert "<script" not in page and "<link" not in page
    sources = re.findall(r'src="([^"]*)"', page)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    assert summary["top_ops"] and all(html.escape(op["name"]) in page for op in summary["top_ops"])
    assert f"{100 * summary['host_overhead_share']:.1f}%" in page
    [embedded] = re.findall(r'src="data:image/png;base64,([^"]*)"', page)
    assert_drawn(decode(base64.b64decode(embedded)), 1000, 600, ("#4c72b0", "#c44e52"))  # compute, overhead


# ---------------------------------------------------------------- nanopt eval --watch
def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in records(run_dir / "evals.jsonl")]


def _signal_when(condition, sig: int) -> tuple[threading.Event, list]:
    """Sends this process `sig` from a thread (as a terminal's Ctrl-C or a preemption would) once condition() returns
    something other than None (kept in the returned list), unless the returned event is set first."""
    over, seen = threading.Event(), []

    def wait() -> None:
        while not over.wait(0.1):
            if (state := condition()) is not None:
                seen.append(state)
                return os.kill(os.getpid(), sig)

    threading.Thread(target=wait, daemon=True).start()
    return over, seen


@pytest.mark.slow
def test_watch_evaluates_each_checkpoint_of_a_training_run_once(tmp_path, capsys, monkeypatch):
    """The watcher beside a training run (in this process) paused after step 4 until the watcher has caught up,
    preempted, then resumed: the evaluations happen while the run is still training, not after it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # an empty directory: the watcher may start before the run does
    watcher = subprocess.Popen([sys.executable, "-m", "nanopt.cli", "eval", str(run_dir), "--watch", "--interval", "0.2",
                                "--timeout", "300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                               env=ENV)
    overrides = small_overrides(**{"run.dir": str(run_dir), "checkpoint.every": 2, "checkpoint.keep": 10,
                                   "train.max_steps": 8})
    # (summary.json there?, the watcher's exit code) once the paused run's checkpoints 2 and 4 are evaluated
    caught_up = lambda: ((run_dir / "summary.json").exists(), watcher.poll()) if (
        run_dir / ".test_paused.rank0").exists() and (_steps(run_dir) == [2, 4] or watcher.poll() is not None) else None
    over, seen = _signal_when(caught_up, signal.SIGTERM)  # preempted: checkpoint 4 is saved again, then exit 75
    try:
        monkeypatch.setenv("NANOPT_TEST_HOOK", "pause:4")
        with contextlib.redirect_stdout(io.StringIO()) as log:
            assert main_run(overrides) == 75 and seen == [(False, None)], (seen, log.getvalue()[-3000:])
        monkeypatch.delenv("NANOPT_TEST_HOOK")
        with contextlib.redirect_stdout(io.StringIO()) as log:
            assert main_run(overrides) == 0, log.getvalue()[-3000:]
        assert f"resuming from {run_dir / 'checkpoints' / 'step_000004'}" in log.getvalue()
        out, err = watcher.communicate(timeout=300)
    finally:
        over.set()
        if watcher.poll() is None:
            watcher.kill()
            watcher.communicate()
    assert watcher.returncode == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == "the run finished at step 8; 4 checkpoint(s) evaluated by this watcher"
    assert _steps(run_dir) == [2, 4, 6, 8]  # one line per checkpoint, in order, none twice
    last = records(run_dir / "evals.jsonl")[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert last["source"] == "nanopt eval" and last["val_loss"] == pytest.approx(summary["final_val_loss"], abs=1e-6)
    # A second watcher (in this process: the watcher's process was the first) finds everything done and adds nothing.
    before = (run_dir / "evals.jsonl").read_bytes()
    capsys.readouterr()
    assert cli(["eval", str(run_dir), "--watch", "--interval", "0.2"]) == 0
    assert "0 checkpoint(s) evaluated" in capsys.readouterr().out
    assert (run_dir / "evals.jsonl").read_bytes() == before


def test_watch_skips_a_checkpoint_pruned_while_it_is_read(run_dir, monkeypatch, capsys):
    listed = watch.checkpoint_dirs

    def listed_then_pruned(root: Path) -> list[Path]:
        found = listed(root)
        if found and found[0].name == "step_000002":
            shutil.rmtree(found[0])  # what checkpoint.keep does to the oldest, right after the watcher looked
        return found

    monkeypatch.setattr(watch, "checkpoint_dirs", listed_then_pruned)
    assert cli(["eval", str(run_dir), "--watch", "--interval", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "step_000002: it was removed while being read (pruned by checkpoint.keep)" in out
    assert _steps(run_dir) == [4, 6]


@pytest.mark.slow
def test_watch_of_an_unfinished_run_stops_at_the_timeout_or_on_ctrl_c_with_one_line(sweep, tmp_path, capsys):
    for name in ("timeout", "ctrl-c"):
        shutil.copytree(sweep / "lr_high", tmp_path / name)
        (tmp_path / name / "summary.json").unlink()  # as if still training
    assert cli(["eval", str(tmp_path / "timeout"), "--watch", "--interval", "0.2", "--timeout", "1"]) == 0
    assert "--timeout 1 s passed before the run finished; 3 checkpoint(s) evaluated" in capsys.readouterr().out
    assert _steps(tmp_path / "timeout") == [2, 4, 6]
    run_dir = tmp_path / "ctrl-c"
    over, _ = _signal_when(lambda: True if len(_steps(run_dir)) == 3 else None, signal.SIGINT)
    try:
        assert cli(["eval", str(run_dir), "--watch", "--interval", "0.2"]) == 0
    finally:
        over.set()
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1] == "stopped (Ctrl-C); 3 checkpoint(s) evaluated by this watcher"
    assert "Traceback" not in err


def test_watch_refuses_what_is_not_a_run_directory(sweep, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a run")
    assert cli(["eval", str(tmp_path), "--watch"]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    assert cli(["eval", str(tmp_path / "missing"), "--watch"]) == 2
    assert cli(["eval", str(sweep / "lr_low" / "checkpoints" / "step_000006"), "--watch"]) == 2
    assert "is a checkpoint" in capsys.readouterr().err
    assert cli(["eval", str(sweep / "lr_low"), "--watch", "--interval", "0"]) == 2
    # A trainer's first file is its lock: a watcher started in that moment waits for the run (CI caught this).
    starting = tmp_path / "starting"
    starting.mkdir()
    (starting / "lock.json").write_text("{}")
    assert cli(["eval", str(starting), "--watch", "--interval", "0.05", "--timeout", "0.2"]) == 0
    assert "--timeout 0.2 s passed before the run finished" in capsys.readouterr().out
    assert [p.name for p in starting.iterdir()] == ["lock.json"]  # the watcher's own lease is gone with it


def test_a_second_watcher_is_refused_naming_the_first(run_dir, capsys):
    """Two watchers of one run evaluated every checkpoint twice (12 lines for 6 steps): the watcher's lease
    beside the trainer's lets one watch; the second exits 2 naming it. A dead watcher's lease is taken over."""
    first = DirLock(run_dir, what="watched run", filename=WATCH_LOCK_FILE).acquire()  # a live watcher: this process
    try:
        assert cli(["eval", str(run_dir), "--watch", "--interval", "0.1"]) == 2
        err = capsys.readouterr().err
        assert f"{run_dir} is already watched by process {os.getpid()}" in err and "Traceback" not in err
        assert not (run_dir / "evals.jsonl").exists()
    finally:
        first.release()
    now = time.time()
    (run_dir / WATCH_LOCK_FILE).write_text(json.dumps({
        "host": socket.gethostname(), "pid": dead_pid(), "started": now, "heartbeat": now, "token": "gone",
        "owner": "", "command": "nanopt eval --watch"}))  # a watcher killed with kill -9
    assert cli(["eval", str(run_dir), "--watch", "--interval", "0.1"]) == 0
    assert _steps(run_dir) == [2, 4, 6] and not (run_dir / WATCH_LOCK_FILE).exists()


def test_eval_appends_each_checkpoint_split_once(run_dir, capsys):
    """`nanopt eval` of weights already evaluated the same way (split, batches, precision) adds no second line;
    another batch count is another evaluation."""
    assert cli(["eval", str(run_dir)]) == 0
    assert cli(["eval", str(run_dir / "checkpoints" / "step_000006")]) == 0  # the same weights, named another way
    assert "already in" in capsys.readouterr().out.splitlines()[-1]
    assert cli(["eval", str(run_dir), "--batches", "1"]) == 0
    lines = records(run_dir / "evals.jsonl")
    assert [(r["step"], r["eval_batches"]) for r in lines] == [(6, 2), (6, 1)]
    assert lines[0]["weights_crc32"] == lines[1]["weights_crc32"] and isinstance(lines[0]["weights_crc32"], int)
