"""Task input (nanopt/taskinput.py) met before a model is scored: what the harness still raises on a task's data is
caught where nanopt calls it, and `nanopt eval --tasks/--core` refuses a missing run or a broken bundle. Bad task
input against a trained run: e2e/test_bad_task_input.py."""
from __future__ import annotations

import pytest
import torch

from nanopt import harness
from nanopt.cli import run as cli
from nanopt.config import ModelConfig
from nanopt.errors import ConfigError
from nanopt.model import build_model
from nanopt.runtime import Runtime

pytestmark = pytest.mark.usefixtures("offline")  # conftest: no hub


def test_a_harness_failure_on_task_data_is_caught_at_the_boundary(broken_task_dir, monkeypatch):
    """What the harness raises on data while it scores (past nanopt's checks) is bad input naming the task and its
    file; a failure of the model or device (a RuntimeError) is not, and passes unchanged."""
    import datasets.exceptions
    import lm_eval

    lm = harness.lm_class()(model=_tiny_model(), tokenizer="byte", rt=Runtime("cpu", torch.device("cpu"), 0, 0, 1, 1,
                                                                             "fp32"))

    def fails(error: BaseException):
        def simple_evaluate(**kwargs):
            raise error
        return simple_evaluate

    monkeypatch.setattr(lm_eval, "simple_evaluate", fails(datasets.exceptions.DatasetGenerationError("generation")))
    with pytest.raises(ConfigError, match=r"nanopt_mc.*nanopt_mc\.jsonl.*DatasetGenerationError"):
        harness.evaluate_tasks(lm, ["nanopt_mc"], str(broken_task_dir))
    monkeypatch.setattr(lm_eval, "simple_evaluate", fails(StopIteration()))
    with pytest.raises(ConfigError, match="no rows"):
        harness.evaluate_tasks(lm, ["nanopt_mc"], str(broken_task_dir))
    monkeypatch.setattr(lm_eval, "simple_evaluate", fails(RuntimeError("CUDA error")))
    with pytest.raises(RuntimeError, match="CUDA error"):
        harness.evaluate_tasks(lm, ["nanopt_mc"], str(broken_task_dir))


def _tiny_model() -> torch.nn.Module:
    return build_model(ModelConfig(vocab_size=257, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                   max_seq_len=64))


def test_eval_tasks_bad_input_is_exit_2(tmp_path, task_dir, capsys):
    assert cli(["eval", str(tmp_path / "nothing"), "--tasks", "nanopt_mc", "--include-path", str(task_dir)]) == 2
    assert "does not exist" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "core.yaml").write_text("icl_tasks: [")
    assert cli(["eval", str(tmp_path), "--core", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip()
