"""rundirs is the one reader of run directories (experiments reads many finished runs through it) for `nanopt
runs`, `compare`, `plot` and `eval --watch`: one rule for is-a-run, finished and complete checkpoints, one
walker, and damaged or odd files met with one paragraph naming the file (exit 2) or a skipped line, never a
traceback. Statistics count each (setting, seed) once.

Every run here is a fake: a few small files written by hand, so each test takes milliseconds (the real runs
are in tests/test_runs_compare.py and tests/test_plots_watch.py)."""
from __future__ import annotations

import ast
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from nanopt import experiments, plots, rundirs
from nanopt.cli import run as cli
from nanopt.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
BAD_UTF8 = b"\xff\xfe\x80 not text"


# ---------------------------------------------------------------- fake run directories


def write_run(path: Path, seed: int = 0, summary: dict[str, Any] | None = None, metrics: list[Any] | None = None,
              **changes: Any) -> Path:
    """A finished run: config.yaml (sections as nanopt writes them, `changes` as "optim.name": "muon"),
    summary.json and, when given, metrics.jsonl (one JSON value per line)."""
    config: dict[str, dict[str, Any]] = {
        "run": {"name": path.name, "dir": str(path), "seed": seed},
        "train": {"max_steps": 200, "stop_at_target": False, "lr": 0.003},
        "optim": {"name": "adamw"}, "mfu": {"warmup_steps": 1},
    }
    for key, value in changes.items():
        section, name = key.split(".")
        config.setdefault(section, {})[name] = value
    path.mkdir(parents=True, exist_ok=True)
    (path / rundirs.CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
    (path / rundirs.SUMMARY_FILE).write_text(json.dumps({"steps": 200, "hardware": "cpu", "world_size": 1,
                                                         **(summary or {})}))
    if metrics is not None:
        (path / rundirs.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return path


METRICS = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000.0 + s, "step_ms": 50.0, "mfu": 0.1,
            "tokens_seen": 256 * s} for s in range(1, 7)] + [{"step": 6, "val_loss": 4.5, "tokens_seen": 1536}]
LOSSES = {"adamw": [4.52, 4.50, 4.55], "muon": [4.31, 4.30, 4.33]}


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """runs/sw/<point>/: three seeds each of adamw and muon."""
    root = tmp_path / "runs"
    for opt, losses in LOSSES.items():
        for i, loss in enumerate(losses):
            write_run(root / "sw" / f"{opt}-{i}", 1337 + i, {"final_val_loss": loss}, **{"optim.name": opt})
    return root


def read_out(capsys) -> tuple[str, str]:
    captured = capsys.readouterr()
    return captured.out, captured.err


def no_traceback(err: str) -> None:
    assert "Traceback" not in err


# ---------------------------------------------------------------- 1. one rule each, from rundirs

# The files whose run-directory file names come from rundirs; a literal name here would be a second owner.
READERS = ["nanopt/plots.py", "nanopt/commands/plot.py", "nanopt/commands/eval.py", "nanopt/commands/runs.py",
           "nanopt/commands/compare.py", "nanopt/experiments.py", "nanopt/comparison.py", "nanopt/watch.py",
           "nanopt/sweep.py", "bench/ablation.py", "bench/gpu_check.py", "bench/vs_nanogpt.py",
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
    outer = write_run(tmp_path / "outer", metrics=METRICS)
    inner = write_run(outer / "sweep" / "point", metrics=METRICS)
    (outer / rundirs.TB_DIR / "x").mkdir(parents=True)
    (outer / rundirs.TB_DIR / "x" / rundirs.METRICS_FILE).write_text("")  # not a run: inside one's tb/
    write_run(tmp_path / ".trash" / "old", metrics=METRICS)
    assert rundirs.walk_runs(tmp_path) == [outer, inner]
    assert plots.runs_to_plot([tmp_path]) == [outer, inner]
    assert plots.run_labels([outer, inner]) == ["outer", "sweep/point"]  # the holder by its name, not "."
    assert [r.dir for r in experiments.find_runs(tmp_path)[0]] == [outer, inner]


def _checkpoint(run_dir: Path, step: int, state: bytes, complete: bytes | None = None) -> Path:
    """checkpoints/step_N with small stand-in files and a COMPLETE manifest that matches them (or `complete`)."""
    ckpt = rundirs.checkpoint_path(run_dir, step)
    ckpt.mkdir(parents=True)
    files = {rundirs.MODEL_FILE: b"weights", rundirs.OPTIMIZER_FILE: b"moments", rundirs.RNG_FILE: b"rng",
             rundirs.STATE_FILE: state}
    for name, data in files.items():
        (ckpt / name).write_bytes(data)
    manifest = {"step": step, "files": {n: {"bytes": len(d), "crc32": zlib.crc32(d)} for n, d in files.items()}}
    (ckpt / rundirs.COMPLETE_FILE).write_bytes(complete if complete is not None else json.dumps(manifest).encode())
    return ckpt


def test_watch_stops_by_the_finished_rule_not_by_file_times(tmp_path, capsys):
    """The run's summary says it trained its config's max_steps: finished, even when config.yaml is newer than
    summary.json (a copy or a sync that does not keep times); the watcher used to wait on for ever."""
    run_dir = write_run(tmp_path / "run", summary={"steps": 2}, **{"train.max_steps": 2})
    _checkpoint(run_dir, 2, b"{}", complete=b"not a manifest")  # handled (skipped) at step 2
    later = (run_dir / rundirs.SUMMARY_FILE).stat().st_mtime + 60
    os.utime(run_dir / rundirs.CONFIG_FILE, (later, later))
    assert cli(["eval", str(run_dir), "--watch", "--interval", "0.05", "--timeout", "5"]) == 0
    out, _ = read_out(capsys)
    assert "skipped" in out and "COMPLETE manifest" in out
    assert out.strip().splitlines()[-1] == "the run finished at step 2; 0 checkpoint(s) evaluated by this watcher"
    # Resumed with more steps: its config says 4, so the summary of step 2 does not end the watch.
    write_run(run_dir, summary={"steps": 2}, **{"train.max_steps": 4})
    assert cli(["eval", str(run_dir), "--watch", "--interval", "0.05", "--timeout", "0.3"]) == 0
    assert "--timeout 0.3 s passed before the run finished" in read_out(capsys)[0]


# ---------------------------------------------------------------- 2. each (setting, seed) counted once


def _comparison(root: Path, capsys) -> dict[str, Any]:
    assert cli(["runs", str(root), "--compare", "muon", "adamw", "--json"]) == 0
    return json.loads(read_out(capsys)[0])


def test_a_copied_sweep_counts_each_seed_once_and_says_so(sweep, capsys):
    once = _comparison(sweep, capsys)
    shutil.copytree(sweep / "sw", sweep / "sw-copy")
    twice = _comparison(sweep, capsys)
    assert twice["comparison"]["p"] == pytest.approx(once["comparison"]["p"]) and once["comparison"]["p"] < 0.01
    assert twice["comparison"]["a"]["n"] == once["comparison"]["a"]["n"] == 3
    assert [g["n"] for g in twice["groups"]] == [g["n"] for g in once["groups"]] == [3, 3]
    assert len(twice["runs"]) == 6 and not once["warnings"]
    assert len(twice["warnings"]) == 6
    assert f"{sweep / 'sw-copy' / 'muon-0'} repeats {sweep / 'sw' / 'muon-0'}" in "\n".join(twice["warnings"])

    assert cli(["runs", str(sweep)]) == 0
    out, _ = read_out(capsys)
    assert out.splitlines()[0].startswith("6 runs in 2 group(s)")
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 6 and all("repeats" in w and "counted once" in w for w in warnings)
    assert any(str(sweep / "sw-copy" / "adamw-2") in w and str(sweep / "sw" / "adamw-2") in w for w in warnings)


def test_group_runs_keeps_the_first_of_a_repeat_by_path_order(sweep):
    shutil.copytree(sweep / "sw" / "muon-0", sweep / "aa-copy")  # sorts before sw/: it is the one kept
    groups = experiments.group_runs(experiments.find_runs(sweep)[0])
    muon = next(g for g in groups if g.values == {"optim.name": "muon"})
    assert [r.name for r in muon.runs] == ["aa-copy", "sw/muon-1", "sw/muon-2"]
    assert [(r.run.name, r.first.name) for r in muon.repeats] == [("sw/muon-0", "aa-copy")]


# ---------------------------------------------------------------- 3. a run that holds runs


def test_runs_lists_a_run_and_the_runs_below_it(sweep, capsys):
    holder = write_run(sweep / "sw", 7, {"final_val_loss": 4.9}, **{"train.max_steps": 100})
    assert cli(["runs", str(holder), "--json"]) == 0
    names = [r["run"] for r in json.loads(read_out(capsys)[0])["runs"]]
    assert sorted(names) == sorted(["sw", *(f"{o}-{i}" for o in LOSSES for i in range(3))])


# ---------------------------------------------------------------- 4. odd files: a paragraph or a skipped line


def _damage(run_dir: Path, name: str, data: bytes) -> Path:
    (run_dir / name).write_bytes(data)
    return run_dir / name


ODD_CONFIGS = [BAD_UTF8, b"- a list\n- of things\n", b"run: {seed: 1}\ndata: {date: 2020-01-01}\n"]
ODD_SUMMARIES = [BAD_UTF8, b"[1, 2]", b'{"steps": 200, "final_val_loss": "low"}',
                 b'{"steps": 200, "step_to_target": 150.5}']


@pytest.mark.parametrize("name, data", [*((rundirs.CONFIG_FILE, d) for d in ODD_CONFIGS),
                                        *((rundirs.SUMMARY_FILE, d) for d in ODD_SUMMARIES)])
def test_runs_skips_a_run_with_an_odd_file_naming_it(sweep, capsys, name, data):
    path = _damage(sweep / "sw" / "muon-1", name, data)
    for args in ([], ["--runs"], ["--json"]):
        assert cli(["runs", str(sweep), *args]) == 0
        out, err = read_out(capsys)
        no_traceback(err)
        if args == ["--json"]:
            assert any(str(path) in line for line in json.loads(out)["skipped"])
        else:
            assert any(line.startswith("skipped ") and str(path) in line for line in out.splitlines()), out


ODD_METRICS = [(b'{"step": 1, "loss": 5.0}\n[1, 2]\n{"step": 2, "loss": 4.0}\n', "line 2 is an array"),
               (b'{"step": 1, "loss": 5.0}\n7\n{"step": 2, "loss": 4.0}\n', "line 2 is a number"),
               (b'{"step": 1, "loss": 5.0}\n' + BAD_UTF8 + b'\n{"step": 2, "loss": 4.0}\n', "line 2 is not UTF-8")]


@pytest.mark.parametrize("data, words", ODD_METRICS)
def test_compare_names_a_damaged_metrics_line(sweep, capsys, data, words):
    a, b = sweep / "sw" / "adamw-0", sweep / "sw" / "muon-0"
    path = _damage(b, rundirs.METRICS_FILE, data)
    assert cli(["compare", str(a), str(b)]) == 2
    _, err = read_out(capsys)
    assert err.startswith("nanopt compare: error: ") and f"{path}: {words}" in err
    no_traceback(err)


@pytest.mark.parametrize("name, data, words", [
    (rundirs.CONFIG_FILE, BAD_UTF8, "cannot be read"),
    (rundirs.CONFIG_FILE, b"run: {seed: 1}\ndata: {date: 2020-01-01}\n", "`data.date`"),
    (rundirs.CONFIG_FILE, b"run: {seed: 1}\nmfu: {warmup_steps: many}\n", "`mfu.warmup_steps`"),
    (rundirs.SUMMARY_FILE, BAD_UTF8, "cannot be read as JSON"),
    (rundirs.SUMMARY_FILE, b'{"steps": 200, "final_val_loss": [4.3]}', "`final_val_loss`"),
    (rundirs.PROFILE_FILE, BAD_UTF8, "cannot be read as JSON"),
    (rundirs.PROFILE_FILE, b'{"step_ms_mean": "slow", "profiled_steps": 2}', "`step_ms_mean`"),
    (rundirs.PROFILE_FILE, b'{"step_ms_mean": 5.0, "profiled_steps": 2, "top_ops": [1]}', "`top_ops[0]`"),
    (rundirs.PROFILE_FILE, b'{"step_ms_mean": 5.0, "profiled_steps": 2, "label_ms": [1]}', "`label_ms`"),
])
def test_compare_names_an_odd_file(sweep, capsys, name, data, words):
    a, b = sweep / "sw" / "adamw-0", sweep / "sw" / "muon-0"
    good = b'{"step_ms_mean": 5.0, "profiled_steps": 2, "compute_share": 1.0, "top_ops": []}'
    (a / rundirs.PROFILE_FILE).write_bytes(good)  # both profiled: compare reads both profiles
    (b / rundirs.PROFILE_FILE).write_bytes(good)
    path = _damage(b, name, data)
    assert cli(["compare", str(a), str(b)]) == 2
    _, err = read_out(capsys)
    assert err.startswith("nanopt compare: error: ") and str(path) in err and words in err, err
    assert err.count("\n") == 1  # one paragraph
    no_traceback(err)


def test_records_read_objects_only_and_forgive_only_a_cut_last_line(tmp_path):
    run_dir = write_run(tmp_path / "r")
    (run_dir / rundirs.METRICS_FILE).write_bytes(b'{"step": 1, "loss": 5.0}\n\n{"step": 2, "loss": 4.')
    assert experiments.load_run(run_dir).records == [{"step": 1, "loss": 5.0}]  # the line being written is left out
    (run_dir / rundirs.METRICS_FILE).write_bytes(b'{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl: line 2 is not JSON"):
        experiments.load_run(run_dir).records
    (run_dir / rundirs.METRICS_FILE).write_bytes(b'{"step": 1}\n"text"\n')
    with pytest.raises(ConfigError, match=r"line 2 is a string, not an object"):
        experiments.load_run(run_dir).records


@pytest.fixture
def plotted(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", metrics=METRICS)


@pytest.mark.parametrize("data, words", ODD_METRICS)
def test_plot_names_a_damaged_metrics_line(plotted, tmp_path, capsys, data, words):
    path = _damage(plotted, rundirs.METRICS_FILE, data)
    assert cli(["plot", str(plotted), "--metric", "loss", "-o", str(tmp_path / "p.png")]) == 2
    _, err = read_out(capsys)
    assert err.startswith("nanopt plot: error: ") and f"{path}: {words}" in err
    no_traceback(err)
    assert not (tmp_path / "p.png").exists()


def test_plot_leaves_out_a_value_of_the_wrong_type(plotted, tmp_path, capsys):
    """A figure that is not a number is no point on the line (as a null is), not a crash."""
    odd = [{**r, "step_ms": "fast", "tokens_seen": "many"} if r["step"] == 3 else r for r in METRICS]
    (plotted / rundirs.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in odd))
    for x in plots.X_AXES:
        out = tmp_path / f"{x}.png"
        assert cli(["plot", str(plotted), "--metric", "loss", "--x", x, "-o", str(out)]) == 0, read_out(capsys)[1]
        assert out.read_bytes()[:4] == b"\x89PNG"
    xs, _ = plots.series(plots.stepped_records(plotted), "loss", "tokens")
    assert xs == [256, 512, 768, 1024, 1280, 1536]  # step 3 from the tokens per step of the others


def test_plot_output_must_be_a_file_in_an_existing_directory(plotted, tmp_path, capsys):
    (tmp_path / "taken.png").mkdir()
    assert cli(["plot", str(plotted), "-o", str(tmp_path / "taken.png")]) == 2
    _, err = read_out(capsys)
    assert "taken.png is a directory" in err
    no_traceback(err)
    assert cli(["plot", str(plotted), "-o", str(tmp_path / "nowhere" / "p.png")]) == 2
    assert "does not exist" in read_out(capsys)[1]


# ---------------------------------------------------------------- 4-5. eval --watch on odd files and times


@pytest.fixture
def watched(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", summary={"steps": 2}, **{"train.max_steps": 8})


@pytest.mark.parametrize("name, data, words", [
    (rundirs.CONFIG_FILE, BAD_UTF8, "cannot be read"),
    (rundirs.CONFIG_FILE, b"run: {seed: 1}\ntrain: {max_steps: many}\n", "train.max_steps"),
    (rundirs.SUMMARY_FILE, BAD_UTF8, "cannot be read as JSON"),
    (rundirs.SUMMARY_FILE, b"[1, 2]", "is not a run summary"),
    (rundirs.SUMMARY_FILE, b'{"steps": "two"}', "no integer `steps`"),
    (rundirs.EVALS_FILE, b'{"step": 2}\n' + BAD_UTF8 + b'\n{"step": 4}\n', "line 2 is not UTF-8"),
    (rundirs.EVALS_FILE, b'{"step": 2}\n[2, 4]\n', "line 2 is an array"),
])
def test_watch_names_an_odd_file(watched, capsys, name, data, words):
    path = _damage(watched, name, data)
    assert cli(["eval", str(watched), "--watch", "--interval", "0.05", "--timeout", "2"]) == 2
    _, err = read_out(capsys)
    assert err.startswith("nanopt eval: error: ") and str(path) in err and words in err, err
    no_traceback(err)


def test_watch_skips_a_checkpoint_whose_state_is_damaged_naming_it(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", summary={"steps": 2}, **{"train.max_steps": 2})
    ckpt = _checkpoint(run_dir, 2, BAD_UTF8)  # the manifest matches: written damaged, not cut
    assert cli(["eval", str(run_dir), "--watch", "--interval", "0.05", "--timeout", "5"]) == 0
    out, err = read_out(capsys)
    assert f"skipped {ckpt}: its {rundirs.STATE_FILE} is not" in out, out
    assert out.strip().splitlines()[-1].startswith("the run finished at step 2")
    no_traceback(err)


@pytest.mark.parametrize("flag, value", [("--interval", "nan"), ("--interval", "inf"), ("--interval", "-1"),
                                         ("--timeout", "nan"), ("--timeout", "inf"), ("--timeout", "-5")])
def test_watch_times_must_be_finite(tmp_path, capsys, flag, value):
    assert cli(["eval", str(tmp_path), "--watch", flag, value]) == 2
    _, err = read_out(capsys)
    assert err.startswith("nanopt eval: error: --interval must be") and value in err
    no_traceback(err)
