"""The one reader of nanopt's own files. Each kind of file declares its shape once as Fields, beside the code that
writes it (rundirs, shards, lab.runs, lock). `read` parses a file (YAML by its suffix, else JSON) through io, which
refuses what is no regular file unread, and checks it: a damaged file is one paragraph, "FILE: WHERE is FOUND, not
EXPECTED. FIX" (ConfigError: exit 2). A cache reads the same paragraph and rebuilds instead of refusing."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from nanopt.errors import ConfigError, path_problem
from nanopt.io import is_int, is_number, read_bytes

KINDS = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false", dict: "an object",
         list: "a list"}


@dataclass(frozen=True)
class Field:
    """A value's shape: `kind` int, float (finite; an int is one too), str, bool, dict, list, or object (any value,
    for `test` to judge). An object's `fields` are checked by name, other keys pass (a newer nanopt may add some);
    `items` is each element's (or a map's each value's) shape; `what` says in words what the value is."""
    kind: type
    required: bool = False
    null: bool = False  # None is allowed too (an unreached target's figures are null)
    lo: Optional[int] = None
    fields: dict[str, "Field"] = field(default_factory=dict)
    items: Optional["Field"] = None
    test: Optional[Callable[[Any], bool]] = None
    what: str = ""

    def expected(self) -> str:
        bound = "" if self.lo is None else f" >= {self.lo}"
        return (self.what or KINDS[self.kind] + bound) + (" or null" if self.null else "")

    def fits(self, value: Any) -> bool:
        kind = {int: is_int, float: lambda v: is_number(v) and math.isfinite(v)}.get(
            self.kind, lambda v: isinstance(v, self.kind))(value)
        return kind and (self.lo is None or value >= self.lo) and (self.test is None or self.test(value))


def shown(value: Any) -> str:
    """A value as found, its kind and its JSON: `an array [1, 2]`, `a string "two"`, `null` (cut when long)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    kind = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}.get(
        type(value), f"a {type(value).__name__}")  # YAML gives dates too
    text = json.dumps(value, default=str)
    return f"{kind} {text if len(text) <= 300 else text[:297] + '...'}"


def problem(value: Any, shape: Field, subject: str = "the file", where: str = "") -> Optional[str]:
    """Why `value` is not of `shape`, the first thing wrong in declaration order ("`where` is FOUND, not EXPECTED",
    `where` a path like `shards[1].after.next_doc`; `subject` at the top), or None."""
    if value is None and shape.null:
        return None
    if not shape.fits(value):
        return f"{f'`{where}`' if where else subject} is {shown(value)}, not {shape.expected()}"
    at = (lambda key: f"{where}[{key}]") if isinstance(value, list) else (lambda key: f"{where}.{key}" if where else str(key))
    for name, f in shape.fields.items():  # fields belong to objects
        if name not in value:
            if f.required:
                return f"`{at(name)}` is missing"
        elif why := problem(value[name], f, subject, at(name)):
            return why
    items = enumerate(value) if isinstance(value, list) else value.items() if isinstance(value, dict) else ()
    for key, item in items if shape.items else ():
        if why := problem(item, shape.items, subject, at(key)):
            return why
    return None


def parse(raw: bytes, subject: str = "the file", as_yaml: bool = False) -> tuple[Any, Optional[str]]:
    """(the value `raw` holds, None), or (None, why it does not parse: "SUBJECT is not UTF-8 text", "... is not JSON")."""
    try:
        text = raw.decode("utf-8")  # bytes to json.loads would also take UTF-16 and -32
        return (yaml.safe_load(text) if as_yaml else json.loads(text)), None
    except UnicodeDecodeError:
        return None, f"{subject} is not UTF-8 text"
    except ValueError as e:  # JSONDecodeError
        return None, f"{subject} is not JSON ({e})"
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return None, f"{subject} is not valid YAML{at} ({getattr(e, 'problem', None) or e})"
    except RecursionError:
        return None, f"{subject} nests deeper than any file nanopt writes"


def damaged(path: Path, why: str, fix: str = "") -> ConfigError:
    """The one paragraph for a damaged file: "FILE: WHERE is FOUND, not EXPECTED. FIX"."""
    return ConfigError(f"{path}: {why}." + (f" {fix}" if fix else ""))


def raw(path: Path) -> Optional[bytes]:
    """The bytes of one of nanopt's files, None when nothing is at the name; ConfigError for no regular file there
    (io's paragraph) or a link to nothing (which a reader taking it for absent would silently ignore)."""
    try:
        return read_bytes(path)
    except FileNotFoundError as e:
        if os.path.islink(path):
            raise ConfigError(path_problem(e)) from None
        return None


def read(path: Path, shape: Field, fix: str = "") -> Any:
    """The file at `path` (YAML by its suffix, else JSON) checked against `shape`: its value, or None (raw())."""
    if (data := raw(path)) is None:
        return None
    value, why = parse(data, as_yaml=Path(path).suffix in (".yaml", ".yml"))
    if why is None and (why := problem(value, shape)) is None:
        return value
    raise damaged(path, why, fix)
