"""`nanopt prepare`: local files through `datasets` -> a locally built HF tokenizer -> token shards; interrupt and
resume, rebuilt shards, what it may delete and which manifests it follows, one prepare per directory, and a full
disk or an unwritable file as one paragraph. Training on prepared shards: e2e/test_prepare_then_train.py."""
from __future__ import annotations

import errno
import functools
import itertools
import json
import logging
import math
import operator
import os
import shutil
import socket
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub; fail fast if it tried
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import pytest
from conftest import (PREPARE_DOCS, PREPARED_KEYS, REPO, USERS, full_disk_for, one_paragraph, prepare_config,
                      shard_bytes, users_file, write_source)

from nanopt import cli, io, rundirs
from nanopt.commands import prepare as prepare_command
from nanopt.config import ConfigError, load_config, to_yaml
from nanopt.data import prepare, shards
from nanopt.data.tokenizer import get_tokenizer
from nanopt.lock import DirLock
from nanopt.training import loader as data


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return get_tokenizer(str(tokenizer_dir))


@pytest.fixture(scope="module")
def config(tmp_path_factory, tokenizer_dir):
    """config(tmp_path, out_name="shards", **prepare keys): the HF tokenizer over PREPARE_DOCS in one JSON-lines file
    for the module (read only: a test that changes the source changes what prepare reads instead)."""
    dataset, files, _ = write_source(tmp_path_factory.mktemp("src"), "jsonl", PREPARE_DOCS)
    return lambda tmp_path, out_name="shards", **keys: prepare_config(tmp_path, tokenizer_dir, dataset, files, out_name,
                                                                      **keys)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, config):
    """One preparation at PREPARED_KEYS (2 val, 2 test, 6 train shards): (its directory, the bytes of its shards,
    its statistics)."""
    root = tmp_path_factory.mktemp("pristine")
    stats = prepare.prepare(config(root, **PREPARED_KEYS), progress=False)
    assert len(shards.split_paths(root / "shards", "train")) == 6
    assert [s["shards"] for s in stats["splits"].values()] == [2, 2, 6]  # enough for the resume test's three crashes
    return root / "shards", shard_bytes(root / "shards"), stats


@pytest.fixture
def prepared(pristine, config, tmp_path):
    """(config, output directory, the bytes of every shard, statistics): a copy of the pristine one, to damage."""
    out, whole, stats = pristine
    shutil.copytree(out, tmp_path / "shards")
    return config(tmp_path, **PREPARED_KEYS), tmp_path / "shards", whole, stats


def read_split(directory, split: str) -> np.ndarray:
    paths = shards.split_paths(directory, split)
    return np.concatenate([np.asarray(shards.open_shard(p)) for p in paths]) if paths else np.zeros(0, np.int64)


def framed(tok, docs: list[str], bos=True, eos=False) -> list[list[int]]:
    """Each document's tokens as prepare should write them, computed one document at a time."""
    return [([tok.bos_id] if bos else []) + tok.encode(d) + ([tok.eos_id] if eos else []) for d in docs]


def _cli_prepare(cfg, tmp_path, capsys, *flags: str) -> tuple[int, str]:
    """(exit code, stderr) of the `nanopt` dispatcher on `cfg`; its stdout is capsys.readouterr().out."""
    cfg_file = tmp_path / f"{Path(cfg.data.source).name}.yaml"
    cfg_file.write_text(to_yaml(cfg))
    code = cli.run(["prepare", "--config", str(cfg_file), "--no-progress", *flags])
    printed = capsys.readouterr()
    print(printed.out, end="")  # for the caller to read
    return code, printed.err


@pytest.fixture
def no_waits(monkeypatch) -> list[float]:
    """prepare's retry waits, recorded instead of slept."""
    waits: list[float] = []
    monkeypatch.setattr(prepare.time, "sleep", waits.append)
    return waits


# ---------------------------------------------------------------- round trip, budgets, statistics
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "text"])
def test_shards_decode_back_to_the_source_documents(tmp_path, tokenizer_dir, tok, fmt):
    dataset, files, docs = write_source(tmp_path / "src", fmt, PREPARE_DOCS)
    extra = {"sample_by": "document"} if fmt == "text" else {}
    stats = prepare.prepare(prepare_config(tmp_path, tokenizer_dir, dataset, files, **extra), progress=False)
    out = tmp_path / "shards"
    tokens = read_split(out, "train")
    assert shards.read_header(out / "train_000000.bin").dtype == np.uint16
    assert len(shards.split_paths(out, "train")) == math.ceil(len(tokens) / 300) > 1  # documents straddle shards
    assert shards.split_paths(out, "val") == [] and shards.split_paths(out, "test") == []
    pieces = np.split(tokens, np.flatnonzero(tokens == tok.bos_id)[1:])
    assert len(pieces) == len(docs)
    for piece, doc in zip(pieces, docs):
        assert piece[0] == tok.bos_id
        assert tok.decode(piece[1:].tolist()) == doc
    assert stats["splits"]["train"]["documents"] == len(docs)
    assert stats["splits"]["train"]["tokens"] == len(tokens) == sum(map(len, framed(tok, docs)))


def test_bos_and_eos_frame_every_document(tmp_path, config, tok):
    prepare.prepare(config(tmp_path, add_eos="true", workers=2), progress=False)
    expected = np.concatenate([np.asarray(x) for x in framed(tok, PREPARE_DOCS, bos=True, eos=True)])
    assert np.array_equal(read_split(tmp_path / "shards", "train"), expected)


def test_splits_honour_the_token_budgets_and_stats_are_right(pristine, tok):
    out, _, stats = pristine
    # Independent reference: fill val, then test, then train with whole documents from the stream, in
    # order; the document that crosses a budget is cut there and the rest of it is dropped.
    per_doc, i = framed(tok, PREPARE_DOCS), 0
    for split in ("val", "test", "train"):
        budget, taken = PREPARED_KEYS[f"{split}_tokens"], []
        while sum(map(len, taken)) < budget:
            taken.append(per_doc[i][: budget - sum(map(len, taken))])
            i += 1
        got, lengths, s = read_split(out, split), [len(d) for d in taken], stats["splits"][split]
        assert len(got) == budget and got.tolist() == [t for d in taken for t in d]
        assert s["tokens"] == budget and s["documents"] == len(taken)
        assert s["mean_tokens_per_document"] == pytest.approx(np.mean(lengths))
        assert s["median_tokens_per_document"] == pytest.approx(np.median(lengths))
        sizes = [shards.read_header(p).count for p in shards.split_paths(out, split)]
        assert sizes[:-1] == [300] * (len(sizes) - 1) and 0 < sizes[-1] <= 300
    assert i < len(PREPARE_DOCS)  # the budget stopped the run before the source ran out
    assert stats["documents_read"] == i
    assert json.loads((out / "stats.json").read_text())["splits"] == stats["splits"]


def test_estimate_only_sizes_the_document_count_with_a_25_percent_buffer(tmp_path, config, tok, capsys):
    cfg = config(tmp_path, "never", train_tokens=100_000, val_tokens=5000, test_tokens=5000)
    e = prepare.sample_documents(cfg, 10)
    mean = np.mean([len(x) for x in framed(tok, PREPARE_DOCS[:10])])
    assert e["mean_tokens_per_document"] == pytest.approx(mean)
    assert e["documents_needed"] == math.ceil(110_000 / mean)
    assert e["documents_with_25pct_buffer"] == math.ceil(e["documents_needed"] * 1.25)
    assert _cli_prepare(cfg, tmp_path, capsys, "--sample-documents", "10")[0] == 0
    printed = capsys.readouterr().out
    assert f"{e['documents_with_25pct_buffer']:,}" in printed and f"{mean:.1f} tokens/document" in printed
    assert not (tmp_path / "never").exists()  # an estimate writes nothing


# ---------------------------------------------------------------- interrupted, resumed, rebuilt
def test_interrupt_and_resume_give_the_same_shards_as_one_run(tmp_path, config, monkeypatch, pristine):
    whole, whole_bytes, whole_stats = pristine
    real_write, real_replace, resumed = shards.write_shard, os.replace, tmp_path / "resumed"

    def crash_on(call: int, after_write: bool):
        calls = itertools.count(1)

        def write_shard(*args):
            if next(calls) == call:
                if after_write:  # the shard reached the disk but the manifest never heard of it
                    real_write(*args)
                raise KeyboardInterrupt
            return real_write(*args)
        return write_shard

    def crash_at_train_2(src, dst, *args, **kwargs):
        if str(dst).endswith("train_000002.bin"):
            raise KeyboardInterrupt  # the tokens are on disk under the temp name, the rename never happened
        return real_replace(src, dst, *args, **kwargs)

    def run(**keys):
        return prepare.prepare(config(tmp_path, "resumed", **PREPARED_KEYS, **keys), progress=False)

    # First run: the worker pool is running when Ctrl-C arrives, mid-stream, before shard 3 is written.
    monkeypatch.setattr(shards, "write_shard", crash_on(3, after_write=False))
    with pytest.raises(KeyboardInterrupt):
        run(workers=2)
    manifest = json.loads((resumed / "manifest.json").read_text())
    assert len(manifest["shards"]) == 2 and not manifest["state"]["complete"]
    # Second run: dies right after writing a shard, before committing it.
    monkeypatch.setattr(shards, "write_shard", crash_on(2, after_write=True))
    with pytest.raises(KeyboardInterrupt):
        run()
    assert len(json.loads((resumed / "manifest.json").read_text())["shards"]) == 3
    assert len(list(resumed.glob("*.bin"))) == 4  # one uncommitted shard on disk
    # Third run: dies in nanopt.io's rename; whatever name io gives its temp files, the one left is prepare's own.
    monkeypatch.setattr(shards, "write_shard", real_write)
    monkeypatch.setattr(io.os, "replace", crash_at_train_2)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(io.os, "replace", real_replace)
    (left,) = [p for p in resumed.iterdir() if ".tmp" in p.name and "train_000002" in p.name]  # the crash left one
    left.rename(left.with_name(left.name.replace(f".{os.getpid()}.", ".1.")))  # as a resume in a new process sees it
    final = run()  # the fourth run finishes
    assert shard_bytes(resumed) == whole_bytes
    assert sorted(p.name for p in resumed.iterdir()) == sorted(p.name for p in whole.iterdir())  # no temp file left
    assert final["splits"] == whole_stats["splits"]  # no document counted twice or lost in the statistics
    assert final["this_run"]["tokens"] < sum(PREPARED_KEYS[k] for k in ("val_tokens", "test_tokens", "train_tokens"))
    again = run()  # a finished directory is left alone
    assert again["this_run"]["tokens"] == 0 and shard_bytes(resumed) == whole_bytes


_REAL_ENCODE_TASK = prepare._encode_task


def _encode_task_then_die(batch):
    """A worker task (module level, so the pool can pickle it) that kills its process at document 20, as the OOM
    killer would."""
    if batch[0] >= 20:
        os._exit(9)
    return _REAL_ENCODE_TASK(batch)


def test_a_source_that_fails_or_a_worker_that_dies_is_exit_1_keeping_the_shards_and_resumes_to_the_same(
        tmp_path, config, monkeypatch, caplog, capsys, pristine, no_waits):
    whole_bytes, real_iter, failures = pristine[1], prepare.iter_texts, []

    def flaky(ds, text_field, start=0):  # the stream breaks twice, each time a few documents past the start
        for i, text in enumerate(real_iter(ds, text_field, start)):
            if len(failures) < 2 and i == 7:
                failures.append(start)
                raise ConnectionError("hub connection reset")
            yield text

    monkeypatch.setattr(prepare, "iter_texts", flaky)
    cfg = config(tmp_path, "flaky", **PREPARED_KEYS)
    with caplog.at_level("WARNING", logger="nanopt"):
        stats = prepare.prepare_with_retries(cfg, progress=False)
    assert len(failures) == 2 and failures[1] > 0  # the second attempt resumed past the start
    assert no_waits == [prepare.RETRY_WAIT_S, 2 * prepare.RETRY_WAIT_S] and "retry 1 of 5" in caplog.text
    assert shard_bytes(tmp_path / "flaky") == whole_bytes
    assert stats["splits"]["train"]["tokens"] == PREPARED_KEYS["train_tokens"]
    # Out of retries: one paragraph, exit 1, the committed shards stay.
    monkeypatch.setattr(prepare, "prepare", lambda *args: (_ for _ in ()).throw(ConnectionError("down")))
    (tmp_path / "cfg.yaml").write_text(to_yaml(cfg))
    assert prepare_command.main(["--config", str(tmp_path / "cfg.yaml"), "--no-progress", "--prepare.retries=1"]) == 1
    err = capsys.readouterr().err
    assert "kept failing (ConnectionError: down) after 1 retries" in err and "run the same command again" in err
    assert shard_bytes(tmp_path / "flaky") == whole_bytes
    # A worker that dies (the OOM killer) stops prepare with an error, not a hang.
    monkeypatch.undo()
    (tmp_path / "dies.yaml").write_text(to_yaml(config(tmp_path, "dies", workers=2, **PREPARED_KEYS)))
    monkeypatch.setattr(prepare, "_encode_task", _encode_task_then_die)
    assert prepare_command.main(["--config", str(tmp_path / "dies.yaml"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "worker process died" in err and "run the same command again" in err
    manifest = json.loads((tmp_path / "dies" / "manifest.json").read_text())
    assert manifest["shards"] and not manifest["state"]["complete"]  # what was committed stays, resumable
    monkeypatch.setattr(prepare, "_encode_task", _REAL_ENCODE_TASK)
    assert prepare_command.main(["--config", str(tmp_path / "dies.yaml"), "--no-progress"]) == 0  # to the end
    assert shard_bytes(tmp_path / "dies") == whole_bytes


def test_resume_refuses_a_directory_prepared_differently(prepared, tmp_path, tokenizer_dir, config):
    with pytest.raises(ConfigError, match="different configuration"):
        prepare.prepare(config(tmp_path, **{**PREPARED_KEYS, "shard_tokens": 100}), progress=False)
    # The same tokenizer name with a different definition (a hub tokenizer updated in place) is refused too.
    changed = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, changed)
    cfg = config(tmp_path, "by-name", train_tokens=500)
    cfg.data.tokenizer = str(changed)
    prepare.prepare(cfg, progress=False)
    spec = json.loads((changed / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    (changed / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="different configuration"):
        prepare.prepare(cfg, progress=False)


MISMATCHES = {  # damage to a prepared directory (given the bytes it was made with) -> what check_manifest names
    # a shard cut short and its header rewritten to match: self-consistent, but not what was made
    "train_000002.bin holds 100 tokens, the manifest says 300": lambda out, made: shards.write_shard(
        out / "train_000002.bin", shards.open_shard(out / "train_000002.bin")[:100], 600),
    # another shard of the same size copied over it
    "train_000003.bin is another shard than the one committed": lambda out, made: (out / "train_000003.bin")
    .write_bytes(made["train_000004.bin"]),
    "train_000099.bin is not in the manifest": lambda out, made: (out / "train_000099.bin")
    .write_bytes(made["train_000000.bin"]),
    "val_000001.bin is missing": lambda out, made: (out / "val_000001.bin").unlink(),
}


@pytest.mark.parametrize("expected", MISMATCHES)
def test_every_kind_of_mismatch_is_named(prepared, expected):
    _, out, made, _ = prepared
    MISMATCHES[expected](out, made)
    with pytest.raises(ConfigError, match="do not match its manifest.json") as e:
        shards.check_manifest(out)
    assert expected in str(e.value)


def test_prepare_rebuilds_lost_and_resized_shards_to_identical_bytes_or_says_why_not(prepared, monkeypatch):
    cfg, out, whole, stats = prepared
    for name in ("val_000000.bin", "train_000001.bin", "train_000002.bin", "train_000005.bin"):
        (out / name).unlink()
    with open(out / "test_000001.bin", "r+b") as f:  # truncated by a partial copy
        f.truncate(200)
    again = prepare.prepare(cfg, progress=False)
    assert shard_bytes(out) == whole
    assert again["splits"] == stats["splits"] and again["this_run"]["tokens"] > 0
    assert json.loads((out / "stats.json").read_text())["splits"]["train"]["shards"] == 6
    shards.check_manifest(out)  # training accepts the directory again
    assert "rebuild" not in json.loads((out / "manifest.json").read_text())
    assert prepare.prepare(cfg, progress=False)["this_run"]["tokens"] == 0  # whole again: nothing to do
    # A rebuild that would give other bytes (the source changed under the same name) is refused, keeping the files.
    real_iter = prepare.iter_texts
    monkeypatch.setattr(prepare, "iter_texts", lambda *args: (text + " changed" for text in real_iter(*args)))
    (out / "train_000001.bin").unlink()
    with pytest.raises(ConfigError, match="source or the tokenizer changed"):
        prepare.prepare(cfg, progress=False)
    assert shard_bytes(out) == {k: v for k, v in whole.items() if k != "train_000001.bin"}  # nothing else was lost
    with pytest.raises(ConfigError, match="waiting to be rebuilt"):
        shards.check_manifest(out)
    # A manifest without restart points (as nanopt wrote it before shards recorded where they start) cannot rebuild.
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["shards"]:
        entry.pop("after"), entry.pop("crc32")
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "train_000000.bin").unlink()
    with pytest.raises(ConfigError, match="older nanopt.*Delete"):
        prepare.prepare(cfg, progress=False)


# ---------------------------------------------------------------- the hub path, offline
def test_hub_dataset_is_streamed_and_shuffled_as_configured(tmp_path, tokenizer_dir, tok, monkeypatch):
    """configs/1b.yaml's source, with datasets.load_dataset patched to serve local rows: the same functions run, and
    the call and the shuffle get exactly the recipe's arguments."""
    import datasets

    calls, shuffles, real_shuffle = [], [], datasets.IterableDataset.shuffle
    rows = datasets.Dataset.from_dict({"text": PREPARE_DOCS, "id": list(range(len(PREPARE_DOCS)))})
    rows = rows.to_iterable_dataset(num_shards=4)
    monkeypatch.setattr(datasets, "load_dataset", lambda path, *args, **kwargs: calls.append((path, args, kwargs))
                        or rows)
    monkeypatch.setattr(datasets.IterableDataset, "shuffle", lambda self, *args, **kwargs: shuffles.append(
        (args, kwargs)) or real_shuffle(self, *args, **kwargs))
    overrides = [("data.source", str(tmp_path / "fineweb")), ("data.tokenizer", str(tokenizer_dir)),
                 ("model.vocab_size", "600"), ("prepare.train_tokens", "0"), ("prepare.val_tokens", "0"),
                 ("prepare.test_tokens", "0"), ("prepare.workers", "1")]
    cfg = load_config(REPO / "configs" / "1b.yaml", overrides)
    prepare.prepare(cfg, progress=False)
    assert calls == [("HuggingFaceFW/fineweb-edu", (), {"name": "sample-100BT", "split": "train", "streaming": True})]
    p = cfg.prepare
    assert shuffles == [((), {"seed": p.shuffle_seed, "buffer_size": p.shuffle_buffer})]
    order = [r["text"] for r in real_shuffle(rows, seed=p.shuffle_seed, buffer_size=p.shuffle_buffer)]
    assert order != PREPARE_DOCS and sorted(order) == sorted(PREPARE_DOCS)
    expected = np.concatenate([np.asarray(x) for x in framed(tok, order, bos=p.add_bos, eos=p.add_eos)])
    assert np.array_equal(read_split(tmp_path / "fineweb", "train"), expected)
    # A pinned revision reaches the hub call, and is part of what a resume must match.
    pinned = load_config(REPO / "configs" / "1b.yaml", overrides + [("prepare.revision", "v1.2.0")])
    prepare.load_documents(pinned.prepare)
    assert calls[-1][2]["revision"] == "v1.2.0"
    with pytest.raises(ConfigError, match="different configuration"):
        prepare.prepare(pinned, progress=False)


def test_an_unreachable_hub_is_one_paragraph_at_once_and_its_advice_to_tokenise_local_files_works(
        unreachable_hub, monkeypatch, tmp_path, config, capsys):
    """configs/1b.yaml's `--sample-documents` without network: the tokenizer, then (with a local one) the streamed
    dataset, each refused in one paragraph naming it, why, and what to do instead (exit 2; offline mode is on before
    the fetches, which raise what transformers and datasets raise there). Following the advice (local files, the same
    data.source) was once refused as "holds shards prepared with a different configuration"."""
    import datasets
    import transformers
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline_then, real_load = [], datasets.load_dataset
    tokenizer_error = OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find "
                              "them in the cached files.")
    tokenizer_error.__cause__ = LocalEntryNotFoundError("Cannot find the requested files in the disk cache")

    def from_pretrained(name, *args, **kwargs):
        offline_then.append(os.environ.get("HF_HUB_OFFLINE"))
        raise tokenizer_error

    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    argv = ["prepare", "--config", str(REPO / "configs" / "1b.yaml"), "--sample-documents", "10"]
    byte = ["--data.tokenizer=byte", "--prepare.add_eos=false"]
    for extra, words in (([], ["`data.tokenizer` 'meta-llama/Llama-3.2-1B'", "not in the local cache",
                               "HF_HUB_OFFLINE=1", "`data.tokenizer` to a local directory"]),
                         (byte, ["`prepare.dataset` 'HuggingFaceFW/fineweb-edu' (subset sample-100BT",
                                 "`prepare.streaming: true`", "copy the shards", "--prepare.dataset=json"])):
        assert cli.run(argv + extra) == 2
        err = one_paragraph(capsys.readouterr().err)
        assert all(word in err for word in [unreachable_hub, *words]), err
    assert offline_then == ["1"]
    out = tmp_path / "shards"
    argv = ["prepare", f"--data.source={out}", *byte, "--prepare.dataset=HuggingFaceFW/fineweb-edu",
            "--prepare.shuffle_buffer=0", "--prepare.workers=1", "--prepare.shard_tokens=200",
            "--prepare.train_tokens=1000"]
    assert cli.run(argv) == 2
    assert "--prepare.dataset=json" in one_paragraph(capsys.readouterr().err)
    assert shards.read_manifest(out)["shards"] == []  # what the failed prepare leaves
    monkeypatch.setattr(datasets, "load_dataset", real_load)  # local files read as ever
    local = config(tmp_path).prepare
    assert cli.run([*argv, "--prepare.dataset=json", f"--prepare.data_files={local.data_files[0]}"]) == 0
    assert shards.read_manifest(out)["shards"]


# ---------------------------------------------------------------- large vocabularies, bad input
def test_vocabularies_over_65536_ids_are_written_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    wl = Tokenizer(models.WordLevel({"<s>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(70_000)}},
                                    unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=wl, bos_token="<s>", unk_token="<unk>").save_pretrained(tmp_path / "big")
    dataset, files, _ = write_source(tmp_path / "src", "jsonl", ["w69999 w0 w65536", "w70000 w12"])  # w70000: unknown
    prepare.prepare(prepare_config(tmp_path, tmp_path / "big", dataset, files, shard_tokens=1000), progress=False)
    shard = tmp_path / "shards" / "train_000000.bin"
    assert shards.read_header(shard).dtype == np.uint32 and shards.read_header(shard).vocab_size == 70_002
    assert np.asarray(shards.open_shard(shard)).tolist() == [0, 70_001, 2, 65_538, 0, 1, 14]


def test_bad_input_is_one_paragraph_and_exit_2(tmp_path, config, capsys):
    files = config(tmp_path).prepare.data_files[0]
    base = ["prepare", f"--data.tokenizer={config(tmp_path).data.tokenizer}", "--no-progress", "--prepare.workers", "1"]
    cases = {
        "data.source": ["--prepare.dataset=json", f"--prepare.data_files={files}"],
        "prepare.data_files": [f"--data.source={tmp_path / 'o1'}", "--prepare.dataset=parquet"],
        "cannot be loaded": [f"--data.source={tmp_path / 'o2'}", "--prepare.dataset=json",
                             f"--prepare.data_files={tmp_path / 'missing.jsonl'}"],
        "prepare.text_field": [f"--data.source={tmp_path / 'o3'}", "--prepare.dataset=json",
                               f"--prepare.data_files={files}", "--prepare.text_field=body"],
        "--sample-documents": ["--sample-documents", "many"],
    }
    for needle, argv in cases.items():
        assert cli.run(base + argv) == 2, needle
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("builder, content, words", [
    ("json", b'{"text": "a fox"}\nnot json\n', ["'json'", "ArrowInvalid: JSON parse error"]),
    ("text", b"a fox\n\xff\xfe\x00 binary\n", ["'text'", "UnicodeDecodeError"]),
    *((builder, empty, ["names 1 empty file(s): "]) for builder in ("json", "text") for empty in (b"", b"\n\n  \n")),
])
@pytest.mark.parametrize("streaming", [True, False])
def test_a_local_file_its_builder_cannot_parse_or_an_empty_one_is_bad_input_not_a_source_failure(
        tmp_path, config, capsys, no_waits, builder, content, words, streaming, monkeypatch):
    """Once, streamed: a traceback, exit 1, as if the source were flaky (and retried first); loaded whole: exit 2,
    naming only datasets' wrapper, not the parse error."""
    # datasets logs the parse error itself first, through a handler bound to the stderr of an earlier test's capture
    monkeypatch.setattr(logging.getLogger("datasets"), "handlers", [])
    monkeypatch.setattr(logging.getLogger("datasets"), "propagate", False)
    (tmp_path / "docs.src").write_bytes(content)
    cfg = config(tmp_path)
    cfg.prepare.dataset, cfg.prepare.data_files = builder, str(tmp_path / "docs.src")
    cfg.prepare.streaming, cfg.prepare.retries = streaming, 1
    code, err = _cli_prepare(cfg, tmp_path, capsys)
    last = err.strip().splitlines()[-1]  # datasets logs its own line before it raises
    assert code == 2 and "Traceback" not in err and last.startswith("nanopt prepare: error: "), err
    for word in [str(tmp_path / "docs.src"), *words]:
        assert word in last, f"{word!r} missing from: {last}"
    assert no_waits == []  # not retried: waiting mends no file


# ---------------------------------------------------------------- --verify, and what prepare deletes
def _flip(raw: bytes, offset: int) -> bytes:
    return raw[:offset] + bytes([raw[offset] ^ 0x40]) + raw[offset + 1:]


def test_verify_rebuilds_a_corrupt_shard_only_its_checksum_shows_and_says_what_it_read(prepared, tmp_path, config,
                                                                                     capsys, monkeypatch):
    cfg, out, whole, _ = prepared
    (out / "train_000004.bin").write_bytes(_flip(whole["train_000004.bin"], shards.HEADER_BYTES + 11))
    with pytest.raises(data.ShardError, match="prepare --verify"):  # one flipped bit: header and size still agree
        shards.open_shard(out / "train_000004.bin")
    assert prepare.prepare(cfg, progress=False)["this_run"]["tokens"] == 0  # headers only: not seen
    # `nanopt prepare --verify` once printed the usual statistics and never said it had read anything.
    tokens = sum(e["tokens"] for e in json.loads((out / "manifest.json").read_text())["shards"])
    head = f"verify: {len(whole)} shards ({tokens:,} tokens) in {out} read whole against their crc32"
    assert _cli_prepare(cfg, tmp_path, capsys, "--verify")[0] == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"{head}: 1 lost or corrupt (train_000004.bin), rebuilt from the source to identical bytes")
    assert shard_bytes(out) == whole
    assert _cli_prepare(cfg, tmp_path, capsys, "--verify")[0] == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{head}: all OK"
    # A shard that cannot be rebuilt (the source changed): one paragraph, exit 2, as without --verify.
    (out / "train_000004.bin").write_bytes(_flip(whole["train_000004.bin"], shards.HEADER_BYTES + 11))
    real_iter = prepare.iter_texts
    monkeypatch.setattr(prepare, "iter_texts", lambda *args: (text.upper() for text in real_iter(*args)))
    code, err = _cli_prepare(cfg, tmp_path, capsys, "--verify")
    assert code == 2 and err.startswith("nanopt prepare: error: ") and "source or the tokenizer changed" in err
    assert err.strip().count("\n") == 0
    assert _cli_prepare(config(tmp_path, "fresh"), tmp_path, capsys, "--verify")[0] == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("verify: no shards were committed")


def test_resume_deletes_only_shard_and_temp_files_prepare_writes(prepared, caplog):
    """A user's train_000001.bin.bak or .gz beside the shards was once deleted by every resume."""
    cfg, out, whole, _ = prepared
    users = {"train_000001.bin.bak": b"my backup", "train_000001.bin.gz": b"\x1f\x8b", "train_0000001.bin.x": b"x",
             "train_000002.bin.tmp.keep": b"k", ".train_000002.bin.tmp": b"h"}
    leftovers = ["train_000009.bin", "train_000003.bin.tmp", ".train_000004.bin.4242.139.tmp"]  # uncommitted, ours
    for name, content in [*users.items(), *((name, whole["train_000000.bin"]) for name in leftovers)]:
        (out / name).write_bytes(content)
    with caplog.at_level("INFO", logger="nanopt"):
        assert prepare.prepare(cfg, progress=False)["this_run"]["tokens"] == 0
    assert {name: (out / name).read_bytes() for name in users} == users
    assert not any((out / name).exists() for name in leftovers)
    assert shard_bytes(out) == whole
    assert "left" in caplog.text and "train_000001.bin.bak" in caplog.text


# ---------------------------------------------------------------- which manifests are followed
def _set(path: str, value):
    """An edit of manifest.json: the value at a path like "state.next_doc" or "shards.1.after"."""
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    return lambda manifest: functools.reduce(operator.getitem, parents, manifest).__setitem__(last, value)


# A damaged manifest: the bytes of the file, or edits of the one prepare wrote (VICTIM: a user's file beside the data
# directory); the words its paragraph names; whether the schema (so training's check_manifest too) refuses it, or
# only the resume, which knows the config's splits. An entry naming another file than a shard of its directory: a
# manifest in a shared directory could make prepare delete (and training read) any file the user can write.
DAMAGED_MANIFESTS = [
    *(([_set(f"{key}.file", bad)], [f"`{where}.file`", json.dumps(bad), "not a shard name"], True)
      for key, where, bad in (("shards.1", "shards[1]", "VICTIM"), ("shards.1", "shards[1]", "../victim.bin"),
                              ("shards.1", "shards[1]", "train_000001.bin.bak"), ("rebuild.0", "rebuild[0]",
                                                                                   "../victim.bin"))),
    *((content, [], True) for content in (
        b"[1, 2]", b'"shards"', b'{"shards": {}, "state": {}}', b'{"shards": [], "state": []}',
        b'{"shards": ["train_000000.bin"], "state": {}}', b'{"shards": [], "rebuild": 3, "state": {}}',
        b'{"shards": [{"file": "train_000000.bin", "split": "train", "tokens": "many"}], "state": {}}',
        b'{"shards": [{"file": "train_000000.bin", "split": "train", "tokens": 5, "crc32": "x"}], "state": {}}',
        b'{"shards": [], "state": {}, "x": "\xff\xfe"}', b"[" * 100_000)),
    ([_set("state.next_doc", "x"), _set("state.complete", False)], ["`state.next_doc`"], True),
    ([_set("state", {"complete": False})], ["`state.split_index`"], True),
    ([_set("state.doclens", [1])], ["`state.doclens`"], True),
    ([_set("state.complete", "no")], ["`state.complete`"], True),
    ([_set("shards.1.after", {"split_index": "x"})], ["`shards[1].after.split_index`"], True),
    ([_set("state.split_index", 99), _set("state.complete", False)], ["split number 99"], False),
    ([_set("state.next_doc", 10**30), _set("state.complete", False), _set("state.split_index", 0)],
     ["`state.next_doc`", "beyond any stream"], True),
    ([_set("state.doclens.train", 10**6)], ["1000000 train documents", ".doclens-train.u32 holds fewer"], False),
]


@pytest.mark.parametrize("damage, words, schema", DAMAGED_MANIFESTS)
def test_a_damaged_manifest_is_one_paragraph_and_nothing_is_touched(prepared, tmp_path, capsys, damage, words,
                                                                    schema):
    """A wrong type or range once ended in a traceback (KeyError, islice's ValueError, IndexError) on resume."""
    cfg, out, whole, _ = prepared
    path, victim = out / shards.MANIFEST, tmp_path / "victim.bin"
    victim.write_text("a file of the user's, outside the data directory")
    (out / "train_000001.bin.bak").write_text("a user's backup")
    if isinstance(damage, bytes):
        path.write_bytes(damage)
    else:
        manifest = json.loads(path.read_text())
        manifest["rebuild"] = [dict(manifest["shards"][2])]  # a shard waiting to be rebuilt, as a resume leaves it
        for edit in damage:
            edit(manifest)
        path.write_text(json.dumps(manifest).replace("VICTIM", str(victim)))
    (out / shards.split_paths(out, "train")[-1].name).unlink()  # a lost shard: the resume rolls back and re-reads
    listing, before = sorted(p.name for p in out.iterdir()), path.read_bytes()
    words = [word.replace("VICTIM", str(victim)) for word in [str(path), "cannot be used", "Restore", *words]]
    if schema:
        with pytest.raises(ConfigError) as e:
            shards.check_manifest(out)  # what training calls before it reads a shard
        assert all(word in str(e.value) for word in words), str(e.value)
    code, err = _cli_prepare(cfg, tmp_path, capsys)
    assert code == 2 and "Traceback" not in err and err.strip().count("\n") == 0, err
    for word in words:
        assert word in err, f"{word!r} missing from: {err}"
    assert sorted(p.name for p in out.iterdir()) == listing and path.read_bytes() == before and victim.exists()


# ---------------------------------------------------------------- one prepare per directory, a full disk
def test_prepare_into_a_file_or_a_directory_another_prepare_holds_is_exit_2_at_once(tmp_path, config, capsys,
                                                                                    no_waits, pristine):
    """A file: the FileExistsError was once taken for a flaky source and retried for minutes. A second prepare: both
    once exited 0, leaving doubled .doclens files and document counts."""
    (tmp_path / "file").write_text("a file, not a directory")
    code, err = _cli_prepare(config(tmp_path, "file"), tmp_path, capsys)
    assert code == 2 and no_waits == []
    err = one_paragraph(err)
    assert str(tmp_path / "file") in err and "is a file" in err and "`data.source`" in err
    assert (tmp_path / "file").read_text() == "a file, not a directory"
    cfg, out = config(tmp_path, **PREPARED_KEYS), tmp_path / "shards"
    with DirLock(out, what="data"):  # a prepare running in this process, as the lease says
        code, err = _cli_prepare(cfg, tmp_path, capsys)
        assert code == 2
        err = one_paragraph(err)
        assert f"in use by process {os.getpid()} on host {socket.gethostname()}" in err
        assert str(out / rundirs.LOCK_FILE) in err
        assert sorted(p.name for p in out.iterdir()) == [rundirs.LOCK_FILE]  # nothing written
    assert _cli_prepare(cfg, tmp_path, capsys)[0] == 0 and not (out / rundirs.LOCK_FILE).exists()
    assert json.loads((out / prepare.STATS).read_text())["splits"] == pristine[2]["splits"]


HELD_OUT = ["val_000000.bin", "val_000001.bin", "test_000000.bin", "test_000001.bin"]  # PREPARED_KEYS' first shards


def _read_only(name: str):
    real = shards.write_shard

    def write_shard(path, *args):
        if Path(path).name == name:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args)
    return write_shard


@pytest.mark.parametrize("fault, code, words, committed", [
    # ENOSPC was once taken for a flaky source: retried 5 times over 15 minutes, then "the source kept failing".
    ("a full disk", 1, ["writing {out}/train_000002.bin", "GiB free", "run the same command again"], 6),
    # A PermissionError on a shard was once taken for a flaky source and retried for minutes, then exit 1.
    ("an unwritable shard", 2, ["{out}/train_000001.bin: permission denied", "run the command again"], 5),
])
def test_a_full_disk_or_an_unwritable_output_file_stops_prepare_at_once_and_the_rerun_ends_identical(
        tmp_path, config, monkeypatch, capsys, no_waits, pristine, fault, code, words, committed):
    cfg, out = config(tmp_path, **PREPARED_KEYS), tmp_path / "shards"
    if fault == "a full disk":
        full_disk_for(monkeypatch, "train_000002.bin", call="fsync")
    else:
        monkeypatch.setattr(shards, "write_shard", _read_only("train_000001.bin"))
    got, err = _cli_prepare(cfg, tmp_path, capsys)
    assert got == code and no_waits == []
    err = one_paragraph(err)
    assert all(word.format(out=out) in err for word in words), err
    assert [s["file"] for s in shards.read_manifest(out)["shards"]] == (HELD_OUT + [
        "train_000000.bin", "train_000001.bin"])[:committed]
    assert not any(".tmp" in p.name for p in out.iterdir()) and not (out / rundirs.LOCK_FILE).exists()
    monkeypatch.undo()
    assert _cli_prepare(cfg, tmp_path, capsys)[0] == 0
    assert shard_bytes(out) == pristine[1]
    assert json.loads((out / prepare.STATS).read_text())["splits"] == pristine[2]["splits"]


def test_a_doclens_file_that_is_a_link_is_refused_and_the_users_file_untouched(tmp_path, prepared):
    """The resume once truncated the file the link pointed to, then appended to it."""
    cfg, out, _, _ = prepared
    doclens, mine = out / ".doclens-val.u32", users_file(tmp_path)  # shorter than the user's file: not refused for that
    doclens.unlink()
    doclens.symlink_to(mine)
    with pytest.raises(ConfigError, match="symbolic link") as e:
        prepare.prepare(cfg, progress=False)
    assert str(doclens) in str(e.value) and mine.read_bytes() == USERS
