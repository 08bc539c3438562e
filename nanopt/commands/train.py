"""`nanopt train [CONFIG | --config CONFIG] [--section.key=value ...]` (= `python -m nanopt.main`):
parse -> runtime.init -> train -> teardown, and the exit status that says how it ended."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from nanopt.config import load_config, parse_overrides, resolve, split_args
from nanopt.distributed import runtime
from nanopt.errors import (EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, EXIT_STATUS_ENV,
                           ConfigError, Preempted, ShardError, TrainingError, debug_enabled, debug_traceback)
from nanopt.io import as_disk_full, is_disk_full
from nanopt.training import faults
from nanopt.training.metrics import setup_logging
from nanopt.training.train import train

USAGE = """usage: python -m nanopt.main [CONFIG.yaml | --config CONFIG.yaml] [--section.key=value ...] [--debug]

Train a Llama-style model. With no config, the embedded default (configs/tiny.yaml) runs on CPU.
Overrides use dotted keys, e.g. --train.max_steps=50 --runtime.device=cpu.
Launch several processes with torchrun, e.g. torchrun --standalone --nproc-per-node=2 -m nanopt.main CONFIG.
Re-running the same command on the same run directory resumes from its newest checkpoint.
--debug (or NANOPT_DEBUG=1) shows Python tracebacks instead of one-paragraph errors.

Exit status: 0 finished, 1 failed (a full disk: what was saved is kept; free space and re-run to resume), 2 bad
input, 3 loss became NaN/inf, 75 preempted by SIGTERM/SIGINT or run.time_limit_s (checkpointed; resumable).
"""


def main(argv: list[str]) -> int:
    code = EXIT_FAILED
    try:
        code = _run(argv)
    except OSError as e:  # about a path: cli.run says it in one paragraph, exit 2 (a full disk: 1)
        code = EXIT_FAILED if e.filename is None or is_disk_full(e) else EXIT_BAD_INPUT
        raise
    finally:
        if path := os.environ.get(EXIT_STATUS_ENV):  # torchrun reports 1 for any failure; a launcher reads each
            with open(path, "a") as f:  # worker's own code here
                f.write(f"{os.environ.get('RANK', '0')} {code}\n")
    return code


def _run(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return EXIT_OK
    setup_logging(int(os.environ.get("RANK", "0") or 0) == 0)
    run_dir = Path.cwd()  # where a full disk is reported when the error names no file
    try:
        path, rest = split_args(argv)
        cfg = load_config(path, parse_overrides(rest))
        run_dir = cfg.run_dir
        # Checked against torchrun's world before the process group exists: every rank refuses alone, where one
        # refusing after the rendezvous could leave a lagging peer to fail (exit 1) on its way out.
        _, _, world, local_world = runtime.torchrun_world()
        resolve(cfg, world, local_world)
        rt = runtime.init(cfg.runtime.device, cfg.train.precision, cfg.runtime.threads)
        rt.warn_if_checkpoints_perishable(cfg.checkpoint.mirror)
        with faults.preemption_handlers():  # SIGTERM/SIGINT -> checkpoint, then Preempted
            train(cfg, rt)
        runtime.teardown(wait_for_peers=True)
        return EXIT_OK
    except Preempted as e:
        print(f"nanopt: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    except (ConfigError, ShardError, TrainingError) as e:
        debug_traceback()
        diverged = isinstance(e, TrainingError)
        print(f"nanopt: {'training stopped' if diverged else 'error'}: {e}", file=sys.stderr)
        return EXIT_DIVERGED if diverged else EXIT_BAD_INPUT
    except Exception as e:  # a full disk, however its writer raised it, is a failure in one paragraph (exit 1)
        full = as_disk_full(e, run_dir)
        if full is None or debug_enabled():
            raise
        print(f"nanopt: error: {full}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        runtime.teardown()
