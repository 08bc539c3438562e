"""The `nanopt` console script dispatches to subcommands and refuses unknown ones clearly."""
from __future__ import annotations

from nanopt.cli import COMMANDS, run

from conftest import run_module


def test_help_lists_every_subcommand(capsys):
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_subcommand_exits_2(capsys):
    assert run(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_every_subcommand_answers_help():
    for name in COMMANDS:
        proc = run_module(["nanopt.cli", name, "--help"])
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        assert "usage" in proc.stdout.lower(), name
