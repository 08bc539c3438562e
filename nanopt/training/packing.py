"""BOS-aligned best-fit packing (data.packing: bos_bestfit; docs/data.md). The train shards are one token stream
cut into documents at each BOS. Every row of seq_len+1 tokens starts at a document's BOS: the largest buffered
document that fits the room left goes in, again and again; when none fits, the shortest is cropped to fill the row
exactly and its rest discarded (the declared crop, counted). The plan is global and uses document lengths only, so
every rank plans the same rows and reads tokens for its own: the rows do not depend on the world size. Each
shard's BOS positions are cached under io.cache_dir() (bos_index), so a start need not read every train token."""
from __future__ import annotations

import functools
import logging
import math
import struct
import time
import zlib
from bisect import bisect_right, insort
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from nanopt.data.shards import ShardInfo
from nanopt.errors import ConfigError
from nanopt.io import cache_dir, read_bytes, write_bytes

log = logging.getLogger("nanopt")

CROP_WARNING_SHARE = 0.5
Batch = tuple[torch.Tensor, torch.Tensor]  # (x, y), each B T int64
# A cached BOS index: magic | bytes per position u32 | the shard's crc32 u32 | its token count u64 | the BOS id u32 |
# the BOS count u64 | crc32 of the header's other fields and the positions u32, then the positions, little-endian.
# The count makes an entry complete by construction (proving it against the shard would read every token).
INDEX_MAGIC = b"NANOPTB2"
INDEX_HEADER = struct.Struct("<8sIIQIQI")


def index_path(shard: ShardInfo, bos: int) -> Path:
    return cache_dir() / "bos-index" / f"{shard.crc32:08x}-{shard.count}-{shard.dtype.itemsize}-{bos}.bin"


def _position_dtype(n: int) -> np.dtype:
    return np.dtype("<u4") if n <= 2**32 else np.dtype("<u8")


def _scan(shard: np.ndarray, bos: int) -> np.ndarray:
    return np.flatnonzero(shard == bos).astype(_position_dtype(len(shard)))


def _entry(positions: np.ndarray, info: ShardInfo, bos: int) -> tuple[bytes, bytes]:
    body = positions.tobytes()
    fields = (INDEX_MAGIC, positions.itemsize, info.crc32, info.count, bos, len(positions))
    unsigned = INDEX_HEADER.pack(*fields, 0)[:-4]
    return INDEX_HEADER.pack(*fields, zlib.crc32(body, zlib.crc32(unsigned))), body


def _parse(raw: bytes, shard: np.ndarray, bos: int, info: ShardInfo) -> np.ndarray:
    """The positions a cache file holds, checked against the shard; ValueError (struct.error) says why not."""
    dtype = _position_dtype(len(shard))
    magic, itemsize, crc, count, entry_bos, bos_count, checksum = INDEX_HEADER.unpack_from(raw)  # struct.error: short
    body = memoryview(raw)[INDEX_HEADER.size:]
    if magic != INDEX_MAGIC or itemsize != dtype.itemsize or len(body) % itemsize:
        raise ValueError(f"not a BOS index of {dtype.itemsize}-byte positions, or truncated")
    if zlib.crc32(body, zlib.crc32(raw[:INDEX_HEADER.size - 4])) != checksum:
        raise ValueError("its checksum fails")
    if (crc, count, entry_bos) != (info.crc32, info.count, bos):
        raise ValueError("it indexes another shard or BOS id")
    pos = np.frombuffer(body, dtype=dtype)
    if len(pos) != bos_count:
        raise ValueError(f"it lists {len(pos)} positions of the {bos_count} BOS tokens its scan found")
    # In range and increasing first: the fancy index then reads only the pages that hold the positions.
    if len(pos) and (pos[-1] >= len(shard) or np.any(pos[1:] <= pos[:-1]) or not np.all(shard[pos] == bos)):
        raise ValueError("its positions are not the shard's BOS tokens in order")
    return pos


def _cached(path: Path, shard: np.ndarray, bos: int, info: ShardInfo) -> Optional[np.ndarray]:
    try:  # io.read_bytes refuses what is no regular file (ConfigError, a ValueError) unread: a FIFO would block
        return _parse(read_bytes(path), shard, bos, info)
    except (OSError, ValueError, struct.error) as e:
        if not isinstance(e, (FileNotFoundError, NotADirectoryError)):  # absent is no damage
            log.warning("data: ignoring the damaged BOS index %s (%s): scanning the shard and rewriting it", path, e)
    return None


def bos_index(shards: Sequence[np.ndarray], bos: int, ids: Optional[Sequence[ShardInfo]] = None) -> list[np.ndarray]:
    """Each shard's BOS positions as a scan finds them, from the cache when `ids` name the shards' contents. A
    damaged entry is rescanned and rewritten, an unwritable cache costs a warning; ranks write the same bytes."""
    t0, found, cached, unwritten = time.perf_counter(), [], 0, None
    for k, shard in enumerate(shards):
        path = index_path(ids[k], bos) if ids is not None else None
        positions = _cached(path, shard, bos, ids[k]) if path is not None else None
        cached += positions is not None
        if positions is None:
            positions = _scan(shard, bos)
            if path is not None and unwritten is None:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_bytes(path, *_entry(positions, ids[k], bos))
                except (OSError, ConfigError) as e:  # a cache: a directory at its name (ConfigError) as a read-only one
                    unwritten = e
        found.append(positions)
    if unwritten is not None:
        log.warning("data: cannot cache the BOS index in %s (%s): the next start scans again", path.parent, unwritten)
    log.info("BOS index: %d shards from cache, %d scanned (%.1f s)", cached, len(shards) - cached,
             time.perf_counter() - t0)
    return found


class Documents:
    """The shards as one stream; document i is stream[starts[i] : starts[i] + lengths[i]], from a BOS up to the
    next BOS or the stream's end (across a shard's end too). `ids` (the shards' headers) let bos_index cache."""

    def __init__(self, shards: list[np.ndarray], bos: Optional[int], ids: Optional[Sequence[ShardInfo]] = None):
        self.shards = shards
        self.offsets = np.cumsum([0] + [len(s) for s in shards])  # shard k is stream[offsets[k] : offsets[k + 1]]
        found = bos_index(shards, bos, ids) if bos is not None else []
        found = [f.astype(np.int64) + off for f, off in zip(found, self.offsets)]
        self.starts = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        if not len(self.starts):
            raise ConfigError(
                f"`data.packing` is bos_bestfit, which starts every row at a document's BOS token, but the training "
                f"shards hold no BOS ({'the tokenizer has none' if bos is None else f'token id {bos}'}), so there "
                f"are no documents to pack. Prepare the data with the tokenizer's BOS before every document "
                f"(`prepare.add_bos: true`, the default), or train with `--data.packing=windows`.")
        self.lengths = np.diff(np.append(self.starts, self.offsets[-1]))
        self.orphans = int(self.starts[0])  # tokens before the first BOS: in no document

    def fill(self, out: np.ndarray, pieces: list[tuple[int, int]]) -> None:
        """Write the (document, tokens from its start) pieces into `out` back to back."""
        pos = 0
        for doc, take in pieces:
            start = int(self.starts[doc])
            while take:  # one slice per shard the piece touches: one, unless it crosses a shard's end
                k = int(np.searchsorted(self.offsets, start, side="right")) - 1
                n = min(take, int(self.offsets[k + 1]) - start)
                local = start - int(self.offsets[k])
                out[pos : pos + n] = self.shards[k][local : local + n]
                pos, start, take = pos + n, start + n, take - n


@functools.lru_cache(maxsize=4)  # an epoch's order, drawn once per packer
def _order(n: int, seed: int) -> np.ndarray:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()


class Packer:
    """The plan: which documents fill each row, from their lengths alone. Documents enter the buffer in a seeded
    order per epoch; the buffer is a sorted list of (length, pull number, document), so the best fit is one
    bisection. Pull numbers (epoch × documents + position) keep entries unique across an epoch boundary."""

    def __init__(self, lengths: np.ndarray, buffer: int, seed: int, orphans: int = 0):
        self.lengths, self.seed, self.orphans = lengths, seed, orphans
        self.capacity = min(buffer, len(lengths))  # more would hold a document twice
        self.epoch, self.cursor = 0, 0
        self.buffer: list[tuple[int, int, int]] = []
        self.rows, self.placed, self.cropped = 0, 0, orphans

    def _next_document(self) -> tuple[int, int, int]:
        n = len(self.lengths)
        if self.cursor == n:
            self.epoch, self.cursor = self.epoch + 1, 0
            self.cropped += self.orphans  # each epoch passes over them once
        doc, self.cursor = int(_order(n, self.seed * 1_000_003 + self.epoch)[self.cursor]), self.cursor + 1
        return int(self.lengths[doc]), self.epoch * n + self.cursor - 1, doc

    def row(self, size: int) -> list[tuple[int, int]]:
        """One row of `size` tokens as (document, tokens from its start) pieces."""
        pieces, room = [], size
        while room:
            while len(self.buffer) < self.capacity:
                insort(self.buffer, self._next_document())
            i = bisect_right(self.buffer, (room, math.inf)) - 1  # the largest length <= room
            length, _, doc = self.buffer.pop(max(i, 0))  # none fits: the shortest, cropped
            take = min(length, room)
            self.cropped += length - take
            pieces.append((doc, take))
            room -= take
        self.rows, self.placed = self.rows + 1, self.placed + size
        return pieces

    @property
    def cropped_share(self) -> float:
        """Cropped tokens over the tokens taken from the stream (placed in rows or cropped)."""
        return self.cropped / max(1, self.placed + self.cropped)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "rows": self.rows, "placed": self.placed,
                "cropped": self.cropped, "buffer": [[pull, doc] for _, pull, doc in self.buffer]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.rows, self.placed, self.cropped = int(state["rows"]), int(state["placed"]), int(state["cropped"])
        self.buffer = sorted((int(self.lengths[doc]), int(pull), int(doc)) for pull, doc in state["buffer"])


class PackedLoader:
    """data.Loader's interface over packed rows. Every rank plans the step's G = accum × world × micro_batch rows;
    rank r's micro-step m reads rows (m·world + r)·micro_batch onwards, as data.Loader reads samples."""

    def __init__(self, documents: Documents, micro_batch: int, rank: int, world: int, accum: int, seed: int,
                 seq_len: int, buffer: int):
        self.documents, self.micro_batch, self.rank, self.world = documents, micro_batch, rank, world
        self.accum, self.seq_len, self.seed = accum, seq_len, seed
        self.packer = Packer(documents.lengths, buffer, seed, documents.orphans)
        self.step, self.warned = 0, False

    def micro_batches(self, accum: Optional[int] = None, seq_len: Optional[int] = None) -> list[Batch]:
        """This rank's micro-batches (x, y) for the next step."""
        accum, seq_len = accum or self.accum, seq_len or self.seq_len
        rows = [self.packer.row(seq_len + 1) for _ in range(accum * self.world * self.micro_batch)]
        mine = [rows[(m * self.world + self.rank) * self.micro_batch + b]
                for m in range(accum) for b in range(self.micro_batch)]
        block = np.empty((len(mine), seq_len + 1), dtype=np.int64)
        for row, pieces in zip(block, mine):
            self.documents.fill(row, pieces)
        out = [(t[:, :-1], t[:, 1:]) for t in torch.from_numpy(block).view(accum, self.micro_batch, seq_len + 1)]
        self.step += 1
        if not self.warned and self.rank == 0 and self.packer.cropped_share > CROP_WARNING_SHARE:
            self.warned = True
            log.warning("data: bos_bestfit has cropped %.0f%% of the tokens so far: the documents are long against "
                        "seq_len %d, so most of each is discarded. Prepare shorter documents (e.g. "
                        "`prepare.sample_by=paragraph`), raise train.seq_len, or keep `data.packing=windows`.",
                        100 * self.packer.cropped_share, seq_len)
        return out

    def metrics(self) -> dict[str, float]:
        return {"cropped_share": self.packer.cropped_share}

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "world": self.world, "micro_batch": self.micro_batch,
                "plan": self.packer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.seed = int(state["step"]), int(state["seed"])
        self.packer.seed = self.seed
        self.packer.load_state_dict(state["plan"])
