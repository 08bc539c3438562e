"""Every record nanopt writes names the weights that produced it, as loaded (never as configured): validation and
test records, task and CORE scores in training and from `nanopt eval`, summary.json, export's nanopt.json, an
average's evaluations and exports; a checkpoint that should hold averaged weights and does not is damage."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import error_line, small_overrides

from nanopt import cli, rundirs
from nanopt.main import run

ARGS = small_overrides(**{"train.precision": "fp32", "train.max_steps": 6, "checkpoint.every": 2,
                          "checkpoint.keep": 4, "eval.every": 2, "log.tensorboard": "false",
                          "train.ema_decay": 0.5, "train.ema_start": 3, "eval.weights": "ema",
                          "eval.tasks_every": 2, "eval.tasks_limit": 4})


def _ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / rundirs.CHECKPOINTS_DIR / f"step_{step:06d}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, task_dir) -> Path:
    """A 6-step run whose average starts at step 3 and is what it evaluates, CORE-scored every 2 steps."""
    run_dir = tmp_path_factory.mktemp("records") / "run"
    assert run([*ARGS, f"--eval.core={task_dir / 'core'}", f"--run.dir={run_dir}"]) == 0
    return run_dir


def test_every_record_of_a_run_its_evaluations_exports_and_averages_names_its_weights(trained, task_dir, tmp_path,
                                                                                      capsys):
    metrics = rundirs.read_metrics(trained)
    assert [(r["step"], r["weights"]) for r in metrics if "val_loss" in r or "test_loss" in r] == \
        [(0, "model"), (2, "model"), (4, "ema"), (6, "ema")] + ([(6, "ema")] if any("test_loss" in r for r in metrics)
                                                                else [])
    # Task scores during training: the validation's weights (the model's before ema_start, the average's after).
    training = [r for r in rundirs.read_records(trained / rundirs.EVALS_FILE) if r["source"] == "train"]
    assert {(r["step"], r["weights"]) for r in training} == {(2, "model"), (4, "ema"), (6, "ema")}
    assert json.loads((trained / rundirs.SUMMARY_FILE).read_text())["eval_weights"] == "ema"

    assert cli.run(["eval", str(trained)]) == 0
    assert cli.run(["eval", str(trained), "--weights", "model", "--core", str(task_dir / "core"),
                    "--limit", "4"]) == 0
    made = [r for r in rundirs.read_records(trained / rundirs.EVALS_FILE) if r["source"] == "nanopt eval"]
    assert [r["weights"] for r in made if "val_loss" in r] == ["ema"]
    assert {r["weights"] for r in made if "task" in r} == {"model"}
    assert cli.run(["export", str(trained), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "nanopt.json").read_text())["weights"] == "ema"

    # An average reads as what it is, in everything made from it.
    avg = tmp_path / "avg"
    assert cli.run(["average", str(trained), "--steps", "2,4,6", "--out", str(avg)]) == 0
    name = f"average of steps 2,4,6 of {trained.resolve()}"
    assert cli.run(["eval", str(avg)]) == 0
    (record,) = rundirs.read_records(avg / rundirs.EVALS_FILE)
    assert record["weights"] == name and [c["step"] for c in record["averaged_from"]["checkpoints"]] == [2, 4, 6]
    assert cli.run(["export", str(avg), "--out", str(tmp_path / "avg_hf")]) == 0
    meta = json.loads((tmp_path / "avg_hf" / "nanopt.json").read_text())
    assert meta["weights"] == name and meta["averaged_from"] == record["averaged_from"]
    capsys.readouterr()
    assert cli.run(["sample", str(avg), "-n", "1", "--max-new-tokens", "4"]) == 0
    assert f"({name} weights)" in capsys.readouterr().out
    # `--weights ema` of an average: refused for what it is, not as a checkpoint from before train.ema_start.
    assert cli.run(["eval", str(avg), "--weights", "ema"]) == 2
    line = error_line(capsys.readouterr().err)
    assert "is an average of checkpoints" in line and name in line and "ema_start" not in line, line


def test_a_checkpoint_missing_the_average_its_state_says_it_kept_is_damage_not_the_models_weights(trained, tmp_path,
                                                                                                  capsys):
    ckpt = tmp_path / "step_000004"
    shutil.copytree(_ckpt(trained, 4), ckpt)
    (ckpt / rundirs.EMA_FILE).unlink()  # and from its manifest, so that the checkpoint verifies
    manifest = json.loads((ckpt / rundirs.COMPLETE_FILE).read_text())
    del manifest["files"][rundirs.EMA_FILE]
    (ckpt / rundirs.COMPLETE_FILE).write_text(json.dumps(manifest))
    for weights in ("run", "ema"):
        assert cli.run(["eval", str(ckpt), "--weights", weights]) == 2
        line = error_line(capsys.readouterr().err)
        assert str(ckpt / rundirs.EMA_FILE) in line and "damaged" in line, line
    assert cli.run(["eval", str(ckpt), "--weights", "model"]) == 0  # the model's own weights are still there
    # A checkpoint from before train.ema_start holds none by design: the run's weights are the model's.
    assert cli.run(["eval", str(_ckpt(trained, 2))]) == 0


def test_a_run_whose_average_never_started_says_its_figures_are_the_models(tmp_path):
    run_dir = tmp_path / "late"
    args = small_overrides(**{"train.precision": "fp32", "train.max_steps": 2, "log.tensorboard": "false",
                              "train.ema_decay": 0.5, "train.ema_start": 100, "eval.weights": "ema"})
    assert run([*args, f"--run.dir={run_dir}"]) == 0
    assert {r["weights"] for r in rundirs.read_metrics(run_dir) if "val_loss" in r} == {"model"}
    assert json.loads((run_dir / rundirs.SUMMARY_FILE).read_text())["eval_weights"] == "model"
