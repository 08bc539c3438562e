"""Runs tests/test_bench.py's slow bench smokes side by side, each main(argv) in a fork of this process, which runs
no torch op before it forks (a fork of a process whose OpenMP threads have run hangs: not forks of pytest's).

`python tests/bench_smokes.py OUT '{"NAME": [ARG, ...], ...}'`: AT_ONCE at a time, in that order; OUT/NAME/stdout.txt
and stderr.txt as each runs, then OUT/NAME/rc, its exit code."""
from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"
# Each smoke runs one to three single-threaded processes: three smokes keep 2 cores busy, the first finishing early.
AT_ONCE = max(3, os.cpu_count() or 1)


def run(bench: ModuleType, argv: list[str], out: Path) -> int:
    """In the fork: main(argv) with its output (file descriptors too) in OUT; the exit code `python bench/NAME.py`
    would have."""
    stdout, stderr = open(out / "stdout.txt", "w"), open(out / "stderr.txt", "w")
    os.dup2(stdout.fileno(), 1)
    os.dup2(stderr.fileno(), 2)
    sys.stdout, sys.stderr = stdout, stderr
    try:
        rc = bench.main(argv)
        code = 0 if rc is None else int(rc)
    except SystemExit as e:  # a bench's bad_input (2) or sys.exit("message") (1)
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the traceback is what the test shows
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main(out: Path, smokes: dict[str, list[str]]) -> None:
    sys.path.append(str(BENCH))  # as tests/conftest.py's bench_module: the benches import their neighbours by name
    benches = {name: importlib.import_module(name) for name in smokes}  # once, before any fork
    waiting, forks = list(smokes), {}
    while waiting or forks:
        while waiting and len(forks) < AT_ONCE:
            name = waiting.pop(0)
            (out / name).mkdir(parents=True, exist_ok=True)
            pid = os.fork()
            if pid == 0:
                os._exit(run(benches[name], smokes[name], out / name))
            forks[pid] = name
        pid, status = os.wait()
        rc = out / forks.pop(pid) / "rc"
        rc.with_suffix(".tmp").write_text(str(os.waitstatus_to_exitcode(status)))
        rc.with_suffix(".tmp").rename(rc)  # whole or absent: the test reads it as soon as it appears


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
