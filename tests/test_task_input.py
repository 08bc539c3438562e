"""Bad task and bundle input to `nanopt eval --tasks/--core`: every broken file is one paragraph naming it (and the
line), exit 2, no traceback; whatever the harness still raises on a task's data is caught where nanopt calls it;
a bundle reads only its own files; bad flags are refused; and each (checkpoint, task) is written once."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import small_overrides
from nanopt import harness
from nanopt.cli import run as cli
from nanopt.config import ModelConfig
from nanopt.errors import ConfigError
from nanopt.main import run as main_run
from nanopt.model import build_model
from nanopt.runtime import Runtime
from nanopt.taskgen import make_tasks, write_bundle
from test_tasks_train import TEXTS

pytestmark = pytest.mark.usefixtures("offline")  # conftest: no hub


def rows_text(root: Path) -> str:
    return (root / "nanopt_mc.jsonl").read_text()


def edit_row(text: str, line: int, old: str, new: str) -> str:
    """The JSONL text with `old` replaced by `new` in its line `line` (1-based) only."""
    lines = text.split("\n")
    assert old in lines[line - 1]
    lines[line - 1] = lines[line - 1].replace(old, new, 1)
    return "\n".join(lines)


def add_task(root: Path, name: str, data: str | None) -> None:
    """A copy of the generated multiple-choice task under another name, reading `data` (None: no file)."""
    spec = yaml.safe_load((root / "nanopt_mc.yaml").read_text())
    spec["task"] = name
    spec["dataset_kwargs"]["data_files"]["test"] = str(root / f"{name}.jsonl")
    (root / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    if data is not None:
        (root / f"{name}.jsonl").write_text(data)


# What is broken -> (the task's data, given the good rows; what the paragraph must name)
BROKEN = {
    "bad_json": (lambda t: edit_row(t, 2, "{", "{oops "), ["bad_json.jsonl:2 is not JSON"]),
    "bad_empty": (lambda t: "", ["bad_empty.jsonl has no rows"]),
    "bad_gold": (lambda t: edit_row(t, 3, '"gold": ', '"gold": 9'), ["bad_gold.jsonl:3", "not one of its 4 choices"]),
    "bad_gold_first": (lambda t: edit_row(t, 1, '"gold": ', '"gold": 9'), ["bad_gold_first.jsonl:1", "IndexError"]),
    "bad_context": (lambda t: t.replace('"context"', '"ctx"'), ["bad_context.jsonl:1", "'context' is undefined"]),
    "bad_row_context": (lambda t: edit_row(t, 2, '"context"', '"ctx"'), ["bad_row_context.jsonl:2", "no context"]),
    "bad_missing": (None, ["bad_missing.jsonl does not exist"]),
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The generated tasks, a broken copy of nanopt_mc per BROKEN case, a group holding one, and a CORE bundle."""
    root = tmp_path_factory.mktemp("tasks")
    make_tasks(root, TEXTS, n=12)
    good = rows_text(root)
    for name, (breaks, _) in BROKEN.items():
        add_task(root, name, breaks(good) if breaks else None)
    (root / "bad_group.yaml").write_text(yaml.safe_dump({"group": "bad_group", "task": ["nanopt_rolling", "bad_json"],
                                                         "metadata": {"version": 1.0}}))
    write_bundle(root / "bundle", TEXTS, n=12)
    return root


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    assert main_run(small_overrides(**{"run.dir": out})) == 0
    return out


def error_line(err: str, command: str = "eval") -> str:
    """The one paragraph the CLI printed for bad input (the harness's own log lines may precede it)."""
    assert "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith(f"nanopt {command}: error:")]
    return line


@pytest.mark.parametrize("name", [*BROKEN, "bad_group"])
def test_broken_task_data_is_one_paragraph_naming_the_file_and_line(name, task_dir, run_dir, capsys):
    assert cli(["eval", str(run_dir), "--tasks", name, "--include-path", str(task_dir), "--limit", "4"]) == 2
    line = error_line(capsys.readouterr().err)
    for word in BROKEN[name if name != "bad_group" else "bad_json"][1]:
        assert word in line, line
    assert not (run_dir / "evals.jsonl").exists()  # nothing scored, nothing recorded


def test_a_harness_failure_on_task_data_is_caught_at_the_boundary(task_dir, monkeypatch):
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
        harness.evaluate_tasks(lm, ["nanopt_mc"], str(task_dir))
    monkeypatch.setattr(lm_eval, "simple_evaluate", fails(StopIteration()))
    with pytest.raises(ConfigError, match="no rows"):
        harness.evaluate_tasks(lm, ["nanopt_mc"], str(task_dir))
    monkeypatch.setattr(lm_eval, "simple_evaluate", fails(RuntimeError("CUDA error")))
    with pytest.raises(RuntimeError, match="CUDA error"):
        harness.evaluate_tasks(lm, ["nanopt_mc"], str(task_dir))


def _tiny_model() -> torch.nn.Module:
    return build_model(ModelConfig(vocab_size=257, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                   max_seq_len=64))


# ---------------------------------------------------------------- CORE bundles


def _broken_bundle(task_dir: Path, tmp_path: Path, old: str, new: str, name: str = "eval_meta_data.csv") -> Path:
    bundle = tmp_path / "bundle"
    shutil.copytree(task_dir / "bundle", bundle)
    path = bundle / name
    path.write_text(path.read_text().replace(old, new, 1))
    return bundle


@pytest.mark.parametrize("baseline", ["100", "100.0", "nan", "150", "-10", "inf"])
def test_a_baseline_outside_0_to_100_is_refused_naming_the_line(baseline, task_dir, run_dir, tmp_path, capsys):
    bundle = _broken_bundle(task_dir, tmp_path, "25.0", baseline)
    assert cli(["eval", str(run_dir), "--core", str(bundle)]) == 2
    line = error_line(capsys.readouterr().err)
    assert "eval_meta_data.csv:2" in line and "nanopt_line_end" in line and repr(baseline) in line, line


@pytest.mark.parametrize("uri", ["../../elsewhere/x.jsonl", "ABSOLUTE"])
def test_a_dataset_uri_outside_the_bundle_is_not_read(uri, task_dir, run_dir, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere" / "x.jsonl"  # a good task file, but not the bundle's
    elsewhere.parent.mkdir()
    shutil.copy(task_dir / "bundle" / "eval_data" / "nanopt_line_end.jsonl", elsewhere)
    uri = str(elsewhere) if uri == "ABSOLUTE" else uri
    bundle = _broken_bundle(task_dir, tmp_path, "nanopt_line_end.jsonl", uri, "core.yaml")
    assert (bundle / "eval_data" / uri).resolve() == elsewhere.resolve()  # it would be read without the check
    assert cli(["eval", str(run_dir), "--core", str(bundle)]) == 2
    line = error_line(capsys.readouterr().err)
    assert "core.yaml" in line and "dataset_uri" in line and "leaves the bundle" in line, line


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize("args, words", [
    (["--tasks", "nanopt_mc", "--num-fewshot", "-1"], ["--num-fewshot -1", "0 or more"]),
    (["--tasks", ","], ["--tasks ','", "names no task"]),
    (["--tasks", " , ", "--core", "x"], ["names no task"]),
])
def test_bad_task_flags_are_refused(args, words, run_dir, capsys):
    assert cli(["eval", str(run_dir), *args]) == 2
    line = error_line(capsys.readouterr().err)
    assert all(w in line for w in words), line


@pytest.mark.parametrize("effect", ["nan", "inf", "-inf", "0", "-0.5"])
def test_runs_compare_effect_must_be_finite_and_positive(effect, tmp_path, capsys):
    assert cli(["runs", str(tmp_path), "--compare", "a", "b", f"--effect={effect}"]) == 2
    assert f"--effect {float(effect)}" in error_line(capsys.readouterr().err, "runs")


# ---------------------------------------------------------------- each (checkpoint, task) once


def test_eval_writes_each_checkpoint_task_once(task_dir, run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    bundle = str(task_dir / "bundle")
    assert cli(["eval", str(run), "--core", bundle, "--limit", "6"]) == 0
    first = (run / "evals.jsonl").read_text()
    assert cli(["eval", str(run), "--core", bundle, "--limit", "6"]) == 0  # the same weights, tasks and limit
    assert "already in evals.jsonl from the same weights; not appended again" in capsys.readouterr().out
    assert (run / "evals.jsonl").read_text() == first
    assert cli(["eval", str(run / "checkpoints" / "step_000006"), "--core", bundle, "--limit", "6"]) == 0
    assert (run / "evals.jsonl").read_text() == first  # the same checkpoint named another way
    assert cli(["eval", str(run), "--core", bundle, "--limit", "8"]) == 0  # another evaluation: recorded
    records = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert sorted({(r["task"], r["limit"]) for r in records if r["task"] == "core"}) == [("core", 6), ("core", 8)]
    assert len(records) == 2 * 4 and all(isinstance(r["weights_crc32"], int) for r in records)


def test_eval_core_needs_no_lm_eval(task_dir, run_dir, tmp_path, monkeypatch, capsys):
    """CORE never uses lm-eval: `nanopt eval RUN --core DIR` loads and scores the model with lm_eval unimportable;
    only --tasks asks for it (one paragraph, exit 2)."""
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` (and lm_eval.anything) raises ImportError
    monkeypatch.setattr(harness, "_LM", None)  # the NanoptLM class an earlier test made is lm-eval's subclass
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    assert cli(["eval", str(run), "--core", str(task_dir / "bundle"), "--limit", "6"]) == 0
    records = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert {r["task"] for r in records} >= {"core"} and all("error" not in r for r in records)
    assert cli(["eval", str(run), "--tasks", "nanopt_mc", "--include-path", str(task_dir)]) == 2
    assert "need lm-evaluation-harness" in error_line(capsys.readouterr().err)
