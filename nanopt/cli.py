"""The `nanopt` console script: one line per subcommand, each a module nanopt/commands/<name>.py with
main(argv: list[str]) -> int. Commands are imported by name when they run, so `nanopt estimate` never loads
torch and `nanopt train` can set the OpenMP environment before torch loads."""
from __future__ import annotations

import atexit
import importlib
import os
import sys
import threading
from pathlib import Path
from typing import NoReturn, Optional

from nanopt.errors import (EXIT_BAD_INPUT, EXIT_FAILED, ConfigError, DiskFull, ShardError, debug_enabled,
                           debug_traceback, path_problem)
from nanopt.io import disk_full, is_disk_full

COMMANDS: dict[str, str] = {
    "train": "train a model (same as python -m nanopt.main)",
    "prepare": "tokenise a dataset into token shards (--sample-documents N to size it)",
    "estimate": "time, GPU-hours and cost to train a config at an assumed MFU",
    "eval": "evaluate a run or checkpoint on its val/test set; appends to evals.jsonl",
    "sweep": "a grid of runs (--set KEY=V1,V2, --seeds N), one per GPU or CPU share; re-run resumes",
    "runs": "runs below DIR grouped by seed: mean, sd, 95% CI; --compare A B (Welch p-value)",
    "compare": "two runs side by side: speed, time to target, loss, profile shares and top ops",
    "plot": "overlay runs (or a sweep's runs) in one PNG: --metric val_loss, --x steps|tokens|seconds",
    "sample": "sample continuations of a prompt from a run, checkpoint or HF dir",
    "export": "write a checkpoint as a Hugging Face LlamaForCausalLM directory",
    "average": "a checkpoint whose weights are the mean of a run's --last K (or --steps a,b,c) checkpoints",
    "scaling": "scaling laws: `fit` a ladder's runs (or a CSV): isoFLOP optima, L(N, D), predictions",
}
# Defaults set before a command's module is imported (libgomp reads them when torch loads). Idle OpenMP threads spin:
# PASSIVE costs a wake-up per small op (2x slower steps at nanoGPT's shape), libgomp's spin-then-sleep is 3-10x slower
# beside another job; ACTIVE is never far from the best (bench/omp_policy.py, docs/mfu.md). A sweep sets each run's.
COMMAND_ENV: dict[str, dict[str, str]] = {"train": {"OMP_WAIT_POLICY": "ACTIVE"}}


def usage() -> str:
    return "\n".join(["usage: nanopt COMMAND [ARGS...]", "", "commands:",
                      *(f"  {name:<10} {text}" for name, text in COMMANDS.items()), "", "`nanopt COMMAND --help` "
                      "for a command's options; `--debug` (or NANOPT_DEBUG=1) shows tracebacks."])


def run(argv: list[str]) -> int:
    # `--debug` anywhere (or NANOPT_DEBUG=1): tracebacks before the one-paragraph errors, for every subcommand; set
    # for this command, as NANOPT_DEBUG, which the commands that catch their own errors (train) read.
    debug = "--debug" in argv and not debug_enabled()
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"nanopt: error: unknown command {name!r}.\n\n{usage()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for key, value in COMMAND_ENV.get(name, {}).items():
        os.environ.setdefault(key, value)
    if debug:
        os.environ["NANOPT_DEBUG"] = "1"
    prefix = "nanopt" if name == "train" else f"nanopt {name}"  # the trainer's own paragraphs say "nanopt: "
    try:
        return int(importlib.import_module(f"nanopt.commands.{name}").main(rest) or 0)
    except (ConfigError, ShardError) as e:  # bad input, for every command alike: one paragraph, exit 2
        debug_traceback()
        print(f"{prefix}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # about a path, wherever a command met it: one paragraph; a full disk is a failure (1)
        if e.filename is None:
            raise  # no path: stdout gone (main), or a crash
        debug_traceback()
        full = e if isinstance(e, DiskFull) else disk_full(Path(os.fsdecode(e.filename))) if is_disk_full(e) else None
        print(f"{prefix}: error: {full or path_problem(e)}", file=sys.stderr)
        return EXIT_FAILED if full else EXIT_BAD_INPUT
    finally:
        if debug:
            os.environ.pop("NANOPT_DEBUG", None)


def main(argv: Optional[list[str]] = None) -> NoReturn:
    """The process entry of `nanopt` and, with argv ["train", ...], of `python -m nanopt.main`."""
    try:
        code = run(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # here, so a closed pipe raises inside the try
    except OSError as e:
        # No path named: a reader that left (EPIPE), or stdout's disk is full (nanopt's own writes name their file).
        if e.filename is not None or not (isinstance(e, BrokenPipeError) or is_disk_full(e)):
            raise
        # `nanopt runs | head`: the reader left; `> /dev/full`: no space. Python's documented way (signal module,
        # "Note on SIGPIPE"): point stdout at devnull, so the interpreter's own flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if not isinstance(e, BrokenPipeError):  # a reader that left wants no more; a full disk is said once
            print(f"nanopt: error: the output could not be written to stdout ({e.strerror or e}).", file=sys.stderr)
        code = EXIT_FAILED
    exit_process(code)


def exit_process(code: int) -> NoReturn:
    """sys.exit(code) without the interpreter's teardown (~0.9 s freeing a training process's ~2,000 modules on a
    2-core EPYC); the atexit handlers and the streams' flush still run. It is sys.exit while another thread runs
    (a writer to wait for) or a profiler, tracer or debugger watches."""
    if threading.active_count() > 1 or _watched():
        sys.exit(code)
    atexit._run_exitfuncs()  # what the interpreter runs at exit (CPython; not in the documented API)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: the interpreter would ignore it too
            pass
    os._exit(code)


def _watched() -> bool:
    """A profiler, tracer, debugger or coverage tool is attached (sys.monitoring: theirs from Python 3.12)."""
    monitoring = getattr(sys, "monitoring", None)
    tools = monitoring is not None and any(monitoring.get_tool(i) for i in range(6))
    return sys.getprofile() is not None or sys.gettrace() is not None or tools


if __name__ == "__main__":
    main()
