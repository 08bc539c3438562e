"""The `nanopt` console script dispatches to subcommands and refuses unknown ones clearly; `nanopt.main.run` makes
idle OpenMP threads spin before torch loads, unless the user chose a policy."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from unittest import mock

import pytest
from conftest import REPO

from nanopt.cli import COMMANDS, run
from nanopt.errors import EXIT_STATUS_ENV


def test_unknown_subcommand_exits_2(capsys):
    assert run(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_help_lists_every_subcommand_and_each_answers_help(capsys):
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS), out
    for name in COMMANDS:
        with mock.patch.dict(os.environ):  # run() sets train's OpenMP environment
            try:
                code = run([name, "--help"])
            except SystemExit as e:  # argparse's exit, unless the command turns it into a return value
                code = e.code
        assert code == 0, (name, capsys.readouterr().err[-2000:])
        assert "usage" in capsys.readouterr().out.lower(), name


@pytest.mark.parametrize("stdout, said", [
    ("a pipe whose reader left", ""),
    ("/dev/full", "nanopt: error: the output could not be written to stdout (No space left on device).\n")])
def test_a_stdout_that_cannot_be_written_ends_the_command_with_exit_1(stdout, said):
    """`nanopt runs | head`: the reader left before the output was written: quietly. `nanopt runs > /dev/full`:
    one line; before, an OSError traceback. (Every command: e2e/test_bad_input.py's table.)"""
    if stdout == "/dev/full":
        out = os.open(stdout, os.O_WRONLY)
    else:
        read_end, out = os.pipe()
        os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "nanopt.cli", "--help"], stdout=out, stderr=subprocess.PIPE,
                              text=True, cwd=REPO, timeout=120)
    finally:
        os.close(out)
    assert proc.returncode == 1 and proc.stderr == said, proc.stderr


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
CONSOLE = """
import atexit, os, sys
from nanopt import cli
assert 'torch' not in sys.modules, 'torch imported before run(): too late to set OMP_WAIT_POLICY'
atexit.register(lambda: print('POLICY=' + os.environ['OMP_WAIT_POLICY']))  # as torch, loaded by `train`, saw it
sys.argv = ['nanopt', 'train', '--help']
cli.main()
"""


@pytest.mark.slow
def test_the_console_script_answers_help_and_makes_idle_openmp_threads_spin_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run([sys.executable, "-c", CONSOLE], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower()
    assert proc.stdout.rsplit("POLICY=", 1)[1].strip() == "ACTIVE"


def test_run_keeps_a_user_chosen_openmp_wait_policy(monkeypatch, capsys):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert run(["train", "--help"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


# ---------------------------------------------------------------- an OSError about a path, wherever a command met it
def _at(tmp_path, case: str) -> OSError:
    """The OSError a command meets for `case`, with the file system set up for it."""
    (tmp_path / "file").write_text("mine")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    return {"below_a_file": NotADirectoryError(errno.ENOTDIR, "Not a directory", str(tmp_path / "file" / "x")),
            "below_a_dangling_link": FileNotFoundError(errno.ENOENT, "No such file", str(tmp_path / "dangling" / "x")),
            "a_dangling_link": FileExistsError(errno.EEXIST, "File exists", str(tmp_path / "dangling")),
            "a_file_for_a_directory": FileExistsError(errno.EEXIST, "File exists", str(tmp_path / "file")),
            "a_directory_for_a_file": IsADirectoryError(errno.EISDIR, "Is a directory", str(tmp_path / "dir")),
            "permission_denied": PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "dir" / "f")),
            "read_only": OSError(errno.EROFS, "Read-only file system", str(tmp_path / "dir" / "f")),
            "full_disk": OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "dir" / "f"))}[case]


@pytest.mark.parametrize("case, code, words", [
    ("below_a_file", 2, ["file is a file, where a directory belongs", "file/x below it"]),
    ("below_a_dangling_link", 2, ["dangling is a symbolic link to nothing", "dangling/x below it"]),
    ("a_dangling_link", 2, ["dangling is a symbolic link to", "nowhere, which does not exist", "Remove the link"]),
    ("a_file_for_a_directory", 2, ["file is a file, where a directory belongs"]),
    ("a_directory_for_a_file", 2, ["dir is a directory, where a file belongs"]),
    ("permission_denied", 2, ["dir/f: permission denied", "change its permissions"]),
    ("read_only", 2, ["dir/f: Read-only file system"]),
    ("full_disk", 1, ["no space left on", "dir/f", "GiB free"]),
])
def test_an_oserror_about_a_path_is_one_paragraph_naming_it(tmp_path, monkeypatch, capsys, case, code, words):
    """Handled once, in cli.run, for every command (and the trainer): exit 2 for bad input, 1 for a full disk."""
    error = _at(tmp_path, case)

    def command(argv):
        raise error

    monkeypatch.setattr("nanopt.commands.plot.main", command)
    assert run(["plot", "x"]) == code
    err = capsys.readouterr().err
    assert err.startswith("nanopt plot: error: ") and err.strip().count("\n") == 0 and "Traceback" not in err, err
    for word in words:
        assert word in err, f"{word!r} missing from: {err}"


def test_an_oserror_naming_no_path_is_no_bad_input(monkeypatch):
    """A crash stays a crash (a traceback, exit 1): only a path makes it a paragraph."""
    monkeypatch.setattr("nanopt.commands.plot.main", lambda argv: (_ for _ in ()).throw(OSError(errno.EIO, "I/O")))
    with pytest.raises(OSError):
        run(["plot", "x"])


@pytest.mark.parametrize("case, code", [("a_directory_for_a_file", 2), ("full_disk", 1)])
def test_the_trainer_records_the_exit_status_of_an_oserror_about_a_path(tmp_path, monkeypatch, case, code):
    """The status file a launcher reads (NANOPT_EXIT_STATUS_FILE) gets the code cli.run returns for it."""
    error, status = _at(tmp_path, case), tmp_path / "status"
    monkeypatch.setenv(EXIT_STATUS_ENV, str(status))
    monkeypatch.setattr("nanopt.commands.train.load_config", lambda *a: (_ for _ in ()).throw(error))
    with mock.patch.dict(os.environ):  # run() sets train's OpenMP environment
        assert run(["train"]) == code
    assert status.read_text() == f"0 {code}\n"
