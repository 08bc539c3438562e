"""lm-eval task input checked before the harness scores it: a task's local data files (present, non-empty, one JSON
object a line), each row of its evaluation split (the fields its templates use, a multiple-choice gold inside its
choices), and what the harness raises on a YAML or its data, named at the boundary. Every problem is one ConfigError
paragraph naming the task, its file and line, and the cause (exit 2). The harness's objects (its task manager, its
tasks) come in from harness.py; lm-eval and what it brings (datasets, jinja2) are imported only where used."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from nanopt import hub
from nanopt.errors import ConfigError

TASK_HINT = ("Check the task YAML and its data_files: local paths must exist and hold one JSON object a line with "
             "the fields the YAML's doc_to_text, doc_to_target and doc_to_choice use (hub datasets need the network).")
JSON_LINES = (".jsonl", ".ndjson")


def load_tasks(manager: Any, tasks: list[str]) -> list[Any]:
    """The harness's Task and Group objects for `tasks`, each built (its YAML and data read) and each row of its
    evaluation split rendered, with a multiple-choice gold inside its choices (the harness itself only warns about
    one past the end and scores it wrong). ConfigError naming the task, its file and line, and the cause."""
    built: list[Any] = []
    for name in tasks:
        _check_files(manager, name)
        try:
            loaded = manager.load([name])
        except Exception as e:  # the boundary: whatever the harness or datasets raise on a YAML or its data
            if hub.is_unreachable_error(e):
                raise ConfigError(_hub_problem(manager, name, e)) from None
            raise ConfigError(_load_problem(manager, name, e)) from None
        for task in loaded["tasks"].values():
            _check_rows(task)
        top = loaded["groups"].get(name, loaded["tasks"].get(name))
        built += [top] if top is not None else list(loaded["tasks"].values())  # a tag: its tasks
    return built


def input_errors() -> tuple[type[BaseException], ...]:
    """What the harness raises on a task's YAML or data (not on a model or device failure, a RuntimeError)."""
    import datasets.exceptions  # both come with lm-eval
    import jinja2

    return (ValueError, LookupError, FileNotFoundError, StopIteration, datasets.exceptions.DatasetsError,
            jinja2.TemplateError)


def cause(e: BaseException) -> str:
    if isinstance(e, StopIteration):
        return "StopIteration (the data holds no rows)"
    inner = e.__cause__ or e.__context__  # datasets wraps the reader's own error ("JSON parse error ... row 1")
    text = f"{type(e).__name__}: {e}"
    return f"{text} ({type(inner).__name__}: {inner})" if inner is not None and str(inner) not in text else text


def files_note(files: list[Path]) -> str:
    return f" (data {', '.join(map(str, dict.fromkeys(files)))})" if files else ""


def _local_files(data_files: Any) -> list[Path]:
    """The local paths in a YAML's dataset_kwargs.data_files (a path, a list, or a map of split to either)."""
    if isinstance(data_files, dict):
        return [p for value in data_files.values() for p in _local_files(value)]
    values = data_files if isinstance(data_files, list) else [data_files]
    return [Path(v) for v in values if isinstance(v, str) and "://" not in v]


def entry_files(manager: Any, name: str, seen: Optional[set[str]] = None) -> list[Path]:
    """The local data files of a task, or of a group's tasks, as the harness's index holds their YAMLs."""
    seen = set() if seen is None else seen
    if name in seen:
        return []
    seen.add(name)
    entry = manager.task_index.get(name)
    cfg = getattr(entry, "cfg", None) or {}
    kwargs = cfg.get("dataset_kwargs")
    files = _local_files(kwargs.get("data_files")) if isinstance(kwargs, dict) else []
    children = cfg.get("task") if "group" in cfg else None
    for child in children if isinstance(children, list) else []:
        if isinstance(child, str):
            files += entry_files(manager, child, seen)
        elif isinstance(child, dict) and isinstance(child.get("dataset_kwargs"), dict):
            files += _local_files(child["dataset_kwargs"].get("data_files"))
    return files


def _file_problem(path: Path) -> Optional[str]:
    """What is wrong with a local data file, read as nanopt reads JSON lines; None when nothing is found."""
    if not path.is_file():
        return f"{path} does not exist"
    if path.suffix not in JSON_LINES:
        return None
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines(): JSON may hold U+2028
    except (OSError, ValueError) as e:
        return f"{path} cannot be read ({e})"
    if not any(line.strip() for line in lines):
        return f"{path} has no rows (the file is empty)"
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            return f"{path}:{number} is not JSON ({e})"
        if not isinstance(row, dict):
            return f"{path}:{number} is a JSON {type(row).__name__}, not an object"
    return None


def _check_files(manager: Any, name: str) -> None:
    """A task's (or group's) local data files read before the harness reads them: a missing file, an empty one or
    a line that is not a JSON object is named here, file and line, where datasets would log and raise its own."""
    entry = manager.task_index.get(name)
    for path in dict.fromkeys(entry_files(manager, name)):
        if problem := _file_problem(path):
            where = f" from {entry.yaml_path}" if getattr(entry, "yaml_path", None) else ""
            raise ConfigError(f"lm-eval task {name}{where} cannot be read: {problem}. {TASK_HINT}")


def _hub_datasets(manager: Any, name: str, seen: Optional[set[str]] = None) -> list[str]:
    """The dataset_path of a task, or of a group's tasks, as the harness's index holds their YAMLs."""
    seen = set() if seen is None else seen
    if name in seen:
        return []
    seen.add(name)
    cfg = getattr(manager.task_index.get(name), "cfg", None) or {}
    paths = [cfg["dataset_path"]] if isinstance(cfg.get("dataset_path"), str) else []
    children = cfg.get("task") if "group" in cfg else None
    for child in children if isinstance(children, list) else []:
        paths += _hub_datasets(manager, child, seen) if isinstance(child, str) else []
    return list(dict.fromkeys(paths))


def _hub_problem(manager: Any, name: str, e: BaseException) -> str:
    """The paragraph for a task whose data is on the hub, which cannot be reached, and not cached."""
    paths = _hub_datasets(manager, name)
    data = f" (its data: {', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''})" if paths else ""
    return hub.not_cached(f"lm-eval task {name}{data}", e, "Or score local tasks: `nanopt eval --make-tasks tasks/` "
                          "writes demo tasks, nanopt_mc and nanopt_rolling from `--include-path tasks/` (in training "
                          "`eval.tasks_path`), and a CORE bundle, tasks/core for `--core` (`eval.core`); "
                          "docs/evaluation.md, Downstream tasks.", f"score it once (`nanopt eval RUN --tasks {name} "
                          f"--limit 1`)")


def _load_problem(manager: Any, name: str, e: BaseException) -> str:
    """The paragraph for a task the harness could not build though its files read (_check_files): the cause is in
    its YAML or its first row; for a group, the paragraph of the first of its tasks that does not build alone."""
    entry = manager.task_index.get(name)
    cfg = getattr(entry, "cfg", None) or {}
    children = cfg.get("task") if "group" in cfg else None
    for child in children if isinstance(children, list) else []:
        if isinstance(child, str) and child != name:
            try:
                manager.load([child])
            except Exception as child_error:  # as in load_tasks
                return _load_problem(manager, child, child_error)
    files = list(dict.fromkeys(entry_files(manager, name)))
    yaml_path = getattr(entry, "yaml_path", None)
    where = f" from {yaml_path}" if yaml_path else ""
    first = f" or the first row of its data ({_first_row(files[0])}), which the harness renders while it builds " \
            f"the task" if len(files) == 1 else ""
    return (f"lm-eval could not build task {name}{where}{files_note(files)}: {cause(e)}. The cause is in the "
            f"YAML{first}. {TASK_HINT}")


def _first_row(path: Path) -> str:
    """FILE:LINE of a JSON-lines file's first row (blank lines hold none), or FILE row 1 elsewhere."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n") if path.suffix in JSON_LINES else []
    except (OSError, ValueError):
        lines = []
    return next((f"{path}:{n}" for n, line in enumerate(lines, 1) if line.strip()), f"{path} row 1")


def _json_rows(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) per row of a JSON-lines file _check_files has read: the harness's rows, in order."""
    lines = enumerate(path.read_text(encoding="utf-8").split("\n"), 1)
    return [(number, json.loads(line)) for number, line in lines if line.strip()]


def _fields_used(task: Any) -> set[str]:
    """The data fields the YAML's doc_to_text, doc_to_target and doc_to_choice read: a field's name, or a Jinja
    template's variables."""
    import jinja2
    import jinja2.meta

    features, used = set(getattr(task, "features", []) or []), set()
    for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
        value = getattr(task.config, key, None)
        if not isinstance(value, str):
            continue
        if value in features:
            used.add(value)
            continue
        try:
            used |= jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(value)) & features
        except jinja2.TemplateError:
            pass  # rendering the row names it
    return used


def _row_problem(task: Any, doc: Any, missing: list[str]) -> Optional[str]:
    """Why one row cannot be scored, or None: a field it lacks (the JSON reader fills it with null, and the
    template renders "None"), a template that fails on it, a gold outside its choices (lm-eval's rule: an int
    indexes the choices, a string is one of them; a list holds several)."""
    if missing:
        return f"it has no {', '.join(sorted(missing))}"
    try:
        text, target = task.doc_to_text(doc), task.doc_to_target(doc)
        if task.OUTPUT_TYPE != "multiple_choice":
            return None
        choices = task.doc_to_choice(doc)
    except Exception as e:  # a template or a task's own function failing on this row's content
        return f"it cannot be rendered ({cause(e)})"
    if not isinstance(choices, list) or not choices:
        return f"its choices are {choices!r}, not a list of at least one"
    gold = text if isinstance(text, int) else target  # several contexts (winogrande): the text is the gold index
    for g in gold if isinstance(gold, list) else [gold]:
        inside = 0 <= g < len(choices) if isinstance(g, int) else isinstance(g, str) and g in choices
        if not inside:
            return f"its gold {g!r} is not one of its {len(choices)} choices (an index 0-{len(choices) - 1}, or " \
                   f"one of the choice strings)"
    return None


def _check_rows(task: Any) -> None:
    """ConfigError naming the first row of the task's evaluation split that cannot be scored (_row_problem), by
    FILE:LINE where the rows are one local JSON-lines file read as they are. Only tasks whose data is local files
    (what a user wrote, --include-path) are checked row by row: the harness's own hub tasks are its to keep, and a
    benchmark is not refused for one odd row the harness scores as wrong."""
    config = task.config
    split = config.test_split if task.has_test_docs() else config.validation_split
    data_files = (config.dataset_kwargs or {}).get("data_files") if isinstance(config.dataset_kwargs, dict) else None
    files = _local_files(data_files.get(split) if isinstance(data_files, dict) else data_files)
    if not files:
        return
    as_read = len(files) == 1 and files[0].suffix in JSON_LINES and config.process_docs is None
    rows, used = (_json_rows(files[0]), _fields_used(task)) if as_read else ([], set())
    for index, doc in enumerate(task.eval_docs):
        line, raw = rows[index] if index < len(rows) else (None, {})
        if problem := _row_problem(task, doc, [f for f in used if line is not None and f not in raw]):
            where = f"{files[0]}:{line}" if line is not None else f"row {index + 1} of its {split} split" \
                                                                   f"{files_note(files)}"
            raise ConfigError(f"lm-eval task {getattr(task, 'task_name', None) or config.task}: {where}: {problem}. "
                              f"Every row needs the fields its YAML's doc_to_text, doc_to_target and doc_to_choice "
                              f"use, and a multiple-choice gold inside its choices; mend or remove that row.")
