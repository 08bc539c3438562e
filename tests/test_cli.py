"""The `nanopt` console script dispatches to subcommands and refuses unknown ones clearly."""
from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest

from nanopt.cli import COMMANDS, run

from conftest import REPO, run_module


def test_help_lists_every_subcommand(capsys):
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_subcommand_exits_2(capsys):
    assert run(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_every_subcommand_answers_help(capsys):
    for name in COMMANDS:
        with mock.patch.dict(os.environ):  # run() sets train's OpenMP environment
            try:
                code = run([name, "--help"])
            except SystemExit as e:  # argparse's exit, unless the command turns it into a return value
                code = e.code
        assert code == 0, (name, capsys.readouterr().err[-2000:])
        assert "usage" in capsys.readouterr().out.lower(), name


@pytest.mark.slow
def test_the_console_script_answers_help_in_a_real_process():
    proc = run_module(["nanopt.cli", "train", "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower()


def test_a_reader_that_left_ends_the_command_quietly():
    """`nanopt runs | head`: the pipe's reader is gone before the output is written. No traceback, exit 1."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "nanopt.cli", "--help"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 1 and proc.stderr == ""
