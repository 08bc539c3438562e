"""Bad task and bundle input to `nanopt eval --tasks/--core` on a trained run, one row per damaged input: one
paragraph naming the file (and the row), exit 2, nothing recorded; a bundle reads only its own files; each (checkpoint,
task) is written once."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import TASK_TEXTS, error_line, small_overrides

from nanopt.cli import run as cli
from nanopt.errors import ConfigError
from nanopt.evals import tasks as harness
from nanopt.evals.taskgen import make_tasks, write_bundle
from nanopt.main import run as main_run

pytestmark = pytest.mark.usefixtures("offline")  # conftest: no hub


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    assert main_run(small_overrides(**{"run.dir": out})) == 0
    return out


def _row(line: int, old: str, new: str):
    """nanopt_mc.jsonl with `old` replaced by `new` in its line `line` (1-based) only."""
    def edit(text: str) -> str:
        assert old in (lines := text.split("\n"))[line - 1]
        return "\n".join([*lines[:line - 1], lines[line - 1].replace(old, new, 1), *lines[line:]])
    return edit


BROKEN = {  # a copy of nanopt_mc reading damaged data (None: no data file) -> words of its one paragraph
    "bad_json": (_row(2, "{", "{oops "), ["bad_json.jsonl", "JSON parse error", "in row 1"]),
    "bad_empty": (lambda t: "", ["bad_empty.jsonl has no rows"]),
    "bad_gold": (_row(3, '"gold": ', '"gold": 9'), ["bad_gold.jsonl row 3", "not one of its 4 choices"]),
    "bad_gold_first": (_row(1, '"gold": ', '"gold": 9'), ["bad_gold_first.jsonl", "IndexError"]),
    "bad_context": (lambda t: t.replace('"context"', '"ctx"'), ["bad_context.jsonl", "'context' is undefined"]),
    "bad_row_context": (_row(2, '"context"', '"ctx"'), ["bad_row_context.jsonl row 2", "no context"]),
    "bad_missing": (None, ["bad_missing.yaml", "Unable to find", "bad_missing.jsonl"]),
    "bad_fifo": (None, ["bad_fifo.jsonl", "Unable to find"]),
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """The generated tasks, a broken copy of nanopt_mc per BROKEN entry, a group holding one, and a CORE bundle."""
    make_tasks(root := tmp_path_factory.mktemp("tasks"), TASK_TEXTS, n=12)
    good, spec = (root / "nanopt_mc.jsonl").read_text(), yaml.safe_load((root / "nanopt_mc.yaml").read_text())
    for name, (breaks, _) in BROKEN.items():
        data = {"data_files": {"test": str(root / f"{name}.jsonl")}}
        (root / f"{name}.yaml").write_text(yaml.safe_dump({**spec, "task": name, "dataset_kwargs": data}))
        if breaks:
            (root / f"{name}.jsonl").write_text(breaks(good))
    os.mkfifo(root / "bad_fifo.jsonl")  # a read from it would wait for ever
    (root / "bad_group.yaml").write_text(yaml.safe_dump({"group": "bad_group", "task": ["nanopt_rolling", "bad_json"],
                                                         "metadata": {"version": 1.0}}))
    write_bundle(root / "bundle", TASK_TEXTS, n=12)
    return root


# One row per damaged input: (a change to a copy of the bundle (file, old, new) or None, the `nanopt eval`
# arguments, words its one paragraph holds).
DAMAGED = {
    **{name: (None, f"{{run}} --tasks {name} --include-path {{tasks}} --limit 4", words) for name, (_, words) in
       [*BROKEN.items(), ("bad_group", (None, ["task bad_group", "bad_json.jsonl", "JSON parse error"]))]},
    # A random baseline of 100 divided by zero (each value outside [0, 100): test_core.py's BAD table).
    "baseline 100": (("eval_meta_data.csv", "25.0", "100"), "{run} --core {bundle}",
                     ["eval_meta_data.csv:2", "nanopt_line_end", "'100'"]),
    "dataset_uri ..": (("core.yaml", "nanopt_line_end.jsonl", "../../elsewhere/x.jsonl"), "{run} --core {bundle}",
                       ["core.yaml", "dataset_uri", "leaves the bundle"]),
    "dataset_uri absolute": (("core.yaml", "nanopt_line_end.jsonl", "{elsewhere}"), "{run} --core {bundle}",
                             ["core.yaml", "dataset_uri", "leaves the bundle"]),
    "core.yaml": (("core.yaml", "icl_tasks", "icl_tasks: ["), "{run} --core {bundle}", ["core.yaml cannot be read"]),
    "no run": (None, "{tmp}/nothing --tasks nanopt_mc --include-path {tasks}", ["does not exist"]),
    "num_fewshot -1": (None, "{run} --tasks nanopt_mc --num-fewshot -1", ["--num-fewshot -1", "0 or more"]),
    "tasks ,": (None, "{run} --tasks ,", ["--tasks ','", "names no task"]),
    "tasks blank": (None, "{run} --tasks ' , ' --core x", ["names no task"]),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.startswith("bad_") else c
                                  for c in DAMAGED])  # slow: lm-eval indexes its tasks for seconds
def test_damaged_task_input_is_one_paragraph_naming_the_file(case, tasks, run_dir, tmp_path, capsys):
    damage, args, words = DAMAGED[case]
    elsewhere = tmp_path / "elsewhere" / "x.jsonl"  # a good task file, but not the bundle's
    names = {"run": run_dir, "tasks": tasks, "bundle": tmp_path / "bundle", "elsewhere": elsewhere, "tmp": tmp_path}
    if damage:
        (name, old, new), bundle = damage, shutil.copytree(tasks / "bundle", tmp_path / "bundle")
        (bundle / name).write_text((bundle / name).read_text().replace(old, new.format(**names), 1))
    if case.startswith("dataset_uri"):
        elsewhere.parent.mkdir()
        shutil.copy(tasks / "bundle" / "eval_data" / "nanopt_line_end.jsonl", elsewhere)
        assert (bundle / "eval_data" / new.format(**names)).resolve() == elsewhere.resolve()  # read, unchecked
    assert cli(["eval", *shlex.split(args.format(**names))]) == 2
    line = error_line(capsys.readouterr().err)
    for word in words:
        assert word in line, line
    assert not (run_dir / "evals.jsonl").exists()  # nothing scored, nothing recorded


class _UnreachableHubTasks:
    """lm-eval's TaskManager without network: it knows hellaswag (its index is local); loading it raises what datasets
    raises for a hub dataset that is not cached."""
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
    """`nanopt eval RUN --tasks hellaswag` offline, and training's check before its first step (TaskScorer): one
    paragraph naming the task, its data, why and the offline fix; offline mode was on before lm-eval's task module
    loaded, so nothing waited on retries."""
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
    with pytest.raises(ConfigError) as raised:
        harness.check_tasks(harness.TaskSpec(["hellaswag"]))
    assert str(raised.value) == line.removeprefix("nanopt eval: error: ")


# ---------------------------------------------------------------- each (checkpoint, task) once
def test_eval_core_needs_no_lm_eval_and_writes_each_checkpoint_task_once(tasks, run_dir, tmp_path, monkeypatch,
                                                                          capsys):
    """CORE never uses lm-eval (--tasks asks for it: one paragraph); the same evaluation again is not appended."""
    run, bundle = shutil.copytree(run_dir, tmp_path / "run"), str(tasks / "bundle")
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` (and lm_eval.anything) raises ImportError
        patch.setattr(harness, "lm_class", harness._lm_eval)  # as on a first call: an earlier test's is cached
        assert cli(["eval", str(run), "--core", bundle, "--limit", "6"]) == 0
        records = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
        assert {r["task"] for r in records} >= {"core"} and all("error" not in r for r in records)
        assert cli(["eval", str(run), "--tasks", "nanopt_mc", "--include-path", str(tasks)]) == 2
        assert "need lm-evaluation-harness" in error_line(capsys.readouterr().err)
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
