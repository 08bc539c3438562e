"""Downstream tasks during training and after: eval.tasks at its own cadence outside the training clock, `nanopt
eval --tasks/--core` into the run directory, task scores in `nanopt runs` and `nanopt compare` like any figure, and
bad input as one paragraph with exit 2."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from conftest import REPO, TASK_TEXTS, small_overrides, torchrun_started

from nanopt.cli import run as cli
from nanopt.evals import core_benchmark as core, tasks as harness
from nanopt.evals.taskgen import make_tasks
from nanopt.lab.runs import runs_report
from nanopt.main import run as main_run

pytestmark = pytest.mark.usefixtures("offline")  # conftest: no hub


def evals(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tasks_are_scored_at_their_cadence_outside_the_training_clock(tmp_path, task_dir, monkeypatch):
    real, real_clock, shift = harness.score_model, time.perf_counter, [0.0]

    def slow_scoring(*args, **kwargs):  # scoring that takes 1,000 s more: none of it may reach the training clock
        shift[0] += 1000.0  # on a clock that jumps instead of a sleep: the same seconds, none of them waited
        return real(*args, **kwargs)

    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + shift[0])  # what both clocks read
    monkeypatch.setattr(harness, "score_model", slow_scoring)
    run_dir = tmp_path / "run"
    assert main_run(small_overrides(**{"run.dir": run_dir, "train.max_steps": 8, "eval.tasks": "nanopt_mc",
                                       "eval.tasks_path": task_dir, "eval.core": task_dir / "core",
                                       "eval.tasks_every": 4, "eval.tasks_limit": 5})) == 0
    records = evals(run_dir)
    assert sorted({(r["step"], r["task"]) for r in records if r["task"] in ("nanopt_mc", "core")}) == [
        (4, "core"), (4, "nanopt_mc"), (8, "core"), (8, "nanopt_mc")]
    mc = [r for r in records if r["task"] == "nanopt_mc"]
    assert all(r["source"] == "train" and r["samples"] == 5 and 0 <= r["scores"]["acc"] <= 1 for r in mc)
    assert {r["task"] for r in records} >= {"core", *(f"core/{t.label}" for t in core.read_bundle(task_dir / "core"))}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tasks_seconds"] >= 2000  # two scoring passes of at least 1,000 s each, reported ...
    assert summary["train_seconds"] < 1000  # ... and not billed to training (8 real steps take seconds)
    # Neutral: the same run without tasks ends with the same weights (the harness's reseeding is undone).
    plain = tmp_path / "plain"
    assert main_run(small_overrides(**{"run.dir": plain, "train.max_steps": 8})) == 0
    assert json.loads((plain / "summary.json").read_text())["weights_sha256_per_rank"] == \
        summary["weights_sha256_per_rank"]


def _empty_task_file(tmp_path: Path, task_dir: Path) -> dict:
    make_tasks(tmp_path / "tasks", TASK_TEXTS, n=12)
    (tmp_path / "tasks" / "nanopt_mc.jsonl").write_text("")
    return {"eval.tasks": "nanopt_mc", "eval.tasks_path": tmp_path / "tasks"}


def _baseline_100(tmp_path: Path, task_dir: Path) -> dict:
    bundle = shutil.copytree(task_dir / "core", tmp_path / "bundle")
    (bundle / "eval_meta_data.csv").write_text((bundle / "eval_meta_data.csv").read_text().replace("25.0", "100"))
    return {"eval.core": bundle}


REFUSED = {  # what scoring would trip over at the end, found at the start: (the run's task keys, words of its error)
    "unknown task": (lambda tmp, tasks: {"eval.tasks": "nanopt_mc,no_such_task", "eval.tasks_path": tasks},
                     "no_such_task"),
    "missing bundle": (lambda tmp, tasks: {"eval.core": tmp / "missing"}, "`eval.core`"),
    "empty task file": (_empty_task_file, "nanopt_mc.jsonl has no rows"),
    "baseline 100": (_baseline_100, "eval_meta_data.csv:2"),
}


@pytest.mark.slow  # lm-eval indexes its tasks for seconds
@pytest.mark.parametrize("case", list(REFUSED))
def test_tasks_that_cannot_be_scored_are_refused_before_the_first_step(tmp_path, task_dir, capsys, case):
    keys, words = REFUSED[case]
    assert main_run(small_overrides(**{"run.dir": tmp_path / "run", **keys(tmp_path, task_dir)})) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_each_scoring_step_is_saved_before_it_scores_and_a_failure_is_recorded(tmp_path, task_dir, monkeypatch,
                                                                               capsys):
    """Scoring is an evaluation: the step it scores is on disk before it starts (checkpoint.every aside), and a
    failure in it is a warning and a record, after which training goes on and scores again."""
    run_dir, real, seen = tmp_path / "run", harness.score_model, []

    def scoring(model, tokenizer, rt, spec, step, source, **kwargs):
        seen.append((step, (run_dir / "checkpoints" / f"step_{step:06d}" / "COMPLETE").is_file(), rt.world_size))
        if step == 2:
            raise RuntimeError("the harness fell over")
        return real(model, tokenizer, rt, spec, step, source, **kwargs)

    monkeypatch.setattr(harness, "score_model", scoring)
    assert main_run(small_overrides(**{"run.dir": run_dir, "eval.core": task_dir / "core", "eval.tasks_every": 2,
                                       "eval.tasks_limit": 4, "checkpoint.every": 1000})) == 0
    assert seen == [(2, True, 1), (4, True, 1), (6, True, 1)]
    failed, *scored = [r for r in evals(run_dir) if r["task"] == "core"]
    assert (failed["step"], failed["error"], failed["scores"]) == (2, "RuntimeError: the harness fell over", {})
    assert [(r["step"], "error" in r) for r in scored] == [(4, False), (6, False)]
    out = capsys.readouterr()
    assert "step      2 | core not scored, training goes on: RuntimeError: the harness fell over" in out.out + out.err
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6


@pytest.mark.slow
def test_task_data_removed_during_the_run_costs_no_step(tmp_path, monkeypatch, capsys):
    """The issue's case: eval.tasks data removed after the start, scoring after the last step fails. The last
    step's checkpoint is saved first, the failure is recorded naming the task and the file, and the run ends 0."""
    tasks, run_dir, real = tmp_path / "tasks", tmp_path / "run", harness.score_model
    make_tasks(tasks, TASK_TEXTS, n=12)

    def data_removed_meanwhile(*args, **kwargs):
        (tasks / "nanopt_mc.jsonl").unlink(missing_ok=True)
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "score_model", data_removed_meanwhile)
    assert main_run(small_overrides(**{"run.dir": run_dir, "checkpoint.every": 4, "eval.tasks": "nanopt_mc",
                                       "eval.tasks_path": tasks, "eval.tasks_limit": 4})) == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000004", "step_000006"]
    (record,) = evals(run_dir)
    assert (record["task"], record["step"], record["source"], record["scores"]) == ("nanopt_mc", 6, "train", {})
    assert "nanopt_mc.jsonl" in record["error"] and "Unable to find" in record["error"]
    out = capsys.readouterr()
    assert "nanopt_mc not scored, training goes on" in out.out + out.err
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6


OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}  # what `offline` sets, for processes started before it


@pytest.fixture(scope="module", autouse=True)
def two_rank_runs(request, tmp_path_factory, task_dir) -> Iterator[dict[str, tuple[Path, Callable]]]:
    """The ddp and the fsdp run of test_two_ranks_score_..., started before this file's first test when that test
    is to run, so that they train beside the tests in this process: name -> (its run directory, what waits for it).
    A run not waited for (a test's deadline passed first) is killed, not left running."""
    wanted = any(item.path == request.path and item.originalname.startswith("test_two_ranks_")
                 for item in request.session.items)
    runs = {name: _two_ranks_losing_their_task_data(tmp_path_factory.mktemp(name), task_dir, **extra) for name, extra
            in (("ddp", {}), ("fsdp", {"runtime.parallel": "fsdp", "train.precision": "fp32"}))} if wanted else {}
    yield runs
    for _, finished in runs.values():
        with contextlib.suppress(Exception):
            finished(timeout=0)


@pytest.mark.slow
def test_two_ranks_score_and_survive_a_scoring_failure_under_ddp_and_fsdp(two_rank_runs, task_dir):
    """Under ddp the main rank scores alone while the other waits: CORE (which gathers over ranks when all of them
    score) must not wait for ranks that are not scoring, and a failing task must not leave them waiting. Under fsdp
    every rank scores (each forward gathers weights from both) and the main rank records: the task data removed
    during the run fails nanopt_mc on every rank alike, recorded once per scoring, and CORE goes on; its step-40
    scores are those `nanopt eval` computes in one process from the step-40 checkpoint. Each run has a deadline: no
    hang."""
    (ddp_dir, ddp_end), (run_dir, fsdp_end) = two_rank_runs["ddp"], two_rank_runs["fsdp"]
    for proc in [ddp_end(timeout=240), fsdp_end(timeout=240)]:  # each killed at its deadline
        assert proc.returncode == 0, proc.stderr[-3000:]
    ddp, records = evals(ddp_dir), evals(run_dir)
    for rows in (ddp, records):
        assert sorted((r["step"], r["task"]) for r in rows if "error" in r) == [(20, "nanopt_mc"), (40, "nanopt_mc")]
        assert sorted(r["step"] for r in rows if r["task"] == "core" and "error" not in r) == [20, 40]
    assert {p.name for p in (ddp_dir / "checkpoints").glob("step_*")} == {"step_000020", "step_000040"}
    assert all("nanopt_mc.jsonl" in r["error"] and "Unable to find" in r["error"] for r in records if "error" in r)
    trained = {r["task"]: r["scores"] for r in records if r["step"] == 40 and r["task"].startswith("core")}
    assert len(trained) > 1 and sorted(r["step"] for r in records if r["task"] == "core") == [20, 40]
    scored, _ = harness.score_checkpoint(run_dir / "checkpoints" / "step_000040",
                                         harness.TaskSpec([], None, 4, None, str(task_dir / "core")))
    assert {r["task"]: r["scores"] for r in scored} == trained


def _two_ranks_losing_their_task_data(tmp_path: Path, task_dir: Path, **extra) -> tuple[Path, Callable]:
    """A 2-rank torchrun of 40 steps scoring nanopt_mc and CORE every 20, whose nanopt_mc data is removed after its
    first step, started in the background: its run directory, and what waits for it (torchrun_started)."""
    tasks, run_dir = tmp_path / "tasks", tmp_path / "run"
    make_tasks(tasks, TASK_TEXTS, n=12)
    remover = threading.Thread(target=_remove_after_the_first_step, args=(run_dir, tasks), daemon=True)
    remover.start()
    return run_dir, torchrun_started(2, small_overrides(**{
        "run.dir": run_dir, "train.max_steps": 40, "eval.tasks_every": 20, "checkpoint.every": 1000,
        "eval.tasks": "nanopt_mc", "eval.tasks_path": tasks, "eval.core": task_dir / "core", "eval.tasks_limit": 4,
        "log.every": 1, **extra}), env=OFFLINE)


def _remove_after_the_first_step(run_dir: Path, tasks: Path) -> None:
    """The task data goes away while the run trains."""
    deadline, metrics = time.monotonic() + 240, run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and not (metrics.is_file() and '"loss"' in metrics.read_text()):
        time.sleep(0.05)
    (tasks / "nanopt_mc.jsonl").unlink()


@pytest.mark.slow
def test_eval_tasks_on_runs_then_runs_and_compare_show_them_and_lm_evals_own_cli_runs_model_nanopt(tmp_path, task_dir,
                                                                                                    capsys):
    """Two seeds scored by `nanopt eval`, then `nanopt runs` and `compare`; meanwhile `--model nanopt` in lm-eval's own
    command line (python -m nanopt.evals.tasks registers it first) on the first run, in a process beside the rest
    (torch, lm-eval and the index of its ~14,000 task YAMLs: about 11 s of one core)."""
    runs = [tmp_path / "sweep" / f"s{seed}" for seed in (1, 2)]
    assert main_run(small_overrides(**{"run.dir": runs[0], "run.seed": 1})) == 0
    with (tmp_path / "out").open("w") as out, (tmp_path / "err").open("w") as err:
        lm_eval_cli = subprocess.Popen([
            sys.executable, "-m", "nanopt.evals.tasks", "run", "--model", "nanopt", "--model_args",
            f"path={runs[0]},precision=fp32", "--tasks", "nanopt_mc", "--include_path", str(task_dir), "--limit", "6",
            "--batch_size", "4"], stdout=out, stderr=err, text=True, cwd=REPO, env={**os.environ, **OFFLINE})
    try:
        assert main_run(small_overrides(**{"run.dir": runs[1], "run.seed": 2})) == 0
        for run_dir in runs:
            capsys.readouterr()  # the training log
            assert cli(["eval", str(run_dir), "--tasks", "nanopt_mc", "--include-path", str(task_dir), "--core",
                        str(task_dir / "core"), "--limit", "6", "--json"]) == 0
            out = capsys.readouterr().out  # log lines first when an earlier run in this process set up logging
            printed = json.loads(out[out.index("[\n"):])
            assert {r["task"] for r in printed} >= {"nanopt_mc", "core"} and printed[0]["step"] == 6
            assert [r["task"] for r in evals(run_dir)] == [r["task"] for r in printed]
        (group,) = runs_report(tmp_path / "sweep")["groups"]
        assert group["stats"]["task:nanopt_mc/acc"]["n"] == 2 and "task:core/core" in group["stats"]
        for command in (["runs", str(tmp_path / "sweep")], ["compare", *map(str, runs)]):
            assert cli(command) == 0
            assert "nanopt_mc/acc" in capsys.readouterr().out
        assert lm_eval_cli.wait(timeout=300) == 0, (tmp_path / "err").read_text()[-3000:]
    finally:
        lm_eval_cli.kill()  # a no-op once it has exited
        lm_eval_cli.wait()
    assert "nanopt_mc" in (out := (tmp_path / "out").read_text()) and "acc" in out


@pytest.mark.slow
def test_the_cpu_speedrun_learns_the_generated_task(tmp_path, capsys):
    """The speedrun recipe on the embedded corpus, shortened to 40 steps (its schedule follows), scored by the
    harness on held-out plays it never trained on: above chance (25%) with a 95% interval that excludes it, and
    better at the end than at step 20, the end of its warm-up (0.33 at step 20, 0.43 +- 0.035 at step 40 on
    2026-11-27: both bars cleared by about 3 standard errors; 100 steps reach 0.61 and cost 2.5 times as much)."""
    make_tasks(tmp_path / "tasks", n=200)
    run_dir = tmp_path / "speedrun"
    assert main_run(["--config", "configs/speedrun-cpu.yaml", f"--run.dir={run_dir}", "--checkpoint.every=20",
                     "--checkpoint.keep=10", "--log.curves=false", "--train.max_steps=40"]) == 0
    scores = {}
    for step in (20, 40):
        capsys.readouterr()
        assert cli(["eval", str(run_dir / "checkpoints" / f"step_{step:06d}"), "--tasks", "nanopt_mc",
                    "--include-path", str(tmp_path / "tasks"), "--json"]) == 0
        out = capsys.readouterr().out
        (record,) = json.loads(out[out.index("[\n"):])
        assert record["samples"] == 200 and record["step"] == step
        scores[step] = (record["scores"]["acc"], record["stderr"]["acc"])
    (early, _), (final, stderr) = scores[20], scores[40]
    assert final - 1.96 * stderr > 0.25, scores
    assert final > early, scores
