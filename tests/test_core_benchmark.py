"""nanopt.evals.core_benchmark: DCLM's eval bundle read, prompts rendered and scored as nanochat's core_eval.py does,
the CORE arithmetic, and the generated bundle (taskgen.write_bundle). Parity with nanochat: bench/core_parity.py."""
from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest
import torch
from conftest import BOS, CPU, stub_runtime

from nanopt.config import ModelConfig
from nanopt.data.tokenizer import ByteTokenizer
from nanopt.errors import ConfigError
from nanopt.evals import core_benchmark as core, taskgen
from nanopt.recipe.model import build_model

TEXTS = ["\n".join(f"Line {i} of text {t}: the wonderful quietness of evening settles" for i in range(30))
         for t in range(3)]


class Bigram(torch.nn.Module):
    """Logits that depend on the current token only: row t of a V×V table. The scorer crops to rope_cos's length."""
    def __init__(self, max_seq_len: int = 64, logits: list[tuple[str, str, float]] = ()):  # (after, token, logit)
        super().__init__()
        self.table, self.rope_cos = torch.zeros(257, 257), torch.zeros(max_seq_len, 1)
        for after, token, logit in logits:
            self.table[ord(after) if len(after) == 1 else BOS, ord(token)] = logit

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:  # the scorer's forward: hidden states, then logits
        assert idx.shape[1] <= self.rope_cos.shape[0]
        return self.table[idx]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h


def task(kind: str, items: list[dict], delimiter: str = " ", shots: int = 0, baseline: float = 0.0) -> core.CoreTask:
    return core.CoreTask(f"t_{kind}", kind, shots, delimiter, baseline, items)


def score(model: torch.nn.Module, tasks: list[core.CoreTask], batch_size: int = 8) -> dict:
    return core.evaluate_core(model, ByteTokenizer(), tasks, CPU, batch_size=batch_size)


# --- prompts -------------------------------------------------------------------------------------------------------
PROMPTS = {  # kind -> (item, delimiter, shots, the prompts: one per choice or context, or without and with the answer)
    "multiple_choice": ({"query": "Q", "choices": ["x", "y"], "gold": 0}, ": ",
                        [{"query": "Q1", "choices": ["A", "B"], "gold": 1}] * 2,
                        ["Q1: B\n\nQ1: B\n\nQ: x", "Q1: B\n\nQ1: B\n\nQ: y"]),
    "schema": ({"context_options": ["c", "d"], "continuation": "k", "gold": 1}, " ",
               [{"context_options": ["C1", "C2"], "continuation": "K1", "gold": 0}], ["C1 K1\n\nc k", "C1 K1\n\nd k"]),
    "language_modeling": ({"context": "ctx \n", "continuation": " cont"}, " ",  # contexts trimmed
                          [{"context": "  Ctx1 ", "continuation": "x1"}], ["Ctx1 x1\n\nctx", "Ctx1 x1\n\nctx  cont"]),
    "language_modeling, no shots": ({"context": "ctx \n", "continuation": " cont"}, " ", [], ["ctx", "ctx  cont"]),
}


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_prompts_are_rendered_as_nanochats_templates_render_them(kind):
    item, delimiter, shots, prompts = PROMPTS[kind]
    assert core.render_prompts(kind.split(",")[0], item, delimiter, shots) == prompts


def test_fewshot_examples_are_drawn_as_nanochat_draws_them():
    t = task("language_modeling", [{"context": str(i), "continuation": "x"} for i in range(40)], shots=5)
    for idx in (0, 7, 39):
        others = [i for i in range(40) if i != idx]
        expected = [t.items[i] for i in random.Random(1234 + idx).sample(others, 5)]
        assert core.fewshot(t, idx) == expected


# --- scoring, hand-checked -----------------------------------------------------------------------------------------
SCORED = {  # kind -> (Bigram logits (after, token, logit), items, delimiter, which items are answered right)
    # ' '->b loses 5.574, b->b 0.012 (mean 2.79); ' '->c loses 3.574. The lowest mean loss picks "bb", a sum "c".
    "multiple_choice": ([(" ", "c", 2.0), ("b", "b", 10.0)],
                        [{"query": "q", "choices": ["bb", "c"], "gold": g} for g in (0, 1)], " ", [True, False]),
    # Only the shared continuation is scored: BOS strongly predicts "y", but x->' ' decides for option 0.
    "schema": ([("BOS", "y", 50.0), ("x", " ", 5.0)], [{"context_options": options, "continuation": "z", "gold": 0}
                                                      for options in (["x", "y"], ["y", "x"])], " ", [True, False]),
    # Every continuation token must be greedy; the last: a->b is not (all logits of a are 0: argmax is token 0).
    "language_modeling": ([("b", "c", 1.0), ("c", "d", 1.0)], [{"context": " ab ", "continuation": "cd"}, {
        "context": "ab", "continuation": "ce"}, {"context": "a", "continuation": "bcd"}], "", [True, False, False]),
}


@pytest.mark.parametrize("kind", list(SCORED))
def test_each_task_type_is_answered_as_nanochat_answers_it(kind):
    logits, items, delimiter, right = SCORED[kind]
    assert score(Bigram(logits=logits), [task(kind, items, delimiter)])["examples"][f"t_{kind}"] == right


def test_centered_accuracy_and_core_arithmetic():
    m = Bigram(logits=[("b", "c", 1.0)])
    lm = task("language_modeling", [{"context": "b", "continuation": c} for c in "ccxx"], delimiter="")
    mc = dataclasses.replace(lm, label="mc4", type="multiple_choice", random_baseline=25.0, items=[
        {"query": "b", "choices": ["c", "x", "y", "z"], "gold": g} for g in (0, 0, 0, 1)])
    out = score(m, [lm, mc])
    assert out["tasks"]["t_language_modeling"] == {"accuracy": 0.5, "centered": 0.5, "random_baseline": 0.0, "n": 4}
    assert out["tasks"]["mc4"]["accuracy"] == 0.75
    assert out["tasks"]["mc4"]["centered"] == pytest.approx((0.75 - 0.25) / 0.75)
    assert out["core"] == pytest.approx((0.5 + 2 / 3) / 2)


def test_left_crop_to_the_model_context_shifts_the_scored_span():
    t = task("language_modeling", [{"context": "abcdefgh", "continuation": "ij"}], delimiter="")
    assert core.sequences(t, 0, ByteTokenizer(), 64) == [([BOS, *b"abcdefghij"], 9)]
    assert core.sequences(t, 0, ByteTokenizer(), 6) == [(list(b"efghij"), 4)]
    mc = task("multiple_choice", [{"query": "q", "choices": ["long answer", "other one"], "gold": 0}])
    # The answers themselves reach past the crop: scored from position 1, the first with a prediction.
    assert core.sequences(mc, 0, ByteTokenizer(), 5) == [(list(b"nswer"), 1), (list(b"r one"), 1)]
    m = Bigram(max_seq_len=6, logits=[("h", "i", 1.0), ("i", "j", 1.0)])  # asserts every forward fits
    assert score(m, [t])["examples"]["t_language_modeling"] == [True]


# --- the bundle ----------------------------------------------------------------------------------------------------
@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return taskgen.write_bundle(tmp_path / "bundle", TEXTS, seed=3, n=12)


def test_write_then_read_round_trip_of_items_that_are_what_they_claim(bundle: Path):
    tasks = core.read_bundle(bundle)
    assert [(t.label, t.type, t.num_fewshot, t.random_baseline, len(t.items)) for t in tasks] == [
        ("nanopt_line_end", "multiple_choice", 0, 25.0, 12), ("nanopt_line_start", "schema", 2, 50.0, 12),
        ("nanopt_word_end", "language_modeling", 2, 0.0, 12)]
    for t in tasks:
        in_file = [json.loads(line) for line in (bundle / "eval_data" / f"{t.label}.jsonl").read_text().splitlines()]
        random.Random(1337).shuffle(in_file)  # nanochat's base_eval shuffles every task so
        assert t.items == in_file and t.continuation_delimiter == ""
    again = taskgen.write_bundle(bundle.parent / "again", TEXTS, seed=3, n=12)  # the same texts and seed: same files
    for name in ("core.yaml", "eval_meta_data.csv", "eval_data/nanopt_word_end.jsonl"):
        assert (again / name).read_text() == (bundle / name).read_text()
    mc, schema, lm = tasks
    for item in mc.items:  # the right rest continues the cut line of the passage
        line = item["query"].split("\n")[-1] + item["choices"][item["gold"]]
        assert len(item["choices"]) == 4 and any(line in text for text in TEXTS)
    for item in schema.items:
        assert any(item["context_options"][item["gold"]] + item["continuation"] in text for text in TEXTS)
    for item in lm.items:
        assert item["continuation"].isalpha() and any(item["context"] + item["continuation"] in t for t in TEXTS)


def test_limit_keeps_the_first_items_of_the_full_order(bundle: Path):
    full, limited = core.read_bundle(bundle), core.read_bundle(bundle, limit=5)
    for f, t in zip(full, limited):
        assert t.items == f.items[:5]
        assert all(shot in t.items for i in range(5) for shot in core.fewshot(t, i))  # drawn from the kept ones


def test_batching_and_ranks_do_not_change_the_examples(bundle: Path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=96)).eval()
    tasks, tok = core.read_bundle(bundle, limit=8), ByteTokenizer()
    one = core.evaluate_core(model, tok, tasks, CPU, batch_size=1)
    two_ranks = stub_runtime()  # each rank's share, as gather_objects would bring it from two processes
    two_ranks.gather_objects = lambda obj: [[core._score_task(model, tok, t, stub_runtime(rank=r), 8) for t in tasks]
                                            for r in (0, 1)]
    assert core.evaluate_core(model, tok, tasks, CPU, batch_size=8) == one == core.evaluate_core(model, tok, tasks,
                                                                                                 two_ranks)
    assert sorted(core._score_task(model, tok, tasks[0], stub_runtime(rank=1), 8)) == [1, 3, 5, 7]


LINE_END, LINE_START, WORD_END = (f"eval_data/nanopt_{name}.jsonl" for name in ("line_end", "line_start", "word_end"))
BAD = {  # what is broken -> (how: an edit (file, old, new) or a function of the bundle, what the message names)
    "no bundle": (lambda b: (b / "core.yaml").unlink(), "core.yaml"),
    "a FIFO for a task file": (lambda b: (os.remove(b / LINE_END), os.mkfifo(b / LINE_END)), "named pipe"),  # unread
    "no task list": (lambda b: (b / "core.yaml").write_text("tasks: []\n"), "core.yaml"),
    "task without a type": (("core.yaml", "icl_task_type", "type"), "core.yaml"),
    "unknown type": (("core.yaml", "schema", "generative"), "core.yaml"),
    "no baselines": (lambda b: (b / "eval_meta_data.csv").unlink(), "eval_meta_data.csv"),
    "no baseline column": (("eval_meta_data.csv", "Random baseline", "Chance"), "eval_meta_data.csv"),
    "baseline not a number": (("eval_meta_data.csv", "25.0", "a quarter"), "eval_meta_data.csv"),
    "no row for a task": (("eval_meta_data.csv", "nanopt_word_end", "other"), "eval_meta_data.csv"),
    "no data file": (lambda b: (b / LINE_START).unlink(), "nanopt_line_start.jsonl"),
    "line not JSON": ((LINE_END, "\n", "\n{oops\n"), "nanopt_line_end.jsonl:2"),
    "item lacks a field": ((WORD_END, '"continuation"', '"cont"'), "nanopt_word_end.jsonl:1"),
    "gold out of range": ((LINE_START, '"gold": ', '"gold": 9'), "nanopt_line_start.jsonl:1"),
    "too few items for the shots": (("core.yaml", "[2]", "[12]"), "core.yaml"),
    "empty data file": (lambda b: (b / WORD_END).write_text("\n"), "nanopt_word_end.jsonl holds no items"),
    # A random baseline of 100 divided by zero; NaN, 150 and -10 gave a meaningless CORE.
    **{f"baseline {v or 'empty'}": (("eval_meta_data.csv", "50.0", v),
                                    f"eval_meta_data.csv:3: task nanopt_line_start's `Random baseline` is {v!r}")
       for v in ("100", "100.0", "nan", "150", "-10", "inf", "")},
    # A bundle names files inside itself: no way out of it, by `..` or an absolute path.
    "dataset_uri out of the bundle": (("core.yaml", "nanopt_line_end.jsonl", "../../x.jsonl"),
                                      "core.yaml: task nanopt_line_end's dataset_uri '../../x.jsonl' leaves"),
    "absolute dataset_uri": (("core.yaml", "nanopt_line_end.jsonl", "/etc/hostname"),
                             "core.yaml: task nanopt_line_end's dataset_uri '/etc/hostname' leaves"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_bundle_raises_config_error_naming_the_file(bundle: Path, case: str):
    breaks, named = BAD[case]
    if callable(breaks):
        breaks(bundle)
    else:
        (path := bundle / breaks[0]).write_text(path.read_text().replace(*breaks[1:], 1))
    with pytest.raises(ConfigError) as e:
        core.read_bundle(bundle)
    assert f"{named}" in str(e.value) and str(bundle) in str(e.value), str(e.value)


def test_write_bundle_refuses_texts_too_small(tmp_path: Path):
    with pytest.raises(ConfigError, match="write_bundle"):
        taskgen.write_bundle(tmp_path, ["too short\nlines"])
