"""nanopt.evals.taskgen: generated lm-evaluation-harness tasks on local files, loaded and run by the harness offline."""
from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import pytest

from nanopt.errors import ConfigError, path_problem
from nanopt.evals.taskgen import BUNDLE_DIR, MAX_ITEM_BYTES, make_tasks, write_bundle

NOUNS = "king raven castle river lantern soldier garden letter storm bell".split()
VERBS = "watches remembers follows forgets answers carries praises fears".split()
PLACES = ["the northern hill", "a quiet harbour", "the old mill", "the market square", "a narrow bridge"]


def english(doc: int, lines: int = 60) -> str:  # a few KB, a speaker's name and a blank line between speeches
    out = []
    for k in range(lines):
        if k % 6 == 0:
            out += ["", f"SPEAKER {doc}."]
        noun, verb, place = NOUNS[(k * 3 + doc) % 10], VERBS[(k + doc * 5) % 8], PLACES[(k * 7 + doc) % 5]
        out.append(f"The {noun} {verb} what happened near {place}, line {k} of part {doc}.")
    return "\n".join(out) + "\n"


TEXTS = [english(d) for d in range(3)]
pytestmark = pytest.mark.usefixtures("offline")  # conftest: no hub
N = 40


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, list[Path]]:  # read only: the directory, the YAML paths make_tasks returned
    out = tmp_path_factory.mktemp("t")
    return out, make_tasks(out, TEXTS, n=N)


def test_writes_the_tasks_the_group_and_their_data_whole_passages_of_the_text(made):
    out, paths = made
    assert [p.name for p in paths] == ["nanopt_mc.yaml", "nanopt_rolling.yaml", "nanopt_tasks.yaml"]
    mc = (out / "nanopt_mc.yaml").read_text()
    assert f"test: {(out / 'nanopt_mc.jsonl').resolve()}" in mc  # absolute: any cwd works
    assert "target_delimiter: ''" in mc
    assert len(rows(out / "nanopt_mc.jsonl")) == len(rows(out / "nanopt_rolling.jsonl")) == N
    passages = [row["text"] for row in rows(out / "nanopt_rolling.jsonl")]  # a few hundred bytes of the text each
    assert len(passages) == len(set(passages)) == N
    assert all(256 <= len(p.encode()) <= 512 and any(p in text for text in TEXTS) for p in passages)
    items = rows(out / "nanopt_mc.jsonl")  # true continuations among four of one length, the gold spread
    for item in items:
        choices, gold = item["choices"], item["choices"][item["gold"]]
        assert len(choices) == len(set(choices)) == 4 and len({len(c) for c in choices}) == 1
        assert any(item["context"] + gold in text for text in TEXTS), item  # the true continuation
        assert item["context"][-1].isalpha() and all(c[0].isalpha() and c.count(" ") >= 2 for c in choices)
        assert max(len((item["context"] + c).encode()) for c in choices) <= MAX_ITEM_BYTES
    spread = collections.Counter(item["gold"] for item in items)
    assert sorted(spread) == [0, 1, 2, 3] and min(spread.values()) >= N // 10, spread
    assert sum(1 / len(item["choices"]) for item in items) / len(items) == 0.25  # chance


def test_the_same_seed_gives_the_same_bytes_and_a_rerun_rewrites_its_own_output_and_nothing_else(tmp_path):
    a, b, c = (tmp_path / name for name in "abc")
    for d, seed in ((a, 3), (b, 3), (c, 4)):
        make_tasks(d, TEXTS, n=10, seed=seed)
    for name in ("nanopt_mc.jsonl", "nanopt_rolling.jsonl", "nanopt_tasks.json", "nanopt_tasks.yaml"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "nanopt_mc.yaml").read_text().replace(str(a), str(b)) == (b / "nanopt_mc.yaml").read_text()
    assert (a / "nanopt_mc.jsonl").read_bytes() != (c / "nanopt_mc.jsonl").read_bytes()
    before = (a / "nanopt_mc.jsonl").read_bytes()
    make_tasks(a, TEXTS, n=10, seed=3)  # a directory holding only our own output is rewritten, identically
    assert (a / "nanopt_mc.jsonl").read_bytes() == before
    # `nanopt eval --make-tasks DIR` writes DIR/core beside the tasks; before, its second run was refused because
    # of that core/ (a directory make_tasks did not write), and write_bundle replaced whatever DIR/core held.
    for _ in range(2):
        write_bundle(a / BUNDLE_DIR, TEXTS, n=10)
        make_tasks(a, TEXTS, n=10)
    (a / BUNDLE_DIR / "eval_data" / "mine.jsonl").write_text("the user's")
    with pytest.raises(ConfigError, match=r"core holds files write_bundle did not write \(eval_data/mine.jsonl\)"):
        write_bundle(a / BUNDLE_DIR, TEXTS, n=10)
    with pytest.raises(ConfigError, match=r"holds files make_tasks did not write \(core\)"):
        make_tasks(a, TEXTS, n=10)
    assert (a / BUNDLE_DIR / "eval_data" / "mine.jsonl").read_text() == "the user's"


def test_lm_eval_loads_the_tasks_offline(made):
    import lm_eval.tasks as lm_eval_tasks

    out = made[0]
    loaded = lm_eval_tasks.TaskManager(include_path=str(out), include_defaults=False).load(["nanopt_tasks"])
    assert loaded["group_map"] == {"nanopt_tasks": ["nanopt_mc", "nanopt_rolling"]}
    mc, rolling = loaded["tasks"]["nanopt_mc"], loaded["tasks"]["nanopt_rolling"]
    docs, items = list(mc.test_docs()), rows(out / "nanopt_mc.jsonl")
    assert len(docs) == N
    for doc, item in zip(docs, items):
        assert mc.doc_to_choice(doc) == item["choices"] and mc.doc_to_target(doc) == item["gold"]
    mc.build_all_requests(limit=2)
    context, first = items[0]["context"], items[0]["choices"][0]
    spaces = len(context) - len(context.rstrip(" "))  # the harness moves a context's trailing spaces on
    assert mc.instances[0].arguments in ((context, first), (context[:len(context) - spaces], context[-spaces:] + first))
    rolling.build_all_requests(limit=3)
    assert [i.request_type for i in rolling.instances] == ["loglikelihood_rolling"] * 3
    assert rolling.instances[0].arguments == (rows(out / "nanopt_rolling.jsonl")[0]["text"],)


@pytest.mark.slow
def test_the_harness_dummy_model_runs_both_tasks_offline(made):
    """The harness's own `dummy` model (random scores), with the built-in tasks indexed too (~6 s): no name clash."""
    import lm_eval.tasks

    out = lm_eval.simple_evaluate(model="dummy", tasks=["nanopt_mc", "nanopt_rolling"], limit=10,
                                  task_manager=lm_eval.tasks.TaskManager(include_path=str(made[0])))
    assert 0 <= out["results"]["nanopt_mc"]["acc,none"] <= 1
    assert out["results"]["nanopt_rolling"]["bits_per_byte,none"] > 0
    assert out["n-samples"]["nanopt_mc"]["effective"] == 10


def test_the_default_texts_are_the_held_out_test_plays(tmp_path):
    make_tasks(tmp_path, n=200)
    assert json.loads((tmp_path / "nanopt_tasks.json").read_text())["source"] == "the embedded corpus's test plays"
    items = rows(tmp_path / "nanopt_mc.jsonl")
    assert len(items) == len(rows(tmp_path / "nanopt_rolling.jsonl")) == 200  # of the cached corpus's test plays
    assert max(len((i["context"] + c).encode()) for i in items for c in i["choices"]) <= MAX_ITEM_BYTES
    assert len(collections.Counter(i["gold"] for i in items)) == 4


@pytest.mark.parametrize("case, match", [
    ("file", "is a file"), ("foreign", "did not write"), ("small_n", "n >= 4"), ("short", "fewer than n=50")])
def test_bad_input_is_one_clear_config_error(tmp_path, case, match):
    out = tmp_path / "tasks"
    if case == "file":
        out.write_text("not a directory")
    elif case == "foreign":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    texts, n = {"small_n": (TEXTS, 3), "short": ([english(0, lines=20)], 50)}.get(case, (TEXTS, 10))  # 20 items
    with pytest.raises(OSError if case == "file" else ConfigError) as raised:
        make_tasks(out, texts, n=n)
    assert re.search(match, path_problem(raised.value) if case == "file" else str(raised.value))
    if case == "foreign":
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # nothing written beside it
