"""The one reader of nanopt's own files (nanopt/schema.py): one table of every kind of file, each damaged once, read
by its own reader, is one paragraph naming the file, the field, what was found and the fix; what is no file at the
name (a directory, a link to nothing, a FIFO) is refused unread; the caches and the lease read the same shapes and
rebuild, or take an unreadable lease for what it still tells, instead of refusing."""
from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

import pytest
from conftest import BAD_UTF8, FAKE_METRICS, ODD_METRICS, no_traceback, read_out, write_fake_run

from nanopt import rundirs
from nanopt.cli import run as cli
from nanopt.data import shards
from nanopt.errors import ConfigError
from nanopt.lab import runs as experiments
from nanopt.lock import DirLock
from nanopt.schema import Field, problem

READERS = {rundirs.SUMMARY_FILE: rundirs.read_summary, rundirs.CONFIG_FILE: rundirs.read_config,
           rundirs.METRICS_FILE: rundirs.read_metrics, rundirs.EVALS_FILE: lambda d: rundirs.read_records(d / EVALS),
           rundirs.PROFILE_FILE: experiments.read_profile, shards.MANIFEST: shards.read_manifest}
EVALS, SUMMARY, CONFIG, PROFILE = rundirs.EVALS_FILE, rundirs.SUMMARY_FILE, rundirs.CONFIG_FILE, rundirs.PROFILE_FILE
STATE = {"split_index": 0, "shard_index": 0, "split_tokens": 0, "next_doc": 0, "next_offset": 0, "doclens": {},
         "complete": True}
GOOD_PROFILE = b'{"step_ms_mean": 5.0, "profiled_steps": 2, "compute_share": 1.0, "top_ops": []}'


def _manifest(**changes) -> bytes:
    return json.dumps({"shards": [], "state": STATE, **changes}).encode()


# (file, content (None: a directory), words): each the first thing wrong with the file, and the fix its kind gives.
DAMAGED = [
    (SUMMARY, BAD_UTF8, ["the file is not UTF-8 text", "run the run's command again"]),
    (SUMMARY, b"{", ["the file is not JSON (Expecting property name"]),
    (SUMMARY, b"[" * 100_000, ["the file nests deeper than any file nanopt writes"]),
    (SUMMARY, b"[1, 2]", ["the file is an array [1, 2], not a run summary"]),
    (SUMMARY, b'{"steps": "two"}', ['`steps` is a string "two", not an integer']),
    (SUMMARY, b'{"steps": 200, "final_val_loss": "low"}', ['`final_val_loss` is a string "low"']),
    (SUMMARY, b'{"steps": 200, "final_val_loss": [4.3]}', ["`final_val_loss` is an array [4.3]"]),
    # JSON readers take NaN and Infinity; nanopt never writes them: statistics.stdev raised on them
    (SUMMARY, b'{"steps": 200, "final_val_loss": NaN}', ["`final_val_loss` is a number NaN, not a finite number or null"]),
    (SUMMARY, b'{"steps": 200, "train_seconds": Infinity}', ["`train_seconds` is a number Infinity"]),
    (SUMMARY, b'{"steps": 200, "step_to_target": 150.5}', ["`step_to_target` is a number 150.5, not an integer or null"]),
    (CONFIG, BAD_UTF8, ["the file is not UTF-8 text", "restore it"]),
    (CONFIG, b"run: {seed: [\n", ["the file is not valid YAML at line 2"]),
    (CONFIG, b"- a list\n- of things\n", ['the file is an array ["a list", "of things"], not a run config']),
    (CONFIG, b"run: {seed: 1}\n", ["`train` is missing"]),
    (CONFIG, b"train: {max_steps: 0}\n", ["`train.max_steps` is a number 0, not an integer >= 1"]),
    (CONFIG, b"run: {seed: 1}\ntrain: {max_steps: many}\n", ['`train.max_steps` is a string "many"']),
    (CONFIG, b"train: {max_steps: 9}\nrun: 5\n", ["`run` is a number 5, not a section"]),
    (CONFIG, b"train: {max_steps: 9}\ndata: {date: 2020-01-01}\n", ['`data.date` is a date "2020-01-01"']),
    (CONFIG, b"train: {max_steps: 9}\nmfu: {warmup_steps: many}\n", ['`mfu.warmup_steps` is a string "many"']),
    # A directory at the name: before, read as no file (a config of no keys, an unprofiled run).
    (CONFIG, None, ["is a directory"]),
    (rundirs.METRICS_FILE, b'{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n', ["line 2 is not JSON", "mend that line"]),
    (rundirs.METRICS_FILE, b'{"step": 1}\n"text"\n', ['line 2 is a string "text", not an object']),
    (rundirs.METRICS_FILE, b'{"step": 1}\nnull\n', ["line 2 is null, not an object"]),
    *((rundirs.METRICS_FILE, data, [words]) for data, words in ODD_METRICS),
    (EVALS, b'{"step": 2}\n' + BAD_UTF8 + b'\n{"step": 4}\n', ["line 2 is not UTF-8"]),
    (EVALS, b'{"step": 2}\n[2, 4]\n', ["line 2 is an array"]),
    (PROFILE, BAD_UTF8, ["the file is not UTF-8 text", "profile the run again"]),
    (PROFILE, b'{"profiled_steps": 2}', ["`step_ms_mean` is missing"]),
    (PROFILE, b'{"step_ms_mean": "slow", "profiled_steps": 2}', ['`step_ms_mean` is a string "slow"']),
    (PROFILE, b'{"step_ms_mean": 5.0, "profiled_steps": 2, "top_ops": [1]}', ["`top_ops[0]` is a number 1"]),
    (PROFILE, b'{"profiled_steps": 2, "step_ms_mean": 5, "top_ops": [{"name": "mm", "calls": "x"}]}',
     ['`top_ops[0].calls` is a string "x", not a finite number']),
    (PROFILE, b'{"step_ms_mean": 5.0, "profiled_steps": 2, "label_ms": [1]}', ["`label_ms` is an array [1]"]),
    (PROFILE, None, ["is a directory"]),
    (shards.MANIFEST, b'"shards"', ['the file is a string "shards", not a shard manifest', "Restore", "cannot be used"]),
    (shards.MANIFEST, _manifest(shards=[{"file": "../x.bin", "split": "train", "tokens": 5}]),
     ['`shards[0].file` is a string "../x.bin", not a shard name `nanopt prepare` writes']),
    (shards.MANIFEST, _manifest(state={**STATE, "doclens": {"train": -1}}), ["`state.doclens.train` is a number -1"]),
    (shards.MANIFEST, _manifest(rebuild=[{"file": "train_000000.bin", "split": "train", "tokens": 5,
                                          "after": {**STATE, "complete": "no"}}]),
     ['`rebuild[0].after.complete` is a string "no", not true or false']),
]


def _damage(run_dir: Path, name: str, content: bytes | None) -> Path:
    (run_dir / name).unlink(missing_ok=True)
    (run_dir / name).mkdir() if content is None else (run_dir / name).write_bytes(content)
    return run_dir / name


@pytest.mark.parametrize("name, content, words", DAMAGED)
def test_a_damaged_file_is_one_paragraph_naming_the_file_the_field_what_was_found_and_the_fix(tmp_path, name, content,
                                                                                             words):
    path = _damage(write_fake_run(tmp_path / "run"), name, content)
    with pytest.raises(ConfigError) as e:
        READERS[name](path.parent)
    assert str(e.value).startswith(f"{path}: " if content else f"{path} ") and "\n" not in str(e.value), e.value
    assert all(word in str(e.value) for word in words), e.value


# The commands that read each file: `compare` and `eval --watch` exit 2 with the paragraph, `runs` skips the run
# naming it (in its table and in --json).
COMMANDS = {"compare": (SUMMARY, CONFIG, rundirs.METRICS_FILE, PROFILE), "eval": (SUMMARY, CONFIG, EVALS),
            "runs": (SUMMARY, CONFIG)}


@pytest.mark.parametrize("command, name, content, words", [(command, *row) for row in DAMAGED
                                                           for command, names in COMMANDS.items() if row[0] in names])
def test_each_command_that_reads_a_damaged_file_says_its_paragraph(tmp_path, capsys, command, name, content, words):
    a, b = (write_fake_run(tmp_path / "runs" / n, i, {"steps": 2}, FAKE_METRICS, **{"train.max_steps": 8})
            for i, n in enumerate("ab"))
    if name == PROFILE:  # both profiled: compare reads both profiles
        (a / PROFILE).write_bytes(GOOD_PROFILE)
    path = _damage(b, name, content)
    if command == "runs":
        for args in ([], ["--runs"], ["--json"]):
            assert cli(["runs", str(tmp_path / "runs"), *args]) == 0
            out, err = read_out(capsys)
            no_traceback(err)
            lines = json.loads(out)["skipped"] if args == ["--json"] else [
                line.removeprefix("skipped ") for line in out.splitlines() if line.startswith("skipped ")]
            assert any(line.startswith(str(path)) and all(w in line for w in words) for line in lines), out
        return
    argv = ["compare", str(a), str(b)] if command == "compare" else ["eval", str(b), "--watch", "--interval", "0.05",
                                                                      "--timeout", "2"]
    assert cli(argv) == 2
    _, err = read_out(capsys)
    assert err.startswith(f"nanopt {command}: error: {path}") and err.count("\n") == 1, err
    assert all(word in err for word in words), err
    no_traceback(err)


@pytest.mark.parametrize("name", READERS)
@pytest.mark.parametrize("kind, words", [("directory", "is a directory"), ("dangling link", "is a symbolic link to"),
                                         ("fifo", "is not a regular file"), ("device", "is not a regular file")])
def test_what_is_no_file_at_a_files_name_is_named_unread_not_taken_for_absent(tmp_path, name, kind, words):
    """Before, a directory at config.yaml or summary.json read as 'no such file' (`compare` showed every config key as
    changed, a sweep took the point for done or new), a FIFO at any of them was read for ever, and a link to /dev/zero
    would be read for ever, one to /dev/null read as no records."""
    run_dir = write_fake_run(tmp_path / "run")
    (run_dir / name).unlink(missing_ok=True)
    {"directory": lambda p: p.mkdir(), "dangling link": lambda p: p.symlink_to(tmp_path / "nowhere"),
     "fifo": os.mkfifo, "device": lambda p: p.symlink_to("/dev/null")}[kind](run_dir / name)
    with pytest.raises(ConfigError, match=rf"{name} {words}"):
        READERS[name](run_dir)
    (run_dir / name).rmdir() if kind == "directory" else (run_dir / name).unlink()
    assert READERS[name](run_dir) in (None, [])  # nothing there: absent, as before


def test_only_a_records_file_s_cut_last_line_is_forgiven(tmp_path):  # a device at its name: the test above
    (tmp_path / rundirs.METRICS_FILE).write_bytes(b'{"step": 1, "loss": 5.0}\n\n{"step": 2, "loss": 4.')
    assert rundirs.read_metrics(tmp_path) == [{"step": 1, "loss": 5.0}]  # the line being written is left out


def test_the_first_problem_is_named_by_its_path_in_declaration_order():
    shape = Field(dict, fields={"a": Field(int, required=True), "b": Field(list, items=Field(str, null=True))})
    assert problem({"b": [None, 3]}, shape) == "`a` is missing"
    assert problem({"a": 1, "b": [None, 3]}, shape) == "`b[1]` is a number 3, not a string or null"
    assert problem({"a": True}, shape) == "`a` is true, not an integer"  # JSON's true is no count
    assert problem({"a": 1, "b": [], "other": object()}, shape) is None  # undeclared keys pass


@pytest.mark.parametrize("content", [
    b'{"host": "%s", "pid": "%d", "started": 1, "heartbeat": 1, "token": "t"}' % (socket.gethostname().encode(), 1),
    b'{"host": "h", "pid": 1, "started": 1, "heartbeat": 1}', b"[1, 2]"])
def test_a_lease_of_the_wrong_shape_is_read_as_what_it_still_tells_not_a_traceback(tmp_path, content):
    """Before, a pid of the wrong type was a TypeError in the liveness check, and a list an unhandled error."""
    (tmp_path / rundirs.LOCK_FILE).write_bytes(content)
    held = DirLock(tmp_path).holder()
    assert held.token == "" and held.describe().endswith("s ago)")


@pytest.mark.parametrize("name", [rundirs.LOCK_FILE, shards.VERIFIED])
def test_a_fifo_at_the_lease_or_the_verification_record_is_named_or_ignored_never_read(tmp_path, name, caplog):
    os.mkfifo(tmp_path / name)
    if name == rundirs.LOCK_FILE:
        with pytest.raises(ConfigError, match=f"{name} is not a regular file"):
            DirLock(tmp_path).acquire()
        return
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        assert shards._read_stamps(tmp_path / name) == {}
    assert f"{name} is not a regular file" in caplog.text and "verified again" in caplog.text
