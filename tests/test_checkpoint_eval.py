"""`nanopt eval --watch` (nanopt/evals/checkpoint_eval.py) on hand-written run directories: finished by the summary's
rule, a damaged checkpoint skipped, finite times, a linked evals.jsonl refused first (real runs: e2e/test_plots_*)."""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
from conftest import BAD_UTF8, USERS, no_traceback, one_paragraph, read_out, users_file, write_fake_run

from nanopt import rundirs
from nanopt.cli import run as cli


def _checkpoint(run_dir: Path, step: int, state: bytes, complete: bytes | None = None) -> Path:
    """checkpoints/step_N with small stand-in files and a COMPLETE manifest that matches them (or `complete`)."""
    ckpt = rundirs.checkpoint_path(run_dir, step)
    ckpt.mkdir(parents=True)
    files = {rundirs.MODEL_FILE: b"weights", rundirs.EMA_FILE: b"average", rundirs.RNG_FILE: b"rng",
             rundirs.STATE_FILE: state}
    for name, data in files.items():
        (ckpt / name).write_bytes(data)
    manifest = {"step": step, "files": {n: {"bytes": len(d), "crc32": zlib.crc32(d)} for n, d in files.items()}}
    (ckpt / rundirs.COMPLETE_FILE).write_bytes(complete if complete is not None else json.dumps(manifest).encode())
    return ckpt


def test_watch_stops_by_the_finished_rule_not_by_file_times(tmp_path, capsys):
    """The run's summary says it trained its config's max_steps: finished, even when config.yaml is newer than
    summary.json (a copy or a sync that does not keep times); the watcher used to wait on for ever."""
    run_dir = write_fake_run(tmp_path / "run", summary={"steps": 2}, **{"train.max_steps": 2})
    _checkpoint(run_dir, 2, b"{}", complete=b"not a manifest")  # handled (skipped) at step 2
    later = (run_dir / rundirs.SUMMARY_FILE).stat().st_mtime + 60
    os.utime(run_dir / rundirs.CONFIG_FILE, (later, later))
    assert cli(["eval", str(run_dir), "--watch", "--interval", "0.05", "--timeout", "5"]) == 0
    out, _ = read_out(capsys)
    assert "skipped" in out and "COMPLETE manifest" in out
    assert out.strip().splitlines()[-1] == "the run finished at step 2; 0 checkpoint(s) evaluated by this watcher"
    # Resumed with more steps: its config says 4, so the summary of step 2 does not end the watch.
    write_fake_run(run_dir, summary={"steps": 2}, **{"train.max_steps": 4})
    assert cli(["eval", str(run_dir), "--watch", "--interval", "0.05", "--timeout", "0.3"]) == 0
    assert "--timeout 0.3 s passed before the run finished" in read_out(capsys)[0]


# ---------------------------------------------------------------- eval --watch on a damaged checkpoint, odd times


def test_watch_skips_a_checkpoint_whose_state_is_damaged_naming_it(tmp_path, capsys):
    run_dir = write_fake_run(tmp_path / "run", summary={"steps": 2}, **{"train.max_steps": 2})
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
    assert err.startswith(f"nanopt eval: error: {flag} {value} must be")
    no_traceback(err)


# ---------------------------------------------------------------- a linked evals.jsonl


@pytest.mark.parametrize("flags", [[], ["--tasks", "nanopt_mc"]])
def test_nanopt_eval_refuses_a_linked_evals_file_before_it_evaluates(tmp_path, capsys, flags):
    """The refusal comes before the model is loaded or scored, not at the append after the work."""
    mine = users_file(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / rundirs.CONFIG_FILE).write_text("not even a config: never read\n")
    (run_dir / rundirs.EVALS_FILE).symlink_to(mine)
    for path in (run_dir, run_dir / "checkpoints" / "step_000002"):
        assert cli(["eval", str(path), *flags]) == 2
        err = one_paragraph(capsys.readouterr().err)
        assert str(run_dir / rundirs.EVALS_FILE) in err and "symbolic link" in err
    assert mine.read_bytes() == USERS
