"""`[torchrun ...] python -m nanopt.main [CONFIG] [--section.key=value ...]`: `nanopt train` (commands/train.py)."""
from __future__ import annotations

import sys

from nanopt import cli


def run(argv: list[str]) -> int:
    return cli.run(["train", *argv])


def main() -> None:
    cli.main(["train", *sys.argv[1:]])


if __name__ == "__main__":
    main()
