"""Each config key's rules are declared once, on its field; docs/configuration.md and the key sets that resume
and `nanopt runs` use are derived from them. These tests keep the page in step with the code and pin the sets."""
from __future__ import annotations

import importlib.util
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from nanopt.config import NEUTRAL_KEYS, SAFE_KEYS, SECTIONS, Config, validate

REPO = Path(__file__).resolve().parent.parent
REGENERATE = "python scripts/config_docs.py --write"
ALL_KEYS = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in fields(cls)}


def _docs_script():
    spec = importlib.util.spec_from_file_location("config_docs", REPO / "scripts" / "config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_is_generated_from_the_code():
    docs = _docs_script()
    assert docs.PAGE.is_file(), f"docs/configuration.md is missing; generate it: {REGENERATE}"
    assert docs.PAGE.read_text() == docs.render(), (
        f"docs/configuration.md differs from the field declarations in nanopt/config.py; regenerate it: {REGENERATE}")


def test_check_fails_on_a_stale_page_naming_the_command_and_write_fixes_it(tmp_path, monkeypatch, capsys):
    docs = _docs_script()
    monkeypatch.setattr(docs, "PAGE", tmp_path / "docs" / "configuration.md")
    monkeypatch.setattr(docs, "REPO", tmp_path)
    assert docs.main(["--check"]) == 1  # missing
    docs.PAGE.parent.mkdir()
    docs.PAGE.write_text(docs.render().replace("Peak learning rate.", "Learning rate."))
    assert docs.main(["--check"]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert docs.main(["--write"]) == 0
    assert docs.main(["--check"]) == 0
    assert "| `train.lr` | float | `0.003` | positive | no | yes | Peak learning rate. |" in docs.PAGE.read_text()


def test_every_key_and_section_has_a_one_line_doc():
    for name, cls in SECTIONS.items():
        assert cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("), f"section `{name}` has no docstring"
        for f in fields(cls):
            doc = f.metadata.get("doc", "")
            assert doc.strip() and "\n" not in doc and doc.endswith("."), f"`{name}.{f.name}`: doc {doc!r}"


def test_each_rule_fits_its_key_and_every_default_obeys_its_rules():
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            meta, typ = f.metadata, hints[f.name]
            optional = type(None) in typing.get_args(typ)
            base = next((a for a in typing.get_args(typ) if a is not type(None)), typ)
            while typing.get_origin(base) is list:  # a list's rules are its items'
                base = typing.get_args(base)[0]
            assert not meta["choices"] or base is str, f"`{name}.{f.name}`: choices on a {base.__name__}"
            bounded = any(meta[b] is not None for b in ("gt", "ge", "lt", "le"))
            assert not bounded or base in (int, float), f"`{name}.{f.name}`: bounds on a {base.__name__}"
            assert bool(meta["null"]) == (optional and bounded), f"`{name}.{f.name}`: say what null means"
            assert isinstance(meta["safe"], bool) and isinstance(meta["neutral"], bool), f"`{name}.{f.name}`"
    validate(Config())


# What a resume may change: how long the run goes, what it logs, where things live; never the state the next step
# computes from. eval.seed and eval.batches are not here: they choose the validation tokens.
SAFE = {
    "run.name", "run.dir", "run.time_limit_s", "train.max_steps", "train.compile", "train.target_val_loss",
    "train.target_val_bpb", "train.stop_at_target", "train.init_from", "train.loss_chunk_tokens",
    "train.compile_ddp_split", "train.recompute",
    "model.attention", "data.source", "data.dir", "data.verify_checksum",
    "checkpoint.every", "checkpoint.keep", "checkpoint.resume", "checkpoint.mirror", "checkpoint.allow_changes",
    "checkpoint.start_over", "eval.every", "eval.at_start", "eval.test_at_end",
    # Downstream tasks score the model outside the step and put the RNG states back (harness.score_model).
    "eval.tasks", "eval.core", "eval.tasks_every", "eval.tasks_limit", "eval.tasks_path",
}
SAFE_SECTIONS = {"log", "sample", "runtime", "profile", "prepare", "mfu", "scaling"}  # every key in them
# What does not change results: runs differing only in these (and run.seed) are repeats of one setting.
NEUTRAL = {"run.name", "run.dir", "run.time_limit_s", "data.verify_checksum", "eval.test_at_end", "eval.at_start",
           "log.wandb_project", "eval.tasks", "eval.core", "eval.tasks_every", "eval.tasks_limit", "eval.tasks_path"}
NEUTRAL_SECTIONS = {"checkpoint", "sample", "prepare", "mfu", "scaling"}  # scaling: read by the plan alone


@pytest.mark.parametrize("derived, keys, sections", [(SAFE_KEYS, SAFE, SAFE_SECTIONS),
                                                     (NEUTRAL_KEYS, NEUTRAL, NEUTRAL_SECTIONS)],
                         ids=["resume-safe", "neutral"])
def test_the_derived_key_sets_are_pinned(derived, keys, sections):
    expected = keys | {k for k in ALL_KEYS if k.split(".")[0] in sections}
    assert set(derived) == expected, (f"added: {sorted(set(derived) - expected)}, "
                                      f"removed: {sorted(expected - set(derived))}")
    assert "run.seed" not in derived
