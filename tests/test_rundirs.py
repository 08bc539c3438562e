"""THE run directory (nanopt/rundirs.py): no other reader spells a run file's name, one walker finds the runs (a run
inside a run too), and the profile summary's name is the profiler's."""
from __future__ import annotations

import ast
import json
from types import SimpleNamespace

import pytest
from conftest import FAKE_METRICS, REPO, write_fake_run

from nanopt import rundirs
from nanopt.lab import plots, runs as experiments
from nanopt.training import profiling


# ---------------------------------------------------------------- one rule each, from rundirs
# The files whose run-directory file names come from rundirs; a literal name here would be a second owner.
READERS = ["nanopt/lab/plots.py", "nanopt/commands/plot.py", "nanopt/commands/eval.py", "nanopt/commands/runs.py",
           "nanopt/commands/compare.py", "nanopt/lab/runs.py", "nanopt/lab/compare.py", "nanopt/evals/checkpoint_eval.py",
           "nanopt/lab/sweep.py", "bench/ablation.py", "bench/gpu_check.py", "bench/vs_nanogpt.py",
           "bench/omp_policy.py"]
NAMES = (rundirs.CONFIG_FILE, rundirs.SUMMARY_FILE, rundirs.METRICS_FILE, rundirs.EVALS_FILE, rundirs.PROFILE_FILE)


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string constant that is not a docstring (docstrings may name files for readers)."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


@pytest.mark.parametrize("path", READERS)
def test_readers_spell_no_run_file_name_of_their_own(path):
    found = [f"{path}:{line}: {text!r}" for line, text in _strings(ast.parse((REPO / path).read_text()))
             if any(name in text for name in NAMES)]
    assert not found, "use rundirs' constants:\n" + "\n".join(found)


def test_plot_and_runs_find_runs_with_one_walker(tmp_path):
    """A run inside a run is found; a run's own tb/ and checkpoints/ and hidden directories are not searched."""
    outer = write_fake_run(tmp_path / "outer", metrics=FAKE_METRICS)
    inner = write_fake_run(outer / "sweep" / "point", metrics=FAKE_METRICS)
    (outer / rundirs.TB_DIR / "x").mkdir(parents=True)
    (outer / rundirs.TB_DIR / "x" / rundirs.METRICS_FILE).write_text("")  # not a run: inside one's tb/
    write_fake_run(tmp_path / ".trash" / "old", metrics=FAKE_METRICS)
    assert rundirs.walk_runs(tmp_path) == [outer, inner]
    assert plots.runs_to_plot([tmp_path]) == [outer, inner]
    assert plots.run_labels([outer, inner]) == ["outer", "sweep/point"]  # the holder by its name, not "."
    assert [r.dir for r in experiments.find_runs(tmp_path)[0]] == [outer, inner]


def test_the_profilers_summary_is_where_the_run_readers_read_it(tmp_path):
    """Rank 0's profile summary is the file `nanopt runs` and compare read (read_profile), not a name of its own."""
    summary = {"profiled_steps": 2, "first_step": 4, "last_step": 5, "step_ms_mean": 10.0, "top_ops": [],
               "host_overhead_share": 0.1, "data_loader_share": 0.1, "compute_share": 0.8, "mode": "cpu",
               "peak_memory_bytes": None}
    rank0 = SimpleNamespace(rt=SimpleNamespace(is_main=True, rank=0), run_dir=tmp_path, dir=tmp_path / "tb",
                            metrics=None)
    profiling.Profile._publish(rank0, summary, 5)
    assert experiments.read_profile(tmp_path) == summary


def test_an_evals_record_with_a_list_or_object_where_a_key_field_goes_matches_no_evaluation(tmp_path):
    """Before, `nanopt eval --watch` (and scoring tasks during training) died with TypeError: unhashable type."""
    good = {"source": "nanopt eval", "step": 4, "val_loss": 4.2, "eval_batches": 2, "precision": "fp32"}
    lines = [good, {**good, "step": [4]}, {**good, "source": {"a": 1}}, {**good, "task": ["hellaswag"]}]
    (tmp_path / rundirs.EVALS_FILE).write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert rundirs.recorded(tmp_path) == {rundirs.evaluation_key(r) for r in lines}
    assert len(rundirs.recorded(tmp_path)) == 4 and rundirs.evaluation_key(good) in rundirs.recorded(tmp_path)
