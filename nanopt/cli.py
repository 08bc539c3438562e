"""The `nanopt` console script: one line per subcommand, each implemented next to what it drives."""
from __future__ import annotations

import importlib
import os
import sys

from nanopt.config import ConfigError

# name -> ("module:function", one-line help). Each function takes argv (list[str]) and returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("nanopt.main:run", "train a model (same as python -m nanopt.main)"),
    "prepare": ("nanopt.prepare:run", "tokenise a dataset into token shards (--estimate-only N to size it)"),
    "estimate": ("nanopt.mfu:estimate_command", "time, GPU-hours and cost to train a config at an assumed MFU"),
    "eval": ("nanopt.evaluation:eval_cli", "evaluate a run or checkpoint on its val/test set; appends to evals.jsonl"),
    "runs": ("nanopt.evaluation:runs_cli", "leaderboard of runs/*/summary.json: time-to-target, val loss/bpb"),
    "sample": ("nanopt.sample:sample_cli", "sample continuations of a prompt from a run, checkpoint or HF dir"),
    "export": ("nanopt.export:export_cli", "write a checkpoint as a Hugging Face LlamaForCausalLM directory"),
}


def usage() -> str:
    lines = ["usage: nanopt COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`nanopt COMMAND --help` for a command's options."]
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    # `--debug` anywhere (or NANOPT_DEBUG=1): tracebacks instead of one-paragraph errors, for every subcommand.
    debug = "--debug" in argv or os.environ.get("NANOPT_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"nanopt: error: unknown command {name!r}.\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, func_name = SUBCOMMANDS[name][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    previous = os.environ.get("NANOPT_DEBUG")
    if debug:
        os.environ["NANOPT_DEBUG"] = "1"  # seen by subcommands that catch their own errors (nanopt.main.run)
    try:
        return int(func(rest) or 0)
    except ConfigError as e:
        if debug:
            raise
        print(f"nanopt {name}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if debug and previous is None:
            os.environ.pop("NANOPT_DEBUG", None)
        elif debug:
            os.environ["NANOPT_DEBUG"] = previous


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
