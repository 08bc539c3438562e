"""The `nanopt` console script: one line per subcommand, each implemented next to what it drives."""
from __future__ import annotations

import importlib
import sys

from nanopt.config import ConfigError

# name -> ("module:function", one-line help). Each function takes argv (list[str]) and returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("nanopt.main:run", "train a model (same as python -m nanopt.main)"),
}


def usage() -> str:
    lines = ["usage: nanopt COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`nanopt COMMAND --help` for a command's options."]
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"nanopt: error: unknown command {name!r}.\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, func_name = SUBCOMMANDS[name][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(rest) or 0)
    except ConfigError as e:
        print(f"nanopt {name}: error: {e}", file=sys.stderr)
        return 2


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
