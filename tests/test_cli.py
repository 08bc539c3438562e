"""The `nanopt` console script dispatches to subcommands and refuses unknown ones clearly; `nanopt.main.run` makes
idle OpenMP threads spin before torch loads, unless the user chose a policy."""
from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest

from conftest import REPO, run_module
from nanopt.cli import COMMANDS, run


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



# ---------------------------------------------------------------- the exit without the interpreter's teardown

EXIT_CODE = """
import atexit, sys, threading, time
from pathlib import Path
from nanopt import cli
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
if sys.argv[2] == "thread":  # a writer still running: the exit waits for it, as the interpreter's would
    threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done"))).start()
print("buffered, not yet flushed", end="")
sys.stderr.write("to stderr")
cli.exit_process(3)
"""


@pytest.mark.parametrize("case", ["alone", "thread"])
def test_exit_process_keeps_the_exit_code_atexit_handlers_output_and_running_threads(case, tmp_path):
    proc = subprocess.run([sys.executable, "-c", EXIT_CODE, str(tmp_path), case], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 3 and proc.stdout == "buffered, not yet flushed", proc
    assert proc.stderr == "to stderr" and (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "done" if case == "thread" else not (tmp_path / "thread").exists()


def test_a_profiled_command_exits_through_the_profiler_which_writes_its_file(tmp_path):
    """`python -m cProfile -o F -m nanopt.cli ...` writes F after the command returns: no exit past it."""
    proc = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(tmp_path / "p.prof"), "-m", "nanopt.cli",
                           "--help"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "usage" in proc.stdout, proc
    assert (tmp_path / "p.prof").stat().st_size > 0

# ---------------------------------------------------------------- OpenMP's wait policy, set before torch loads


def _policy_after_run(env_policy: str | None) -> str:
    """OMP_WAIT_POLICY as torch will see it after `nanopt.main.run`, in a fresh interpreter."""
    code = (
        "import os, sys, nanopt.main as m\n"
        "assert 'torch' not in sys.modules, 'torch imported before run(): too late to set OMP_WAIT_POLICY'\n"
        "m.run(['--help'])\n"
        "import torch\n"
        "print('POLICY=' + os.environ['OMP_WAIT_POLICY'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.rsplit("POLICY=", 1)[1].strip()


@pytest.mark.slow
def test_run_makes_idle_openmp_threads_spin_before_torch_loads():
    assert _policy_after_run(None) == "ACTIVE"


@pytest.mark.slow
def test_run_keeps_a_user_chosen_openmp_wait_policy():
    assert _policy_after_run("PASSIVE") == "PASSIVE"
