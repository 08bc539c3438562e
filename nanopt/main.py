"""Entry point: parse -> runtime.init -> train -> teardown. `python -m nanopt.main [CONFIG] [--k.v=x ...]`."""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from nanopt.config import ConfigError, load_config, parse_overrides, resolve

log = logging.getLogger("nanopt")

USAGE = """usage: python -m nanopt.main [CONFIG.yaml | --config CONFIG.yaml] [--section.key=value ...]

Train a Llama-style model. With no config, the embedded default (configs/tiny.yaml) runs on CPU.
Overrides use dotted keys, e.g. --train.max_steps=50 --runtime.device=cpu.
Launch several processes with torchrun, e.g. torchrun --standalone --nproc-per-node=2 -m nanopt.main CONFIG.
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


def setup_logging(is_main: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if is_main else logging.WARNING,
        format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout, force=True,
    )


def debug_enabled() -> bool:
    return os.environ.get("NANOPT_DEBUG", "") not in ("", "0")


def run(argv: list[str]) -> int:
    from nanopt import runtime
    from nanopt.train import TrainingError, train

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
        train(cfg, rt)
        return 0
    except ConfigError as e:
        if debug_enabled():
            raise
        print(f"nanopt: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        if debug_enabled():
            raise
        print(f"nanopt: training stopped: {e}", file=sys.stderr)
        return 3
    finally:
        runtime.teardown(rt)


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
