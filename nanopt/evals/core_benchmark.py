"""nanochat's CORE score on DCLM's eval bundle (core.yaml, eval_data/*.jsonl, eval_meta_data.csv), example by example
as nanochat's core_eval.py and base_eval.py score it (bench/core_parity.py checks): items shuffled with seed 1337, cut
to `limit`; few-shot examples from the kept items; BOS first; prompts cropped on the left; multiple_choice and schema
pick the option of lowest mean loss where the options differ; language_modeling needs every continuation token
greedy. The one continuation scorer (scoring.py) scores the tokens, as lm-eval's."""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from nanopt.data.tokenizer import Tokenizer
from nanopt.distributed.runtime import Runtime
from nanopt.errors import ConfigError
from nanopt.evals.scoring import TokenScores, token_scores
from nanopt.io import read_text
from nanopt.recipe.model import Llama

# The fields each task type's items need, and the list an item's `gold` indexes.
FIELDS = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
          "language_modeling": ("context", "continuation")}
OPTIONS = {"multiple_choice": "choices", "schema": "context_options"}
SHUFFLE_SEED = 1337  # nanochat's base_eval.py shuffles each task's items with it before cutting them
FEWSHOT_SEED = 1234  # nanochat's core_eval.py draws item i's few-shot examples with Random(1234 + i)
HINT = ("--core takes DCLM's eval bundle as nanochat downloads it (eval_bundle.zip: core.yaml, eval_data/, "
        "eval_meta_data.csv); nanopt.evals.taskgen.write_bundle writes a small one")


@dataclass
class CoreTask:
    label: str
    type: str  # multiple_choice | schema | language_modeling
    num_fewshot: int
    continuation_delimiter: str
    random_baseline: float  # percent: 25 for four choices
    items: list[dict[str, Any]]  # in scoring order: shuffled as nanochat shuffles them, then cut to `limit`


def read_bundle(directory: str | Path, limit: int = 0) -> list[CoreTask]:
    """Every task core.yaml lists, with its items and random baseline; `limit` > 0 keeps that many per task. All of it
    is read before any scoring by its formats' libraries (yaml, csv, json), each item rendered once: what they raise
    is one ConfigError naming the file and line (_reading). nanopt checks what they would accept: a dataset_uri
    leaving the bundle, a baseline outside [0, 100), a gold outside its options, too few items for the shots."""
    root, table = Path(directory), Path(directory) / "eval_meta_data.csv"
    with _reading(root / "core.yaml", f"an `icl_tasks` list whose tasks have label, icl_task_type (one of "
                  f"{', '.join(FIELDS)}), dataset_uri and num_fewshot"):
        specs = yaml.safe_load(read_text(root / "core.yaml"))["icl_tasks"]
        specs = [(s["label"], s["icl_task_type"], s["dataset_uri"], s["num_fewshot"], s.get(
            "continuation_delimiter", " "), FIELDS[s["icl_task_type"]]) for s in specs or [None]]  # none: refused
    with _reading(table, "CSV with the columns `Eval Task` and `Random baseline` (in percent) and a row per task"):
        reader = csv.DictReader(io.StringIO(read_text(table)))
        rows = {row["Eval Task"]: (row["Random baseline"], reader.line_num) for row in reader}
        baselines = [_baseline(table, label, *rows[label]) for label, *_ in specs]
    return [_read_task(root, spec, baseline, limit) for spec, baseline in zip(specs, baselines)]


@contextlib.contextmanager
def _reading(where: str | Path, what: str) -> Iterator[None]:
    """What a format's library (or a missing key, a wrong type) raises on a bundle's file: one ConfigError."""
    try:
        yield
    except ConfigError:
        raise
    except (OSError, ValueError, LookupError, TypeError, yaml.YAMLError, csv.Error) as e:  # decoding: a ValueError
        raise ConfigError(f"{where} cannot be read as {what} ({type(e).__name__}: {e}). {HINT}.") from None


def _baseline(path: Path, label: str, written: Any, line: int) -> float:
    """A task's random baseline in percent: finite and in [0, 100), since centering divides by 100 minus it."""
    with contextlib.suppress(TypeError, ValueError):
        if math.isfinite(value := float(written)) and 0 <= value < 100:
            return value
    raise ConfigError(f"{path}:{line}: task {label}'s `Random baseline` is {written!r}; it must be a number of "
                      f"percent from 0 up to, not including, 100 (the accuracy of guessing: 25 for four "
                      f"choices, 0 for language modeling). Mend that line. {HINT}.")


def _read_task(root: Path, spec: tuple, baseline: float, limit: int) -> CoreTask:
    label, kind, uri, shots, delimiter, fields = spec
    name = Path(str(uri))  # inside the bundle: a bundle names its own files, and one elsewhere is not read
    if not str(uri) or name.is_absolute() or ".." in name.parts:
        raise ConfigError(f"{root / 'core.yaml'}: task {label}'s dataset_uri {uri!r} leaves the bundle; give the "
                          f"path of its JSONL file inside {root / 'eval_data'} (e.g. {label}.jsonl), and copy the "
                          f"file there if it lives elsewhere.")
    items = _read_items(root / "eval_data" / name, kind, fields)
    random.Random(SHUFFLE_SEED).shuffle(items)
    items = items[:limit] if limit > 0 else items
    shots = shots[0] if isinstance(shots, list) and shots else shots
    if not isinstance(shots, int) or not 0 <= shots < len(items):
        raise ConfigError(f"{root / 'core.yaml'}: task {label} has {len(items)} item(s) (limit {limit}), too few "
                          f"to draw num_fewshot {shots!r} examples from the others for each.")
    return CoreTask(str(label), kind, shots, str(delimiter), baseline, items)


def _read_items(path: Path, kind: str, fields: tuple[str, ...]) -> list[dict]:
    with _reading(path, "UTF-8 text"):
        lines = read_text(path).split("\n")  # not splitlines(): JSON may hold U+2028
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        with _reading(f"{path}:{number}", f"a {kind} item: one JSON object with {', '.join(fields)}"):
            item = json.loads(line)
            render_prompts(kind, item, "", [])  # what scoring reads of it; as an example, its gold too:
            gold, options = (item["gold"], item[OPTIONS[kind]]) if kind in OPTIONS else (0, [None])
        if not (isinstance(options, list) and type(gold) is int and 0 <= gold < len(options)):
            raise ConfigError(f"{path}:{number}: a {kind} item's gold is {gold!r}, not an index into its "
                              f"{OPTIONS[kind]} (0 to {len(options) - 1}).")
        items.append(item)
    if not items:
        raise ConfigError(f"{path} holds no items (the file is empty); a task file holds one JSON object a line.")
    return items


def render_prompts(kind: str, item: dict, delimiter: str, shots: list[dict]) -> list[str]:
    """nanochat's prompts for one item: one per choice or context option, or (language_modeling) the prompt without
    and with its continuation."""
    d = delimiter
    if kind == "multiple_choice":
        head = "".join(f"{s['query']}{d}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{head}{item['query']}{d}{choice}" for choice in item["choices"]]
    if kind == "schema":
        head = "".join(f"{s['context_options'][s['gold']]}{d}{s['continuation']}\n\n" for s in shots)
        return [f"{head}{context}{d}{item['continuation']}" for context in item["context_options"]]
    head = "".join(f"{str(s['context']).strip()}{d}{s['continuation']}\n\n" for s in shots)
    prompt = f"{head}{str(item['context']).strip()}{d}"
    return [prompt.strip(), f"{prompt}{item['continuation']}"]


def fewshot(task: CoreTask, idx: int) -> list[dict]:
    """Item idx's examples: Random(1234 + idx).sample over the other items, as nanochat draws them (a range of the
    same length gives the same picks, without building the list)."""
    picks = random.Random(FEWSHOT_SEED + idx).sample(range(len(task.items) - 1), task.num_fewshot)
    return [task.items[i + (i >= idx)] for i in picks]


def sequences(task: CoreTask, idx: int, tokenizer: Tokenizer, max_len: int) -> list[tuple[list[int], int]]:
    """(tokens, start) per prompt: BOS + prompt cut to its last max_len tokens; start is the first scored token."""
    prompts = render_prompts(task.type, task.items[idx], task.continuation_delimiter, fewshot(task, idx))
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    tokens = [bos + tokenizer.encode(p) for p in prompts]
    if task.type == "schema":  # the options differ before a shared continuation: score that
        shared = len(os.path.commonprefix([t[::-1] for t in tokens]))
        starts = [len(t) - shared for t in tokens]
    else:  # the choices (or the continuation) follow a shared context
        starts = [len(os.path.commonprefix(tokens))] * len(tokens)
    if task.type == "language_modeling":
        tokens, starts = tokens[1:], starts[1:]
    # Token 0 has no prediction: a prompt without BOS, or one whose answer reaches past the crop, scores from 1.
    return [(t[-max_len:], max(1, s - max(0, len(t) - max_len))) for t, s in zip(tokens, starts)]


def evaluate_core(model: Llama, tokenizer: Tokenizer, tasks: list[CoreTask], rt: Runtime,
                  batch_size: int = 8) -> dict[str, Any]:
    """{"core", "tasks": {label: {accuracy, centered, random_baseline, n}}, "examples": {label: [bool]}} on every
    rank; rank r scores items r, r + world, ...; batch_size bounds the prompts per forward."""
    parts = rt.gather_objects([_score_task(model, tokenizer, t, rt, batch_size) for t in tasks])
    out: dict[str, Any] = {"tasks": {}, "examples": {}}
    for k, t in enumerate(tasks):
        merged = {i: ok for part in parts for i, ok in part[k].items()}
        correct = [merged[i] for i in range(len(t.items))]
        accuracy = sum(correct) / len(correct)
        chance = 0.01 * t.random_baseline
        out["tasks"][t.label] = {"accuracy": accuracy, "centered": (accuracy - chance) / (1 - chance),
                                 "random_baseline": t.random_baseline, "n": len(correct)}
        out["examples"][t.label] = correct
    centered = [r["centered"] for r in out["tasks"].values()]
    out["core"] = sum(centered) / len(centered) if centered else math.nan
    return out


def _score_task(model: Llama, tokenizer: Tokenizer, task: CoreTask, rt: Runtime, batch_size: int) -> dict[int, bool]:
    max_len = model.rope_cos.shape[0]
    mine, got = range(rt.rank, len(task.items), rt.world_size), {}  # this rank's items
    for start in range(0, len(mine), batch_size):  # a chunk at a time: a task's prompts may be gigabytes of tokens
        chunk = [(idx, sequences(task, idx, tokenizer, max_len)) for idx in mine[start : start + batch_size]]
        scores = iter(token_scores(model, [(t[:s], t[s:]) for _, seqs in chunk for t, s in seqs], rt, batch_size))
        got.update((idx, _right(task, idx, [next(scores) for _ in seqs])) for idx, seqs in chunk)
    return got


def _right(task: CoreTask, idx: int, scores: list[TokenScores]) -> bool:
    """Whether item idx is answered right, from its prompts' scored tokens."""
    if task.type == "language_modeling":  # right when every continuation token is the greedy prediction
        lp, greedy = scores[0]
        return len(lp) > 0 and bool(greedy.all())
    # .item() and list.index as nanochat's: the first of equal mean losses wins, a NaN mean as it does there
    means = [(-lp).mean().item() for lp, _ in scores]
    return means.index(min(means)) == task.items[idx]["gold"]
