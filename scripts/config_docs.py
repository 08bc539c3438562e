"""Print docs/configuration.md, the configuration reference, from the config's own field declarations.

    python scripts/config_docs.py            # print it
    python scripts/config_docs.py --write    # rewrite docs/configuration.md
    python scripts/config_docs.py --check    # exit 1 when docs/configuration.md is stale

Every key's doc, rules, resume-safety and whether it changes results are declared once, on its field in
nanopt/config.py (`key(...)`); this page is derived from them, and tests/test_config_docs.py fails when the
page and the code disagree.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import typing
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nanopt.config import SECTIONS, SWITCHES, bounds_text, choices_text  # noqa: E402

PAGE = REPO / "docs" / "configuration.md"
COMMAND = "python scripts/config_docs.py --write"

SWITCHED = "; ".join(f"`{name}` (`{switch.split()[0]}`: {needs})" for name, (switch, needs) in SWITCHES.items())

INTRO = f"""\
# Configuration reference

<!-- Generated from nanopt/config.py by `{COMMAND}`; edit the field declarations there, not this page. -->

A run is configured by one YAML file of sections (`run:`, `model:`, `train:`, ...) and command-line overrides.

- **The file.** With no file, `python -m nanopt.main` (and `nanopt train`) uses the embedded default,
  `configs/tiny.yaml`: a tiny Llama on the Shakespeare corpus, byte-level, about two minutes on a CPU. Give
  another as the first argument or with `--config`: `python -m nanopt.main configs/1b.yaml`,
  `nanopt train --config configs/tiny.yaml`. A bare name such as `1b` finds the shipped `configs/1b.yaml`.
  One file per command.
- **Overrides.** `--section.key=value` (or `--section.key value`) sets any key below, e.g.
  `--train.max_steps=50 --profile.enabled=true`. Overrides apply after the file, left to right. A value is
  read as its key's type: `true`/`false` (also yes/no, on/off, 1/0), integers (`16_384` and `1e6` too),
  numbers, strings, and `null` where the type says so.
- **Lists.** A list key takes a YAML list: `eval.tasks: [hellaswag, arc_easy]`, and a schedule's
  [START, VALUE] pairs, `train.batch_schedule: [[0, 8192], [300, 16384]]`. On the command line (and in a
  config of earlier versions, which wrote lists as text) the items are separated by commas and a pair's two
  numbers by a colon: `--eval.tasks=hellaswag,arc_easy`, `--train.batch_schedule=0:8192,300:16384`; `""` is
  the empty list.
- **Defaults.** A key the file leaves out takes the default in the tables below (`configs/tiny.yaml` sets
  several of them to other values).
- **Errors.** An unknown section or key, a value of the wrong type or outside its key's rules, and impossible
  combinations (`model.dim` not divisible by `model.n_heads`, a `train.global_batch_tokens` that is not a
  multiple of micro_batch_size × seq_len × world size) stop the command before anything runs, with one
  paragraph naming the key and what would be valid (exit code 2). A key with bounds takes finite numbers
  only: `nan` and `inf` are refused. Every number is bounded by what exists (each bound's reason is a comment
  on its key in nanopt/config.py), and an integer whose rules below name no upper bound is below 2^63: torch,
  numpy and C hold integers as int64.
- **Keys behind a switch.** A key that acts only when another is on, set away from its default while that
  switch is off, would be ignored, so it is refused (exit 2, naming the switch and the default that drops it):
  {SWITCHED}. A config keeps presets for an optional feature as flags in a comment (the `profile:` of
  `configs/1b.yaml`). A saved config (a checkpoint's, an export's) loads as written: the key changed nothing.
- **Derived values.** At start-up a `model.max_seq_len` of 0 becomes `train.seq_len`. The stage plan
  (nanopt/training/plan.py) derives each stage's steps, tokens and micro-steps per optimizer step (batch tokens /
  (micro_batch_size × seq_len × world size)) from the config and the world size; a run logs each stage as it
  enters it, and [`nanopt estimate`](mfu.md#time-to-train-nanopt-estimate) prints them all.
- **`config.yaml` in a run directory** is the resolved config of the newest session: the file, the overrides
  and the derived `model.max_seq_len`. Each checkpoint's `state.json` holds the same config; loading a run and
  resuming it read that one.
- **Resume.** Re-running a command on its run directory resumes from the newest usable checkpoint. A key
  marked *no* under "resume may change" must keep the checkpoint's value, or the run is refused naming it;
  `--checkpoint.allow_changes=train.lr,...` accepts the listed changes anyway.
- **Changes results.** `nanopt runs` groups runs whose configs differ only in `run.seed` and in keys marked
  *no* there as repeats of one setting; every other key splits groups, as do the hardware and world size.
"""


def _type(hint: Any) -> str:
    if typing.get_origin(hint) is list:  # a list in a list is a schedule's [START, VALUE] pair
        item = typing.get_args(hint)[0]
        return f"list of [{_type(typing.get_args(item)[0])}, {_type(typing.get_args(item)[0])}]" if \
            typing.get_origin(item) is list else f"list of {_type(item)}"
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return f"{_type(args[0])} or null" if args else hint.__name__


def _value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return f"`{text}`" if text else '`""`'


def _rules(f: Field) -> str:
    meta = f.metadata
    if meta["choices"]:
        return "one of " + choices_text(tuple(f"`{c}`" if c else "" for c in meta["choices"]))
    text = bounds_text(meta)
    return f"{text}, or null (= {meta['null']})" if text and meta["null"] else text


def _cell(text: str) -> str:
    """Table-safe text; docs/X.md in a doc becomes a link to its neighbour page."""
    return re.sub(r"docs/([\w-]+\.md)", r"[\1](\1)", text.replace("|", "\\|"))


def section_table(name: str, cls: type) -> str:
    hints = typing.get_type_hints(cls)
    lines = [f"## {name}", "", _cell(" ".join(cls.__doc__.split())), "",
             "| key | type | default | rules | resume may change | changes results | doc |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for f in fields(cls):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        cells = [f"`{name}.{f.name}`", _type(hints[f.name]), _value(default), _rules(f),
                 "yes" if f.metadata["safe"] else "no", "no" if f.metadata["neutral"] else "yes", f.metadata["doc"]]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def render() -> str:
    return "\n".join([INTRO, *(section_table(name, cls) for name, cls in SECTIONS.items())])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {PAGE.relative_to(REPO)}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 when {PAGE.relative_to(REPO)} is stale")
    args = p.parse_args(argv)
    text = render()
    if args.write:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(text)
    elif args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(REPO)} is stale: it differs from the field declarations in "
                  f"nanopt/config.py. Regenerate it: {COMMAND}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
