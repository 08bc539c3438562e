"""Bad task and bundle input to `nanopt eval --tasks/--core` on a trained run: every broken file is one paragraph
naming it (and the line), exit 2, no traceback; a bundle reads only its own files; bad flags are refused; and each
(checkpoint, task) is written once."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import BROKEN, error_line, small_overrides
from nanopt import harness
from nanopt.cli import run as cli
from nanopt.errors import ConfigError
from nanopt.main import run as main_run

pytestmark = pytest.mark.usefixtures("offline")  # conftest: no hub


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    assert main_run(small_overrides(**{"run.dir": out})) == 0
    return out


@pytest.mark.slow  # lm-eval indexes its tasks for seconds
@pytest.mark.parametrize("name", [*BROKEN, "bad_group"])
def test_broken_task_data_is_one_paragraph_naming_the_file_and_line(name, broken_task_dir, run_dir, capsys):
    assert cli(["eval", str(run_dir), "--tasks", name, "--include-path", str(broken_task_dir), "--limit", "4"]) == 2
    line = error_line(capsys.readouterr().err)
    for word in BROKEN[name if name != "bad_group" else "bad_json"][1]:
        assert word in line, line
    assert not (run_dir / "evals.jsonl").exists()  # nothing scored, nothing recorded


class _UnreachableHubTasks:
    """lm-eval's TaskManager as it stands on a machine without network: it knows hellaswag (its index is local) and
    loading it raises what datasets raises for a hub dataset that is not cached."""

    def __init__(self, include_path=None):
        cfg = {"task": "hellaswag", "dataset_path": "Rowan/hellaswag", "output_type": "multiple_choice"}
        self.task_index = {"hellaswag": SimpleNamespace(cfg=cfg, yaml_path=Path("hellaswag/hellaswag.yaml"))}
        self.offline_when_built = os.environ.get("HF_DATASETS_OFFLINE")

    def match_tasks(self, names):
        return [n for n in names if n in self.task_index]

    def load(self, names):
        raise ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub (OfflineModeIsEnabled)")


def test_a_hub_task_without_network_is_one_paragraph_naming_the_offline_fix(unreachable_hub, run_dir, monkeypatch,
                                                                             capsys):
    """`nanopt eval RUN --tasks hellaswag` offline, and a run with `eval.tasks: hellaswag` (the check before its
    first step): one paragraph naming the task, its data, why and the offline fix, exit 2; offline mode was on
    before lm-eval's task module loaded, so nothing waited on retries."""
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", _UnreachableHubTasks)
    monkeypatch.setattr(harness, "_MANAGERS", {})
    assert cli(["eval", str(run_dir), "--tasks", "hellaswag"]) == 2
    line = error_line(capsys.readouterr().err)
    for words in ("lm-eval task hellaswag (its data: Rowan/hellaswag)", unreachable_hub, "not in the local cache",
                  "--tasks hellaswag --limit 1", "HF_DATASETS_OFFLINE=1", "--make-tasks", "--core"):
        assert words in line, line
    assert harness._MANAGERS[None].offline_when_built == "1"
    assert not (run_dir / "evals.jsonl").exists()
    with pytest.raises(ConfigError) as raised:  # what training checks before its first step (TaskScorer)
        harness.check_tasks(harness.TaskSpec(["hellaswag"]))
    assert str(raised.value) == line.removeprefix("nanopt eval: error: ")


# ---------------------------------------------------------------- CORE bundles


def _broken_bundle(broken_task_dir: Path, tmp_path: Path, old: str, new: str, name: str = "eval_meta_data.csv") -> Path:
    bundle = tmp_path / "bundle"
    shutil.copytree(broken_task_dir / "bundle", bundle)
    path = bundle / name
    path.write_text(path.read_text().replace(old, new, 1))
    return bundle


@pytest.mark.parametrize("baseline", ["100", "100.0", "nan", "150", "-10", "inf"])
def test_a_baseline_outside_0_to_100_is_refused_naming_the_line(baseline, broken_task_dir, run_dir, tmp_path, capsys):
    bundle = _broken_bundle(broken_task_dir, tmp_path, "25.0", baseline)
    assert cli(["eval", str(run_dir), "--core", str(bundle)]) == 2
    line = error_line(capsys.readouterr().err)
    assert "eval_meta_data.csv:2" in line and "nanopt_line_end" in line and repr(baseline) in line, line


@pytest.mark.parametrize("uri", ["../../elsewhere/x.jsonl", "ABSOLUTE"])
def test_a_dataset_uri_outside_the_bundle_is_not_read(uri, broken_task_dir, run_dir, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere" / "x.jsonl"  # a good task file, but not the bundle's
    elsewhere.parent.mkdir()
    shutil.copy(broken_task_dir / "bundle" / "eval_data" / "nanopt_line_end.jsonl", elsewhere)
    uri = str(elsewhere) if uri == "ABSOLUTE" else uri
    bundle = _broken_bundle(broken_task_dir, tmp_path, "nanopt_line_end.jsonl", uri, "core.yaml")
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


# ---------------------------------------------------------------- each (checkpoint, task) once


def test_eval_writes_each_checkpoint_task_once(broken_task_dir, run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    bundle = str(broken_task_dir / "bundle")
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


def test_eval_core_needs_no_lm_eval(broken_task_dir, run_dir, tmp_path, monkeypatch, capsys):
    """CORE never uses lm-eval: `nanopt eval RUN --core DIR` loads and scores the model with lm_eval unimportable;
    only --tasks asks for it (one paragraph, exit 2)."""
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` (and lm_eval.anything) raises ImportError
    monkeypatch.setattr(harness, "_LM", None)  # the NanoptLM class an earlier test made is lm-eval's subclass
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    assert cli(["eval", str(run), "--core", str(broken_task_dir / "bundle"), "--limit", "6"]) == 0
    records = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert {r["task"] for r in records} >= {"core"} and all("error" not in r for r in records)
    assert cli(["eval", str(run), "--tasks", "nanopt_mc", "--include-path", str(broken_task_dir)]) == 2
    assert "need lm-evaluation-harness" in error_line(capsys.readouterr().err)
