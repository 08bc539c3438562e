"""Entry point: parse -> runtime.init -> train -> teardown. `python -m nanopt.main [CONFIG] [--k.v=x ...]`."""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from nanopt.config import ConfigError, load_config, parse_overrides, resolve

log = logging.getLogger("nanopt")

USAGE = """usage: python -m nanopt.main [CONFIG.yaml | --config CONFIG.yaml] [--section.key=value ...] [--debug]

Train a Llama-style model. With no config, the embedded default (configs/tiny.yaml) runs on CPU.
Overrides use dotted keys, e.g. --train.max_steps=50 --runtime.device=cpu.
Launch several processes with torchrun, e.g. torchrun --standalone --nproc-per-node=2 -m nanopt.main CONFIG.
Re-running the same command on the same run directory resumes from its newest checkpoint.
--debug (or NANOPT_DEBUG=1) shows Python tracebacks instead of one-paragraph errors.

Exit status: 0 finished, 2 bad input, 3 loss became NaN/inf, 75 preempted by SIGTERM/SIGINT (resumable).
"""


def split_args(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """Find the config path (positional or --config) and leave the dotted overrides."""
    path: Optional[str] = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                value = argv[i + 1]
                i += 1
            else:
                raise ConfigError("command line: `--config` needs a file, e.g. `--config configs/tiny.yaml`.")
            if path is not None:
                raise ConfigError(f"command line: two config files given ({path} and {value}); pass one.")
            path = value
        elif not arg.startswith("-") and path is None and not rest:
            path = arg
        else:
            rest.append(arg)
        i += 1
    return path, rest


class _CurrentStdout(logging.StreamHandler):
    """Writes to whatever sys.stdout is at the time of the record, not the one at setup: callers that
    swap stdout (tests, notebooks, wrappers) would otherwise leave the handler on a closed stream."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(is_main: bool) -> None:
    handler = _CurrentStdout()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, handlers=[handler], force=True)


def debug_enabled() -> bool:
    return os.environ.get("NANOPT_DEBUG", "") not in ("", "0")


def pop_debug(argv: list[str]) -> tuple[bool, list[str]]:
    """`--debug` anywhere on the command line (or NANOPT_DEBUG=1): show tracebacks instead of one paragraph."""
    rest = [a for a in argv if a != "--debug"]
    return len(rest) != len(argv) or debug_enabled(), rest


# torchrun exits 1 whenever any worker fails, whatever the worker's own code was. A launcher that must tell
# bad input (2) or a diverged run (3), which a retry cannot fix, from a crash or a preemption sets this to
# a file path; each worker appends "RANK CODE" to it as it exits (modal_app.py reads it).
EXIT_STATUS_ENV = "NANOPT_EXIT_STATUS_FILE"


def run(argv: list[str]) -> int:
    code = _run(argv)
    path = os.environ.get(EXIT_STATUS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{os.environ.get('RANK', '0')} {code}\n")
    return code


def _run(argv: list[str]) -> int:
    # Idle OpenMP threads sleep instead of spinning: on a busy CPU, spinning steals the cores the other
    # thread needs (2-3x slower steps, bench/README "Performance"). libgomp reads it when torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from nanopt import faults, runtime
    from nanopt.data import ShardError
    from nanopt.train import TrainingError, train

    debug, argv = pop_debug(argv)

    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    rank = int(os.environ.get("RANK", "0") or 0)
    setup_logging(rank == 0)
    rt = None
    try:
        path, rest = split_args(argv)
        cfg = load_config(path, parse_overrides(rest))
        rt = runtime.init(cfg.runtime.device, cfg.train.precision, cfg.runtime.threads)
        resolve(cfg, rt.world_size)
        with faults.preemption_handlers():  # SIGTERM/SIGINT -> checkpoint, then faults.Preempted
            train(cfg, rt)
        runtime.teardown(rt, wait_for_peers=True)
        return 0
    except faults.Preempted as e:
        print(f"nanopt: {e}", file=sys.stderr)
        return faults.EXIT_PREEMPTED
    except (ConfigError, ShardError) as e:
        if debug:
            raise
        print(f"nanopt: error: {e}", file=sys.stderr)
        return faults.EXIT_BAD_INPUT
    except TrainingError as e:
        if debug:
            raise
        print(f"nanopt: training stopped: {e}", file=sys.stderr)
        return faults.EXIT_DIVERGED
    finally:
        runtime.teardown(rt)


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
