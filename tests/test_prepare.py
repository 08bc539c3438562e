"""`nanopt prepare`: local files through `datasets` -> a locally built HF tokenizer -> token shards; interrupt and
resume, rebuilt shards, what it may delete and which manifests it follows, one prepare per directory, and a full
disk or an unwritable file as one paragraph. Training on prepared shards: e2e/test_prepare_then_train.py."""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import socket
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub; fail fast if it tried
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import pytest
from conftest import (PREPARE_DOCS, REPO, USERS, full_disk_for, make_documents, one_paragraph, prepare_config,
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


def read_split(directory, split: str) -> np.ndarray:
    paths = shards.split_paths(directory, split)
    return np.concatenate([np.asarray(shards.open_shard(p)) for p in paths]) if paths else np.zeros(0, np.int64)


def framed(tok, docs: list[str], bos=True, eos=False) -> list[list[int]]:
    """Each document's tokens as prepare should write them, computed one document at a time."""
    return [([tok.bos_id] if bos else []) + tok.encode(d) + ([tok.eos_id] if eos else []) for d in docs]


# ---------------------------------------------------------------- round trip


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "text"])
def test_shards_decode_back_to_the_source_documents(tmp_path, tokenizer_dir, tok, fmt):
    dataset, files, docs = write_source(tmp_path / "src", fmt, PREPARE_DOCS)
    extra = {"sample_by": "document"} if fmt == "text" else {}
    cfg = prepare_config(tmp_path, tokenizer_dir, dataset, files, **extra)
    stats = prepare.prepare(cfg, progress=False)

    out = tmp_path / "shards"
    tokens = read_split(out, "train")
    assert shards.read_header(out / "train_000000.bin").dtype == np.uint16
    assert len(shards.split_paths(out, "train")) == math.ceil(len(tokens) / 300) > 1  # documents straddle shards
    assert shards.split_paths(out, "val") == [] and shards.split_paths(out, "test") == []
    starts = np.flatnonzero(tokens == tok.bos_id)
    pieces = np.split(tokens, starts[1:])
    assert len(pieces) == len(docs)
    for piece, doc in zip(pieces, docs):
        assert piece[0] == tok.bos_id
        assert tok.decode(piece[1:].tolist()) == doc
    assert stats["splits"]["train"]["documents"] == len(docs)
    assert stats["splits"]["train"]["tokens"] == len(tokens) == sum(map(len, framed(tok, docs)))


def test_bos_and_eos_frame_every_document(tmp_path, tokenizer_dir, tok):
    dataset, files, docs = write_source(tmp_path / "src", "jsonl", PREPARE_DOCS)
    cfg = prepare_config(tmp_path, tokenizer_dir, dataset, files, add_eos="true", workers=2)
    prepare.prepare(cfg, progress=False)
    expected = np.concatenate([np.asarray(x) for x in framed(tok, docs, bos=True, eos=True)])
    assert np.array_equal(read_split(tmp_path / "shards", "train"), expected)


# ---------------------------------------------------------------- budgets, counts, stats


def test_splits_honour_the_token_budgets_and_stats_are_right(tmp_path, tokenizer_dir, tok):
    dataset, files, docs = write_source(tmp_path / "src", "jsonl", PREPARE_DOCS)
    budgets = {"val": 400, "test": 350, "train": 1500}
    cfg = prepare_config(tmp_path, tokenizer_dir, dataset, files, val_tokens=400, test_tokens=350, train_tokens=1500)
    stats = prepare.prepare(cfg, progress=False)

    # Independent reference: fill val, then test, then train with whole documents from the stream, in
    # order; the document that crosses a budget is cut there and the rest of it is dropped.
    per_doc = framed(tok, docs)
    i = 0
    for split in ("val", "test", "train"):
        taken: list[list[int]] = []
        while sum(map(len, taken)) < budgets[split]:
            room = budgets[split] - sum(map(len, taken))
            taken.append(per_doc[i][:room])
            i += 1
        got = read_split(tmp_path / "shards", split)
        assert len(got) == budgets[split]
        assert got.tolist() == [t for d in taken for t in d]
        lengths = [len(d) for d in taken]
        s = stats["splits"][split]
        assert s["tokens"] == budgets[split] and s["documents"] == len(taken)
        assert s["mean_tokens_per_document"] == pytest.approx(np.mean(lengths))
        assert s["median_tokens_per_document"] == pytest.approx(np.median(lengths))
        sizes = [shards.read_header(p).count for p in shards.split_paths(tmp_path / "shards", split)]
        assert sizes[:-1] == [300] * (len(sizes) - 1) and 0 < sizes[-1] <= 300
    assert i < len(docs)  # the budget stopped the run before the source ran out
    assert stats["documents_read"] == i
    assert json.loads((tmp_path / "shards" / "stats.json").read_text())["splits"] == stats["splits"]


def test_estimate_only_sizes_the_document_count_with_a_25_percent_buffer(tmp_path, tokenizer_dir, tok, capsys):
    dataset, files, docs = write_source(tmp_path / "src", "jsonl", PREPARE_DOCS)
    cfg = prepare_config(tmp_path, tokenizer_dir, dataset, files, train_tokens=100_000, val_tokens=5000,
                         test_tokens=5000)
    e = prepare.sample_documents(cfg, 10)
    mean = np.mean([len(x) for x in framed(tok, docs[:10])])
    assert e["mean_tokens_per_document"] == pytest.approx(mean)
    assert e["documents_needed"] == math.ceil(110_000 / mean)
    assert e["documents_with_25pct_buffer"] == math.ceil(e["documents_needed"] * 1.25)

    argv = ["prepare", "tiny", "--sample-documents", "10", f"--data.source={tmp_path / 'never'}", f"--data.tokenizer={tokenizer_dir}",
            f"--prepare.dataset={dataset}", f"--prepare.data_files={files}", "--prepare.shuffle_buffer=0",
            "--prepare.train_tokens=100000", "--prepare.val_tokens=5000", "--prepare.test_tokens=5000"]
    assert cli.run(argv) == 0
    printed = capsys.readouterr().out
    assert f"{e['documents_with_25pct_buffer']:,}" in printed and f"{mean:.1f} tokens/document" in printed
    assert not (tmp_path / "never").exists()  # an estimate writes nothing


RESUME_KEYS = dict(val_tokens=400, test_tokens=350, train_tokens=2000, shard_tokens=170)


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, tokenizer_dir) -> tuple[dict, dict[str, bytes]]:
    """One uninterrupted preparation of PREPARE_DOCS at RESUME_KEYS: (its statistics, the bytes of its shards)."""
    root = tmp_path_factory.mktemp("whole")
    dataset, files, _ = write_source(root / "src", "jsonl", PREPARE_DOCS)
    stats = prepare.prepare(prepare_config(root, tokenizer_dir, dataset, files, "whole", **RESUME_KEYS), progress=False)
    assert sum(s["shards"] for s in stats["splits"].values()) >= 8
    return stats, shard_bytes(root / "whole")


def test_interrupt_and_resume_give_the_same_shards_as_one_run(tmp_path, tokenizer_dir, monkeypatch, whole_run):
    dataset, files, _ = write_source(tmp_path / "src", "jsonl", PREPARE_DOCS)
    keys, (whole, whole_bytes) = RESUME_KEYS, whole_run

    real_write = shards.write_shard

    def crash_on(call: int, after_write: bool):
        calls = {"n": 0}

        def write_shard(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == call:
                if after_write:  # the shard reached the disk but the manifest never heard of it
                    real_write(*args, **kwargs)
                raise KeyboardInterrupt
            return real_write(*args, **kwargs)

        return write_shard

    resumed = tmp_path / "resumed"
    # First run: the worker pool is running when Ctrl-C arrives, mid-stream, before shard 3 is written.
    monkeypatch.setattr(shards, "write_shard", crash_on(3, after_write=False))
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare(prepare_config(tmp_path, tokenizer_dir, dataset, files, "resumed", workers=2, **keys),
                        progress=False)
    manifest = json.loads((resumed / "manifest.json").read_text())
    assert len(manifest["shards"]) == 2 and not manifest["state"]["complete"]
    # Second run: dies right after writing a shard, before committing it.
    monkeypatch.setattr(shards, "write_shard", crash_on(2, after_write=True))
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare(prepare_config(tmp_path, tokenizer_dir, dataset, files, "resumed", **keys), progress=False)
    assert len(json.loads((resumed / "manifest.json").read_text())["shards"]) == 3
    assert len(list(resumed.glob("*.bin"))) == 4  # one uncommitted shard on disk
    # Third run finishes.
    monkeypatch.setattr(shards, "write_shard", real_write)
    final = prepare.prepare(prepare_config(tmp_path, tokenizer_dir, dataset, files, "resumed", **keys), progress=False)
    assert shard_bytes(resumed) == whole_bytes
    assert final["splits"] == whole["splits"]  # no document counted twice or lost in the statistics
    assert final["this_run"]["tokens"] < sum(keys[k] for k in ("val_tokens", "test_tokens", "train_tokens"))

    # A finished directory is left alone.
    again = prepare.prepare(prepare_config(tmp_path, tokenizer_dir, dataset, files, "resumed", **keys), progress=False)
    assert again["this_run"]["tokens"] == 0 and shard_bytes(resumed) == whole_bytes


def test_a_source_that_fails_mid_stream_is_resumed_to_the_same_shards(tmp_path, tokenizer_dir, monkeypatch, caplog,
                                                                      capsys, whole_run):
    dataset, files, _ = write_source(tmp_path / "src", "jsonl", PREPARE_DOCS)
    keys, whole_bytes = RESUME_KEYS, whole_run[1]
    real_iter, failures, waits = prepare.iter_texts, [], []

    def flaky(ds, text_field, start=0):  # the stream breaks twice, each time a few documents past the start
        for i, text in enumerate(real_iter(ds, text_field, start)):
            if len(failures) < 2 and i == 7:
                failures.append(start)
                raise ConnectionError("hub connection reset")
            yield text

    monkeypatch.setattr(prepare, "iter_texts", flaky)
    monkeypatch.setattr(prepare.time, "sleep", waits.append)
    cfg = prepare_config(tmp_path, tokenizer_dir, dataset, files, "flaky", **keys)
    with caplog.at_level("WARNING", logger="nanopt"):
        stats = prepare.prepare_with_retries(cfg, progress=False)
    assert len(failures) == 2 and failures[1] > 0  # the second attempt resumed past the start
    assert waits == [prepare.RETRY_WAIT_S, 2 * prepare.RETRY_WAIT_S] and "retry 1 of 5" in caplog.text
    assert shard_bytes(tmp_path / "flaky") == whole_bytes
    assert stats["splits"]["train"]["tokens"] == 2000

    failures.clear()  # out of retries: one paragraph, exit 1, the committed shards stay
    monkeypatch.setattr(prepare, "prepare", lambda *args: (_ for _ in ()).throw(ConnectionError("down")))
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(to_yaml(prepare_config(tmp_path, tokenizer_dir, dataset, files, "flaky", **keys)))
    assert prepare_command.main(["--config", str(cfg_file), "--no-progress", "--prepare.retries=1"]) == 1
    err = capsys.readouterr().err
    assert "kept failing (ConnectionError: down) after 1 retries" in err and "run the same command again" in err
    assert shard_bytes(tmp_path / "flaky") == whole_bytes


_REAL_ENCODE_TASK = prepare._encode_task


def _encode_task_then_die(batch):
    """A worker task (module level, so the pool can pickle it) that kills its process at document 20,
    as the OOM killer would."""
    if batch[0] >= 20:
        os._exit(9)
    return _REAL_ENCODE_TASK(batch)


def test_a_worker_that_dies_stops_prepare_with_an_error_not_a_hang(tmp_path, tokenizer_dir, monkeypatch, capsys):
    dataset, files, _ = write_source(tmp_path / "src", "jsonl", PREPARE_DOCS)
    cfg = prepare_config(tmp_path, tokenizer_dir, dataset, files, "dies", workers=2, shard_tokens=100,
                         train_tokens=2000)
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(to_yaml(cfg))
    monkeypatch.setattr(prepare, "_encode_task", _encode_task_then_die)
    assert prepare_command.main(["--config", str(cfg_file), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "worker process died" in err and "run the same command again" in err
    manifest = json.loads((tmp_path / "dies" / "manifest.json").read_text())
    assert manifest["shards"] and not manifest["state"]["complete"]  # what was committed stays, resumable
    monkeypatch.setattr(prepare, "_encode_task", _REAL_ENCODE_TASK)
    assert prepare_command.main(["--config", str(cfg_file), "--no-progress"]) == 0  # and it resumes to the end


def test_resume_refuses_a_directory_prepared_differently(tmp_path, tokenizer_dir):
    dataset, files, _ = write_source(tmp_path / "src", "jsonl", PREPARE_DOCS)
    prepare.prepare(prepare_config(tmp_path, tokenizer_dir, dataset, files, train_tokens=500), progress=False)
    with pytest.raises(ConfigError, match="different configuration"):
        prepare.prepare(prepare_config(tmp_path, tokenizer_dir, dataset, files, train_tokens=500, shard_tokens=100),
                        progress=False)
    # The same tokenizer name with a different definition (a hub tokenizer updated in place) is refused too.
    changed = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, changed)
    prepare.prepare(prepare_config(tmp_path, changed, dataset, files, "by-name", train_tokens=500), progress=False)
    spec = json.loads((changed / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    (changed / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="different configuration"):
        prepare.prepare(prepare_config(tmp_path, changed, dataset, files, "by-name", train_tokens=500), progress=False)


@pytest.mark.parametrize("fault", ["resized", "replaced", "extra", "val lost"])
def test_every_kind_of_mismatch_is_named(prepared, tokenizer_dir, fault):
    cfg, out, made, _ = prepared
    if fault == "resized":  # a shard cut short and its header rewritten to match: self-consistent, but not what was made
        shards.write_shard(out / "train_000002.bin", shards.open_shard(out / "train_000002.bin")[:100], 600)
        expected = "train_000002.bin holds 100 tokens, the manifest says 300"
    elif fault == "replaced":  # another shard of the same size copied over it
        (out / "train_000003.bin").write_bytes(made["train_000004.bin"])
        expected = "train_000003.bin is another shard than the one committed"
    elif fault == "extra":
        (out / "train_000099.bin").write_bytes(made["train_000000.bin"])
        expected = "train_000099.bin is not in the manifest"
    else:
        (out / "val_000001.bin").unlink()
        expected = "val_000001.bin is missing"
    with pytest.raises(ConfigError, match="do not match its manifest.json") as e:
        shards.check_manifest(out)
    assert expected in str(e.value)


def test_prepare_rebuilds_lost_and_resized_shards_to_identical_bytes(prepared):
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


def test_verify_rebuilds_a_corrupt_shard_that_only_its_checksum_shows(prepared):
    cfg, out, whole, _ = prepared
    raw = bytearray(whole["train_000004.bin"])
    raw[shards.HEADER_BYTES + 11] ^= 0x40  # one flipped bit in the tokens: header and size still agree
    (out / "train_000004.bin").write_bytes(bytes(raw))
    with pytest.raises(data.ShardError, match="prepare --verify"):
        shards.open_shard(out / "train_000004.bin")
    assert prepare.prepare(cfg, progress=False)["this_run"]["tokens"] == 0  # headers only: not seen
    prepare.prepare(cfg, progress=False, verify=True)
    assert shard_bytes(out) == whole


def test_a_rebuild_that_would_give_other_bytes_is_refused_and_keeps_the_files(prepared, tmp_path):
    cfg, out, whole, _ = prepared
    write_source(tmp_path / "src", "jsonl", make_documents(seed=1))  # the source changed under the same name
    (out / "train_000001.bin").unlink()
    with pytest.raises(ConfigError, match="source or the tokenizer changed"):
        prepare.prepare(cfg, progress=False)
    left = shard_bytes(out)
    assert left == {k: v for k, v in whole.items() if k != "train_000001.bin"}  # nothing else was lost
    with pytest.raises(ConfigError, match="waiting to be rebuilt"):
        shards.check_manifest(out)


def test_a_manifest_without_restart_points_refuses_to_rebuild(prepared):
    cfg, out, _, _ = prepared
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["shards"]:  # as nanopt wrote it before shards recorded where they start
        entry.pop("after"), entry.pop("crc32")
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "train_000003.bin").unlink()
    with pytest.raises(ConfigError, match="older nanopt.*Delete"):
        prepare.prepare(cfg, progress=False)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
@pytest.mark.parametrize("builder,suffix", [("json", "jsonl"), ("text", "txt")])
def test_an_empty_data_file_is_named_as_empty(tmp_path, tokenizer_dir, content, builder, suffix):
    (tmp_path / f"docs.{suffix}").write_text(content)
    cfg = prepare_config(tmp_path, tokenizer_dir, builder, str(tmp_path / f"docs.{suffix}"))
    with pytest.raises(ConfigError, match=r"names 1 empty file\(s\): .*docs\." + suffix):
        prepare.prepare(cfg, progress=False)


# ---------------------------------------------------------------- the hub path, offline


def test_hub_dataset_is_streamed_and_shuffled_as_configured(tmp_path, tokenizer_dir, tok, monkeypatch):
    """configs/1b.yaml's source, with datasets.load_dataset patched to serve local rows: the same
    functions run, and the call and the shuffle get exactly the recipe's arguments."""
    import datasets

    calls, shuffles = [], []
    rows = datasets.Dataset.from_dict({"text": PREPARE_DOCS, "id": list(range(len(PREPARE_DOCS)))})
    rows = rows.to_iterable_dataset(num_shards=4)

    def fake_load_dataset(path, *args, **kwargs):
        calls.append((path, args, kwargs))
        return rows

    real_shuffle = datasets.IterableDataset.shuffle

    def spy_shuffle(self, *args, **kwargs):
        shuffles.append((args, kwargs))
        return real_shuffle(self, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(datasets.IterableDataset, "shuffle", spy_shuffle)
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


# ---------------------------------------------------------------- large vocabularies, bad input


def test_vocabularies_over_65536_ids_are_written_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    wl = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok_dir = tmp_path / "big"
    PreTrainedTokenizerFast(tokenizer_object=wl, bos_token="<s>", unk_token="<unk>").save_pretrained(tok_dir)
    docs = ["w69999 w0 w65536", "w70000 w12"]  # w70000 is unknown
    dataset, files, _ = write_source(tmp_path / "src", "jsonl", docs)
    cfg = prepare_config(tmp_path, tok_dir, dataset, files, shard_tokens=1000)
    prepare.prepare(cfg, progress=False)
    shard = tmp_path / "shards" / "train_000000.bin"
    assert shards.read_header(shard).dtype == np.uint32 and shards.read_header(shard).vocab_size == 70_002
    assert np.asarray(shards.open_shard(shard)).tolist() == [0, 70_001, 2, 65_538, 0, 1, 14]


def test_bad_input_is_one_paragraph_and_exit_2(tmp_path, tokenizer_dir, capsys):
    dataset, files, _ = write_source(tmp_path / "src", "jsonl", PREPARE_DOCS[:3])
    base = ["prepare", f"--data.tokenizer={tokenizer_dir}", "--no-progress", "--prepare.workers", "1"]
    cases = {
        "data.source": base + ["--prepare.dataset=json", f"--prepare.data_files={files}"],
        "prepare.data_files": base + [f"--data.source={tmp_path / 'o1'}", "--prepare.dataset=parquet"],
        "cannot be loaded": base + [f"--data.source={tmp_path / 'o2'}", "--prepare.dataset=json",
                                    f"--prepare.data_files={tmp_path / 'missing.jsonl'}"],
        "prepare.text_field": base + [f"--data.source={tmp_path / 'o3'}", "--prepare.dataset=json",
                                      f"--prepare.data_files={files}", "--prepare.text_field=body"],
        "--sample-documents": base + ["--sample-documents", "many"],
    }
    for needle, argv in cases.items():
        assert cli.run(argv) == 2, needle
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err


def _raises(error: BaseException):
    def fetch(*args, **kwargs):
        raise error
    return fetch


def test_an_unreachable_hub_is_one_paragraph_at_once_naming_the_offline_fix(unreachable_hub, monkeypatch, capsys):
    """configs/1b.yaml's `--sample-documents` on a machine without network: the tokenizer, then (with a local
    one) the streamed dataset, each refused in one paragraph that names it, why, and what to do instead, exit 2.
    The fetches raise what transformers and datasets raise there; offline mode is on before they were called."""
    import datasets
    import transformers
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline_then = []
    tokenizer_error = OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find "
                              "them in the cached files.")
    tokenizer_error.__cause__ = LocalEntryNotFoundError("Cannot find the requested files in the disk cache")

    def from_pretrained(name, *args, **kwargs):
        offline_then.append(os.environ.get("HF_HUB_OFFLINE"))
        raise tokenizer_error

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.setattr(datasets, "load_dataset", _raises(ConnectionError(
        "Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub (OfflineModeIsEnabled)")))
    argv = ["prepare", "--config", str(REPO / "configs" / "1b.yaml"), "--sample-documents", "10"]
    assert cli.run(argv) == 2
    err = one_paragraph(capsys.readouterr().err)
    assert offline_then == ["1"]
    for words in ("`data.tokenizer` 'meta-llama/Llama-3.2-1B'", unreachable_hub, "not in the local cache",
                  "HF_HUB_OFFLINE=1", "`data.tokenizer` to a local directory"):
        assert words in err, err

    assert cli.run(argv + ["--data.tokenizer=byte", "--prepare.add_eos=false"]) == 2
    err = one_paragraph(capsys.readouterr().err)
    for words in ("`prepare.dataset` 'HuggingFaceFW/fineweb-edu' (subset sample-100BT", unreachable_hub,
                  "`prepare.streaming: true`", "copy the shards", "--prepare.dataset=json"):
        assert words in err, err


def test_an_offline_prepares_advice_to_tokenise_local_files_into_the_same_directory_works(unreachable_hub,
                                                                                          monkeypatch, tmp_path,
                                                                                          capsys):
    """Before: the failed prepare left a manifest with no shards, and following its advice (local files, the same
    data.source) was refused as "holds shards prepared with a different configuration ... delete it"."""
    import datasets

    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", _raises(ConnectionError(
        "Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub (OfflineModeIsEnabled)")))
    out = tmp_path / "shards"
    argv = ["prepare", f"--data.source={out}", "--data.tokenizer=byte", "--prepare.add_eos=false",
            "--prepare.dataset=HuggingFaceFW/fineweb-edu", "--prepare.shuffle_buffer=0", "--prepare.workers=1",
            "--prepare.shard_tokens=200", "--prepare.train_tokens=1000"]
    assert cli.run(argv) == 2
    assert "--prepare.dataset=json" in one_paragraph(capsys.readouterr().err)
    assert shards.read_manifest(out)["shards"] == []  # what the failed prepare leaves
    monkeypatch.setattr(datasets, "load_dataset", real)  # local files read as ever
    dataset, files, _ = write_source(tmp_path / "src", "jsonl", PREPARE_DOCS)
    assert cli.run([*argv, f"--prepare.dataset={dataset}", f"--prepare.data_files={files}"]) == 0
    assert shards.read_manifest(out)["shards"]


# ---------------------------------------------------------------- a shared data directory (the byte tokenizer)


FOX_DOCS = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(40)]


def byte_config(tmp_path, out_name: str = "shards", src: Path | None = None):
    """The byte tokenizer over a local JSON-lines file (`src`, default tmp_path/docs.jsonl, written when missing): 5
    train shards of 200 tokens, in about a second."""
    src = src or tmp_path / "docs.jsonl"
    if not src.exists():
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in FOX_DOCS))
    keys = {"dataset": "json", "data_files": str(src), "shuffle_buffer": 0, "workers": 1, "batch_documents": 8,
            "shard_tokens": 200, "train_tokens": 1000}
    overrides = [("data.source", str(tmp_path / out_name))] + [(f"prepare.{k}", str(v)) for k, v in keys.items()]
    return load_config(None, overrides)


@pytest.fixture(scope="module")
def byte_pristine(tmp_path_factory):
    """One complete preparation for the module: (its source file, its output directory, the bytes of every shard)."""
    root = tmp_path_factory.mktemp("byte")
    prepare.prepare(byte_config(root), progress=False)
    assert len(shards.split_paths(root / "shards", "train")) == 5
    return root / "docs.jsonl", root / "shards", shard_bytes(root / "shards")


@pytest.fixture
def byte_prepared(byte_pristine, tmp_path):
    """(config, output directory, the bytes of every shard): a copy of the shared preparation to damage, of the same
    source file (so of the same fingerprint)."""
    src, pristine, whole = byte_pristine
    shutil.copytree(pristine, tmp_path / "shards")
    return byte_config(tmp_path, src=src), tmp_path / "shards", whole


def _cli_prepare(cfg, tmp_path, capsys) -> tuple[int, str]:
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(to_yaml(cfg))
    code = cli.run(["prepare", "--config", str(cfg_file), "--no-progress"])  # the `nanopt` dispatcher: exit codes
    return code, capsys.readouterr().err


def test_verify_says_what_it_verified_and_a_failure_stays_exit_2(tmp_path, capsys):
    """Before, `nanopt prepare --verify` printed the usual statistics and never said it had read anything."""
    cfg, out = byte_config(tmp_path), tmp_path / "shards"  # its own source: it changes it
    prepare.prepare(cfg, progress=False)
    whole = shard_bytes(out)
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(to_yaml(cfg))
    verify = ["prepare", "--config", str(cfg_file), "--no-progress", "--verify"]
    tokens = sum(e["tokens"] for e in json.loads((out / "manifest.json").read_text())["shards"])
    assert cli.run(verify) == 0
    head = f"verify: {len(whole)} shards ({tokens:,} tokens) in {out} read whole against their crc32"
    assert capsys.readouterr().out.splitlines()[-1] == f"{head}: all OK"
    raw = bytearray(whole["train_000002.bin"])
    raw[shards.HEADER_BYTES + 3] ^= 0x40  # only the checksum shows it
    (out / "train_000002.bin").write_bytes(bytes(raw))
    assert cli.run(verify) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"{head}: 1 lost or corrupt (train_000002.bin), rebuilt from the source to identical bytes")
    assert shard_bytes(out) == whole
    # A shard that cannot be rebuilt (the source changed): one paragraph, exit 2, as without --verify.
    (out / "train_000002.bin").write_bytes(bytes(raw))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d.upper()}) + "\n" for d in FOX_DOCS))
    assert cli.run(verify) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanopt prepare: error: ") and "source or the tokenizer changed" in err
    assert err.strip().count("\n") == 0
    fresh = tmp_path / "fresh.yaml"
    fresh.write_text(to_yaml(byte_config(tmp_path, "fresh")))
    assert cli.run(["prepare", "--config", str(fresh), "--no-progress", "--verify"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("verify: no shards were committed")


# ---------------------------------------------------------------- what prepare deletes


def test_resume_deletes_only_shard_and_temp_files_prepare_writes(byte_prepared, caplog):
    """A user's train_000001.bin.bak or .gz beside the shards was deleted by every resume."""
    cfg, out, whole = byte_prepared
    users = {"train_000001.bin.bak": b"my backup", "train_000001.bin.gz": b"\x1f\x8b", "train_0000001.bin.x": b"x",
             "train_000002.bin.tmp.keep": b"k", ".train_000002.bin.tmp": b"h"}
    for name, content in users.items():
        (out / name).write_bytes(content)
    leftovers = ["train_000009.bin", "train_000003.bin.tmp", ".train_000004.bin.4242.139.tmp"]  # uncommitted, ours
    for name in leftovers:
        (out / name).write_bytes(whole["train_000000.bin"])
    with caplog.at_level("INFO", logger="nanopt"):
        assert prepare.prepare(cfg, progress=False)["this_run"]["tokens"] == 0
    assert {name: (out / name).read_bytes() for name in users} == users
    assert not any((out / name).exists() for name in leftovers)
    assert shard_bytes(out) == whole
    assert "left" in caplog.text and "train_000001.bin.bak" in caplog.text


def test_a_temp_shard_left_by_a_crash_is_removed_on_resume(tmp_path, monkeypatch, byte_pristine):
    """Whatever name nanopt.io gives its temp files, the one a crash leaves on the way to a shard is prepare's own."""
    real_replace = os.replace

    def crash_at_shard_2(src, dst, *args, **kwargs):
        if str(dst).endswith("train_000002.bin"):
            raise KeyboardInterrupt  # the tokens are on disk under the temp name, the rename never happened
        return real_replace(src, dst, *args, **kwargs)

    cfg = byte_config(tmp_path)
    out = tmp_path / "shards"
    monkeypatch.setattr(io.os, "replace", crash_at_shard_2)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare(cfg, progress=False)
    monkeypatch.setattr(io.os, "replace", real_replace)
    (left,) = [p for p in out.iterdir() if ".tmp" in p.name and "train_000002" in p.name]  # the crash left one
    left.rename(left.with_name(left.name.replace(f".{os.getpid()}.", ".1.")))  # as a resume in a new process sees it
    prepare.prepare(cfg, progress=False)
    _, whole, whole_bytes = byte_pristine
    assert shard_bytes(out) == whole_bytes
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in whole.iterdir())  # no temp file left


# ---------------------------------------------------------------- which manifests are followed


@pytest.mark.parametrize("builder, content, words", [
    ("json", b'{"text": "a fox"}\nnot json\n', ["'json'", "ArrowInvalid: JSON parse error"]),
    ("text", b"a fox\n\xff\xfe\x00 binary\n", ["'text'", "UnicodeDecodeError"]),
])
@pytest.mark.parametrize("streaming", [True, False])
def test_a_local_file_its_builder_cannot_parse_is_bad_input_not_a_source_failure(tmp_path, capsys, no_waits, builder,
                                                                                 content, words, streaming,
                                                                                 monkeypatch):
    """Before, streamed: a DatasetGenerationError / UnicodeDecodeError traceback, exit 1, as if the source were flaky
    (and retried first); loaded whole: exit 2, but naming only datasets' wrapper, not the parse error."""
    # datasets logs the parse error itself first, through a handler bound to the stderr of an earlier test's capture
    monkeypatch.setattr(logging.getLogger("datasets"), "handlers", [])
    monkeypatch.setattr(logging.getLogger("datasets"), "propagate", False)
    (tmp_path / "docs.src").write_bytes(content)
    cfg = byte_config(tmp_path)
    cfg.prepare.dataset, cfg.prepare.data_files = builder, str(tmp_path / "docs.src")
    cfg.prepare.streaming, cfg.prepare.retries = streaming, 1
    code, err = _cli_prepare(cfg, tmp_path, capsys)
    last = err.strip().splitlines()[-1]  # datasets logs its own line before it raises
    assert code == 2 and "Traceback" not in err and last.startswith("nanopt prepare: error: "), err
    for word in [str(tmp_path / "docs.src"), *words]:
        assert word in last, f"{word!r} missing from: {last}"
    assert no_waits == []  # not retried: waiting mends no file


def _set(path: str, value):
    """An edit of manifest.json: the value at a path like "state.next_doc" or "shards.1.after"."""
    def edit(manifest: dict) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        target = manifest
        for p in parents:
            target = target[p]
        target[last] = value
    return edit


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
     ["beyond any stream"], False),
    ([_set("state.doclens.train", 10**6)], ["1000000 train documents", ".doclens-train.u32 holds fewer"], False),
]


@pytest.mark.parametrize("damage, words, schema", DAMAGED_MANIFESTS)
def test_a_damaged_manifest_is_one_paragraph_and_nothing_is_touched(byte_prepared, tmp_path, capsys, damage, words,
                                                                    schema):
    """Before, a wrong type or range ended in a traceback (KeyError, islice's ValueError, IndexError) once prepare
    resumed."""
    cfg, out, whole = byte_prepared
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


@pytest.fixture
def no_waits(monkeypatch) -> list[float]:
    """prepare's retry waits, recorded instead of slept."""
    waits: list[float] = []
    monkeypatch.setattr(prepare.time, "sleep", waits.append)
    return waits


def test_prepare_into_a_file_is_exit_2_at_once(tmp_path, capsys, no_waits):
    """Before: the FileExistsError was taken for a flaky source and retried for minutes."""
    cfg = byte_config(tmp_path)
    (tmp_path / "shards").write_text("a file, not a directory")
    code, err = _cli_prepare(cfg, tmp_path, capsys)
    assert code == 2 and no_waits == []
    err = one_paragraph(err)
    assert str(tmp_path / "shards") in err and "is a file" in err and "`data.source`" in err
    assert (tmp_path / "shards").read_text() == "a file, not a directory"


def test_a_second_prepare_into_one_directory_is_exit_2_naming_the_holder(tmp_path, capsys, no_waits, byte_pristine):
    """Before: both exited 0, leaving doubled .doclens files and document counts."""
    cfg = byte_config(tmp_path)
    with DirLock(tmp_path / "shards", what="data"):  # a prepare running in this process, as the lease says
        code, err = _cli_prepare(cfg, tmp_path, capsys)
        assert code == 2
        err = one_paragraph(err)
        assert f"in use by process {os.getpid()} on host {socket.gethostname()}" in err
        assert str(tmp_path / "shards" / rundirs.LOCK_FILE) in err
        assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [rundirs.LOCK_FILE]  # nothing written
    code, _ = _cli_prepare(cfg, tmp_path, capsys)
    assert code == 0 and not (tmp_path / "shards" / rundirs.LOCK_FILE).exists()
    stats = json.loads((tmp_path / "shards" / prepare.STATS).read_text())
    assert stats["splits"] == json.loads((byte_pristine[1] / prepare.STATS).read_text())["splits"]


def test_a_full_disk_in_prepare_is_exit_1_at_once_and_the_rerun_ends_identical(tmp_path, monkeypatch, capsys, no_waits,
                                                                               byte_pristine):
    """Before: ENOSPC was taken for a flaky source: retried 5 times over 15 minutes, then "the source kept failing"."""
    cfg = byte_config(tmp_path)
    full_disk_for(monkeypatch, "train_000002.bin", call="fsync")
    code, err = _cli_prepare(cfg, tmp_path, capsys)
    assert code == 1 and no_waits == []
    err = one_paragraph(err)
    out = tmp_path / "shards"
    assert f"writing {out / 'train_000002.bin'}" in err and "GiB free" in err and "run the same command again" in err
    assert [s["file"] for s in shards.read_manifest(out)["shards"]] == ["train_000000.bin", "train_000001.bin"]
    assert not any(".tmp" in p.name for p in out.iterdir()) and not (out / rundirs.LOCK_FILE).exists()
    monkeypatch.undo()
    assert _cli_prepare(cfg, tmp_path, capsys)[0] == 0
    _, whole, whole_bytes = byte_pristine
    assert shard_bytes(out) == whole_bytes
    assert json.loads((out / prepare.STATS).read_text())["splits"] == json.loads((whole / prepare.STATS).read_text())[
        "splits"]


def test_an_output_file_prepare_cannot_write_is_exit_2_at_once(tmp_path, monkeypatch, capsys, no_waits):
    """Before: a PermissionError on a shard was taken for a flaky source and retried for minutes, then exit 1."""
    cfg = byte_config(tmp_path)
    real = shards.write_shard

    def read_only(path, *args):
        if Path(path).name == "train_000001.bin":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args)

    monkeypatch.setattr(shards, "write_shard", read_only)
    code, err = _cli_prepare(cfg, tmp_path, capsys)
    assert code == 2 and no_waits == []
    err = one_paragraph(err)
    out = tmp_path / "shards"
    assert f"{out / 'train_000001.bin'}: permission denied" in err and "run the command again" in err
    assert [s["file"] for s in shards.read_manifest(out)["shards"]] == ["train_000000.bin"]


def test_a_doclens_file_that_is_a_link_is_refused_and_the_users_file_untouched(tmp_path, byte_prepared):
    """Before: the resume truncated the file the link pointed to, then appended to it."""
    cfg, out, _ = byte_prepared
    doclens = out / ".doclens-train.u32"
    mine = users_file(tmp_path)
    doclens.unlink()
    doclens.symlink_to(mine)
    with pytest.raises(ConfigError, match="symbolic link") as e:
        prepare.prepare(cfg, progress=False)
    assert str(doclens) in str(e.value) and mine.read_bytes() == USERS
