"""THE demo-task writer: small tasks from held-out text, their data local JSONL files, so `nanopt eval --tasks/--core`
can be tried and tested offline. make_tasks writes lm-eval tasks `nanopt_mc` (the true continuation among four),
`nanopt_rolling` (perplexity of short passages) and their group `nanopt_tasks`; write_bundle a CORE bundle."""
from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path
from typing import Callable, Optional

import yaml

from nanopt.data.shards import corpus_documents, fetch_sdist
from nanopt.errors import ConfigError
from nanopt.io import write_json, write_text
from nanopt.rundirs import refuse_inside_checkpoints

MC, ROLLING, GROUP = "nanopt_mc", "nanopt_rolling", "nanopt_tasks"
TASKS_FILE = "nanopt_tasks.json"
OURS = {f"{MC}.yaml", f"{MC}.jsonl", f"{ROLLING}.yaml", f"{ROLLING}.jsonl", f"{GROUP}.yaml", TASKS_FILE}
# An item: up to CONTEXT_BYTES of a held-out line, then its next CHOICE_BYTES against three pieces of that length
# cut from other lines. Equal lengths: neither acc nor acc_norm can favour a choice for its length. The item fits
# the CPU speedrun's 64-token byte context with BOS (measured: 48% at step 50 -> 76% at step 300, chance 25%).
CONTEXT_BYTES, CHOICE_BYTES = 48, 12
MIN_LINE_BYTES = 40
MAX_ITEM_BYTES = CONTEXT_BYTES + CHOICE_BYTES
PASSAGE_BYTES = 256  # a rolling passage is whole lines, at least this long


def _mc_items(texts: list[str], n: int, rng: random.Random) -> list[dict]:
    """n items from distinct ASCII lines, gold placed at random. The context stops inside a word and each choice
    finishes it and starts two more: spelling is what a small model learns first, and two word starts cannot merge
    into the context's last token under BPE (the harness's hf model refuses an empty continuation)."""
    lines = list(dict.fromkeys(line.strip() for text in texts for line in text.splitlines()
                               if len(line.strip()) >= MIN_LINE_BYTES and line.isascii()))  # ordered: seeded
    starts = {line: [i for i in range(1, len(line) - CHOICE_BYTES + 1) if line[i - 1:i + 1].isalpha()
                     and line[i:i + CHOICE_BYTES].count(" ") >= 2] for line in lines}
    lines = [line for line in lines if starts[line]]
    items: list[dict] = []
    if len(lines) < 4:
        return items
    for line in rng.sample(lines, min(n, len(lines))):
        cut = rng.choice(starts[line])
        context, gold = line[max(0, cut - CONTEXT_BYTES):cut], line[cut:cut + CHOICE_BYTES]
        choices: list[str] = []
        while len(choices) < 3:
            other = rng.choice(lines)
            start = rng.choice(starts[other])
            piece = other[start:start + CHOICE_BYTES]
            if piece != gold and piece not in choices:
                choices.append(piece)
        label = rng.randrange(4)
        choices.insert(label, gold)
        items.append({"context": context, "choices": choices, "gold": label})
    return items


def _passages(texts: list[str], n: int, rng: random.Random) -> list[dict]:
    """n passages of whole consecutive lines, a few hundred bytes each, drawn at random and kept in text order."""
    chunks = []
    for text in texts:
        lines: list[str] = []
        for line in text.splitlines():
            lines.append(line.rstrip())
            passage = "\n".join(lines).strip()
            if len(passage.encode()) >= PASSAGE_BYTES:
                chunks.append(passage)
                lines = []
    picked = sorted(rng.sample(range(len(chunks)), min(n, len(chunks))))
    return [{"text": chunks[k]} for k in picked]


def _write_task(out_dir: Path, name: str, rows: list[dict], output_type: str, fields: dict, metrics: list) -> Path:
    data = write_text(out_dir / f"{name}.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    return write_text(out_dir / f"{name}.yaml", yaml.safe_dump({
        "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test", "output_type": output_type, **fields, "metric_list": metrics,  # absolute: any cwd
        "metadata": {"version": 1.0}}, sort_keys=False))


@functools.cache
def test_plays() -> list[str]:
    """The embedded corpus's held-out test plays, read once per process (the tasks and the bundle share them)."""
    return [text for _, text in corpus_documents(fetch_sdist())["test"]]


def make_tasks(out_dir: str | Path, texts: Optional[list[str]] = None, n: int = 200, seed: int = 0) -> list[Path]:
    """Write `nanopt_mc`, `nanopt_rolling` and `nanopt_tasks` into `out_dir` (new, empty, or an earlier output) from
    `texts` (default: the embedded corpus's held-out test plays); return the YAML paths. Same inputs, same bytes."""
    out_dir = Path(out_dir)
    if n < 4:
        raise ConfigError(f"make_tasks needs n >= 4 items per task (got n={n}): fewer cannot tell a model from "
                          f"chance (25% on the multiple-choice task). Pass a larger n.")
    refuse_inside_checkpoints(out_dir, "--make-tasks")  # a file at out_dir: mkdir's OSError, named by the CLI
    ours = OURS | ({BUNDLE_DIR} if _bundle_problem(out_dir / BUNDLE_DIR) is None else set())
    if others := (sorted(p.name for p in out_dir.iterdir() if p.name not in ours) if out_dir.is_dir() else []):
        raise ConfigError(f"{out_dir} holds files make_tasks did not write ({', '.join(others[:5])}), which it "
                          f"will not mix with its tasks. Pass a new or empty directory, or one that holds only "
                          f"earlier generated tasks.")  # only our own earlier output is replaced
    source = "given texts" if texts is not None else "the embedded corpus's test plays"
    if texts is None:
        texts = test_plays()
    items, passages = _mc_items(texts, n, random.Random(seed)), _passages(texts, n, random.Random(seed + 1))
    if min(len(items), len(passages)) < n:
        raise ConfigError(f"the {source} ({sum(len(t.encode()) for t in texts)} bytes) make only {len(items)} "
                          f"multiple-choice items and {len(passages)} passages, fewer than n={n}. Pass more "
                          f"text (distinct ASCII lines of at least {MIN_LINE_BYTES} bytes) or a smaller n.")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [_write_task(out_dir, MC, items, "multiple_choice", {
        "doc_to_text": "{{context}}", "doc_to_choice": "choices", "doc_to_target": "gold",
        "target_delimiter": ""},  # a choice goes on where the context stops, inside a word
        [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")]),
        _write_task(out_dir, ROLLING, passages, "loglikelihood_rolling", {
            "doc_to_text": "", "doc_to_target": "text"},  # the harness's own aggregations, said so it does not warn
            [{"metric": m, "aggregation": agg, "higher_is_better": False} for m, agg in (
                ("word_perplexity", "weighted_perplexity"), ("byte_perplexity", "weighted_perplexity"),
                ("bits_per_byte", "bits_per_byte"))])]
    group = {"group": GROUP, "task": [MC, ROLLING], "metadata": {"version": 1.0}}
    paths.append(write_text(out_dir / f"{GROUP}.yaml", yaml.safe_dump(group, sort_keys=False)))
    write_json(out_dir / TASKS_FILE, {"made_by": "nanopt.evals.taskgen.make_tasks", "source": source, "n": n,
                                    "seed": seed, "tasks": [MC, ROLLING], "group": GROUP})
    return paths


WORD = re.compile(r"[A-Za-z]{5,}")  # a word long enough to cut in two
GENERATED = [("nanopt_line_end", "multiple_choice", 0, 25.0), ("nanopt_line_start", "schema", 2, 50.0),
             ("nanopt_word_end", "language_modeling", 2, 0.0)]


BUNDLE_DIR = "core"  # where `nanopt eval --make-tasks DIR` writes its bundle: DIR/core, beside make_tasks' output
BUNDLE_FILES = {"core.yaml", "eval_meta_data.csv", "eval_data"}


def _bundle_problem(root: Path) -> Optional[str]:
    """Why `root` is neither absent, empty, nor an earlier write_bundle's output, or None."""
    if not root.exists():
        return None
    others = [p.name for p in root.iterdir() if p.name not in BUNDLE_FILES]
    data, labels = root / "eval_data", {f"{label}.jsonl" for label, *_ in GENERATED}
    others += [f"eval_data/{p.name}" for p in data.iterdir() if p.name not in labels] if data.is_dir() else \
        ["eval_data"] * data.exists()
    return f"holds files write_bundle did not write ({', '.join(sorted(others)[:5])})" if others else None


def write_bundle(out_dir: str | Path, texts: list[str], seed: int = 0, n: int = 60) -> Path:
    """A small bundle in DCLM's layout from held-out texts, n items per GENERATED task, into a new or empty directory
    or over an earlier bundle."""
    if problem := _bundle_problem(Path(out_dir)):
        raise ConfigError(f"{out_dir} {problem}, which it will not mix with its bundle. Pass a new or empty "
                          f"directory, or one that holds only an earlier generated bundle.")
    rng = random.Random(seed)
    docs = [[s.strip() for s in t.split("\n") if len(s.strip()) >= 20] for t in texts]
    spots = [(d, i) for d in docs for i in range(3, len(d)) if WORD.search(d[i])]
    if len({d[i] for d, i in spots}) < 8:
        raise ConfigError("write_bundle needs 8+ different lines of 20+ characters with a 5-letter word in texts.")

    def cut(keep: float) -> tuple[str, str, int]:  # a passage cut inside a word; the line's rest; the word's rest
        d, i = rng.choice(spots)
        word = rng.choice(list(WORD.finditer(d[i])))
        at = word.start() + int(len(word.group()) * keep)
        return "\n".join(d[i - 3 : i] + [d[i][:at]]), d[i][at:], word.end() - at

    root = Path(out_dir)
    (root / "eval_data").mkdir(parents=True, exist_ok=True)
    specs, table = [], ["Eval Task,Task Type,#shots,Random baseline\n"]
    for label, kind, shots, baseline in GENERATED:
        items = [_generated_item(kind, cut, rng) for _ in range(n)]
        write_text(root / "eval_data" / f"{label}.jsonl", "".join(json.dumps(item) + "\n" for item in items))
        specs.append({"label": label, "dataset_uri": f"{label}.jsonl", "num_fewshot": [shots],
                      "icl_task_type": kind, "continuation_delimiter": ""})  # the cut is inside a word
        table.append(f"{label},{kind},{shots},{baseline}\n")
    write_text(root / "core.yaml", yaml.safe_dump({"icl_tasks": specs}, sort_keys=False, default_flow_style=None))
    write_text(root / "eval_meta_data.csv", "".join(table))
    return root


def _generated_item(kind: str, cut: Callable[[float], tuple[str, str, int]], rng: random.Random) -> dict:
    """Four lines, the last cut inside a word, then: the line's rest among three other lines' (multiple_choice);
    which of two such passages the rest follows (schema); the word's rest (language_modeling). Cutting inside a
    word makes the context count even for small models (next whole lines score at chance for them)."""
    context, rest, word_rest = cut(0.7 if kind == "language_modeling" else 0.5)
    if kind == "language_modeling":
        return {"context": context, "continuation": rest[:word_rest]}
    pick = 0 if kind == "schema" else 1  # schema: other passages; multiple_choice: other lines' rests
    options = [cut(0.5)[pick] for _ in range(3 if kind == "multiple_choice" else 1)]
    gold = rng.randrange(len(options) + 1)
    options.insert(gold, (context, rest)[pick])
    if kind == "schema":
        return {"context_options": options, "continuation": rest, "gold": gold}
    return {"query": context, "choices": options, "gold": gold}
