"""data.packing: bos_bestfit (nanopt/training/packing.py): rows start at a BOS, every token is in a row or counted as
cropped, rows do not depend on the world size, the plan resumes bit-exactly, the BOS index is cached. In a run:
e2e/test_packed_run.py."""
from __future__ import annotations

import errno
import json
import logging
import zlib
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import BOS, train_short

from nanopt.data import shards
from nanopt.errors import ConfigError
from nanopt.training import packing

pytestmark = pytest.mark.usefixtures("bos_cache")  # conftest: the BOS index cache is never the user's


def _corpus(tmp_path: Path, docs: int = 300, mean: float = 40, n_shards: int = 2, seed: int = 0) -> list[np.ndarray]:
    """Shards of byte documents, each a BOS then lognormal-many bytes, cut into shards mid-document."""
    rng = np.random.default_rng(seed)
    stream = np.concatenate([np.concatenate([[BOS], rng.integers(0, 256, max(1, int(n)))])
                             for n in rng.lognormal(np.log(mean), 0.8, docs)])
    return [shards.open_shard(shards.write_shard(tmp_path / f"train_{i:06d}.bin", c, 257))
            for i, c in enumerate(np.array_split(stream, n_shards))]


def _documents(tmp_path: Path, tokens) -> packing.Documents:  # one shard of these tokens
    return packing.Documents([shards.open_shard(shards.write_shard(tmp_path / "train_000000.bin", tokens, 257))], BOS)


def _rows(loader: packing.PackedLoader, steps: int, seq_len: int | None = None) -> list[tuple[int, ...]]:
    out = []
    for _ in range(steps):
        for x, y in loader.micro_batches(seq_len=seq_len):
            assert torch.equal(x[:, 1:], y[:, :-1])
            out += [tuple(r) + (int(last),) for r, last in zip(x.tolist(), y[:, -1])]
    return out


def test_every_row_starts_with_bos_and_holds_whole_documents_but_the_last(tmp_path):
    docs = packing.Documents(_corpus(tmp_path), BOS)
    packer, stream = packing.Packer(docs.lengths, buffer=50, seed=1), np.concatenate(docs.shards)
    for _ in range(200):
        docs.fill(row := np.empty(33, dtype=np.int64), pieces := packer.row(33))
        assert row[0] == BOS and (row == BOS).sum() == len(pieces)  # each piece starts at its document's BOS
        assert sum(take for _, take in pieces) == 33
        assert all(take == docs.lengths[d] for d, take in pieces[:-1])  # only the last piece may be cropped
        for d, take in pieces:  # a piece is its document's first tokens, across a shard's end too
            start = int(docs.starts[d])
            assert np.array_equal(row[:take], stream[start : start + take])
            row = row[take:]


def test_no_token_is_lost_silently_across_epochs(tmp_path):
    shards = _corpus(tmp_path, docs=60)
    shards[0] = np.concatenate([[7, 8, 9], shards[0]])  # tokens before the first BOS: in no document
    docs = packing.Documents(shards, BOS)
    assert docs.orphans == 3
    packer, total = packing.Packer(docs.lengths, buffer=20, seed=3, orphans=docs.orphans), int(docs.lengths.sum())
    for _ in range(400):  # several epochs
        packer.row(25)
        order = packing._order(len(docs.lengths), 3 * 1_000_003 + packer.epoch)  # seed 3's order of this epoch
        pulled = packer.epoch * total + int(docs.lengths[order[: packer.cursor]].sum())
        buffered = sum(length for length, _, _ in packer.buffer)
        assert packer.placed + packer.cropped + buffered == pulled + 3 * (packer.epoch + 1)
    assert packer.epoch >= 2 and 0 < packer.cropped_share < 1


def test_a_document_longer_than_a_row_is_cropped_to_the_row_and_a_crop_share_over_half_is_warned_once(tmp_path,
                                                                                                       caplog):
    loader = packing.PackedLoader(_documents(tmp_path, [BOS, *range(100)]), micro_batch=1, rank=0, world=1, accum=1,
                                  seed=0, seq_len=15, buffer=10)
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        x, y = loader.micro_batches()[0]
        assert x[0].tolist() == [BOS, *range(14)] and y[0, -1] == 14
        assert loader.metrics()["cropped_share"] == pytest.approx((101 - 16) / 101)
        _rows(loader, 3)
    warnings = [r.getMessage() for r in caplog.records if "cropped" in r.getMessage()]
    assert len(warnings) == 1 and "sample_by=paragraph" in warnings[0]


def test_rows_are_the_same_for_one_rank_and_for_two_and_a_new_seq_len_continues_the_plan(tmp_path):
    docs = packing.Documents(_corpus(tmp_path), BOS)
    one = packing.PackedLoader(docs, 2, 0, 1, 4, seed=5, seq_len=16, buffer=30)
    ranks = [packing.PackedLoader(docs, 2, r, 2, 2, seed=5, seq_len=16, buffer=30) for r in range(2)]
    for _ in range(6):
        a = [x for x, _ in one.micro_batches()]
        b, c = ([x for x, _ in r.micro_batches()] for r in ranks)
        # rank r's micro-step m holds global rows (m·world + r)·micro_batch onwards
        assert torch.equal(torch.cat(a), torch.cat([b[0], c[0], b[1], c[1]]))
    loader = packing.PackedLoader(docs, 2, 0, 1, 1, seed=2, seq_len=16, buffer=30)
    short, long = _rows(loader, 3, seq_len=16), _rows(loader, 3, seq_len=32)
    assert {len(r) for r in short} == {17} and {len(r) for r in long} == {33}
    assert loader.packer.rows == 12 and loader.packer.placed == 6 * 17 + 6 * 33


@pytest.mark.parametrize("first_steps", [3, 40])  # mid-epoch; past an epoch boundary (100 documents)
def test_the_plan_resumes_bit_exactly_from_its_state(tmp_path, first_steps):
    docs = packing.Documents(_corpus(tmp_path, docs=100), BOS)
    make = (lambda seed: packing.PackedLoader(docs, 2, 0, 1, 2, seed=seed, seq_len=24, buffer=40))  # noqa: E731
    straight, first, resumed = (make(seed) for seed in (9, 9, 0))
    want, got = _rows(straight, 60), _rows(first, first_steps)
    assert (first.packer.epoch > 0) == (first_steps == 40)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as state.json holds it
    got += _rows(resumed, 60 - first_steps)
    assert got == want
    assert resumed.state_dict() == straight.state_dict()


def test_no_bos_in_the_data_is_a_config_error_naming_the_key_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="data.packing.*no BOS.*token id 256.*--data.packing=windows"):
        _documents(tmp_path, np.arange(200) % 256)
    with pytest.raises(ConfigError, match="the tokenizer has none"):
        packing.Documents([shards.open_shard(tmp_path / "train_000000.bin")], None)


# ---------------------------------------------------------------- the cached BOS index
def _ids(arrays: list[np.ndarray]) -> list[shards.ShardInfo]:
    return [shards.read_header(a.filename) for a in arrays]


def _said(caplog, level: int, start: str) -> list[str]:
    return [r.getMessage().split(" (")[0] for r in caplog.records
            if r.levelno >= level and r.getMessage().startswith(start)]


def _expect_same(got: packing.Documents, want: packing.Documents) -> None:
    assert np.array_equal(got.starts, want.starts) and np.array_equal(got.lengths, want.lengths)
    assert got.starts.dtype == want.starts.dtype == np.int64 and got.orphans == want.orphans


def test_a_second_documents_reads_the_bos_index_from_the_cache_and_a_changed_shard_gets_its_own(tmp_path, bos_cache,
                                                                                                scans, caplog):
    arrays = _corpus(tmp_path, n_shards=3)
    plain = packing.Documents(arrays, BOS)  # no ids: scanned, nothing cached
    assert len(scans) == 3 and not bos_cache.exists()
    ids = _ids(arrays)
    _expect_same(packing.Documents(arrays, BOS, ids), plain)
    assert len(scans) == 6
    entry = bos_cache / f"{ids[1].crc32:08x}-{ids[1].count}-2-{BOS}.bin"  # header crc32, token count, itemsize, BOS id
    assert entry.stat().st_size == HEADER + 4 * int((arrays[1] == BOS).sum())  # uint32 positions after the header
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nanopt"):
        second = packing.Documents(arrays, BOS, ids)
    _expect_same(second, plain)
    assert len(scans) == 6 and len(list(bos_cache.iterdir())) == 3
    assert _said(caplog, logging.INFO, "BOS index") == ["BOS index: 3 shards from cache, 0 scanned"]
    new = _corpus(tmp_path, n_shards=1, seed=1)  # rewrites train_000000.bin
    _expect_same(packing.Documents(new, BOS, _ids(new)), packing.Documents(new, BOS))
    assert len(scans) == 8 and len(list(bos_cache.iterdir())) == 4  # another crc32, another entry


HEADER = packing.INDEX_HEADER.size


def _with_checksum(positions: np.ndarray, raw: bytes, count: int | None = None) -> bytes:
    """A forged entry: `positions` under `raw`'s header fields (its BOS count unless `count`), checksum recomputed."""
    fields, body = list(packing.INDEX_HEADER.unpack_from(raw))[:-1], positions.astype("<u4").tobytes()
    fields[-1] = fields[-1] if count is None else count
    unsigned = packing.INDEX_HEADER.pack(*fields, 0)[:-4]
    return packing.INDEX_HEADER.pack(*fields, zlib.crc32(body, zlib.crc32(unsigned))) + body


def _old_format(positions: np.ndarray) -> bytes:
    """An entry as nanopt wrote it before the BOS count: magic | 4 | crc32 of the positions | the positions."""
    body = positions.astype("<u4").tobytes()
    return b"NANOPTBI" + (4).to_bytes(4, "little") + zlib.crc32(body).to_bytes(4, "little") + body


DAMAGE = {
    "truncated": lambda raw, pos: raw[:-3],
    "shorter than its header": lambda raw, pos: raw[:10],
    "8-byte positions": lambda raw, pos: raw[:8] + b"\x08" + raw[9:],
    "a lost position, caught by the checksum": lambda raw, pos: raw[:HEADER] + np.delete(pos, 1).tobytes(),
    "a subset with a recomputed checksum, caught by the count": lambda raw, pos: _with_checksum(pos[::2], raw),
    "another shard's entry": lambda raw, pos: _with_checksum(pos, raw[:12] + b"\0\0\0\0" + raw[16:]),
    "a position that is no BOS": lambda raw, pos: _with_checksum(pos + np.isin(np.arange(len(pos)), [1]), raw),
    "a position past the end": lambda raw, pos: _with_checksum(np.append(pos, 10**6), raw, len(pos) + 1),
    "positions out of order": lambda raw, pos: _with_checksum(pos[::-1], raw),
    # The review's forgery: every other BOS position, checksum recomputed, in the format without the BOS count
    # (which nanopt accepted before the count): rows from whole documents glued together.
    "a forged subset in the old format": lambda raw, pos: _old_format(pos[::2]),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_cache_entry_is_warned_once_rescanned_and_rewritten(tmp_path, bos_cache, scans, caplog, damage):
    arrays = _corpus(tmp_path, n_shards=2)
    clean = packing.Documents(arrays, BOS, _ids(arrays))
    (entry, _) = sorted(bos_cache.iterdir())
    good = entry.read_bytes()
    entry.write_bytes(DAMAGE[damage](good, np.frombuffer(good[HEADER:], dtype="<u4")))
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        _expect_same(read := packing.Documents(arrays, BOS, _ids(arrays)), clean)
    assert _said(caplog, logging.WARNING, "") == [f"data: ignoring the damaged BOS index {entry}"]
    assert len(scans) == 3 and entry.read_bytes() == good  # rescanned and rewritten in the current format
    loaders = [packing.PackedLoader(d, 2, 0, 1, 1, 0, 15, 5) for d in (read, clean)]
    assert _rows(loaders[0], 4) == _rows(loaders[1], 4)
    packing.Documents(arrays, BOS, _ids(arrays))
    assert len(scans) == 3


@pytest.mark.parametrize("why", ["a file where the directory goes", "a full disk"])
def test_a_cache_that_cannot_be_written_costs_one_warning(tmp_path, monkeypatch, scans, caplog, why):
    if why == "a full disk":
        monkeypatch.setattr(packing, "write_bytes", mock.Mock(side_effect=OSError(errno.ENOSPC, "No space left")))
    else:
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("NANOPT_CACHE", str(tmp_path / "file"))
    arrays = _corpus(tmp_path, n_shards=3)
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        _expect_same(packing.Documents(arrays, BOS, _ids(arrays)), packing.Documents(arrays, BOS))
    where = packing.index_path(_ids(arrays)[0], BOS).parent
    assert _said(caplog, logging.WARNING, "") == [f"data: cannot cache the BOS index in {where}"]
    assert len(scans) == 6


def test_a_packing_change_the_user_allows_resumes_a_sound_checkpoint(tmp_path, capsys):
    """Before: the other loader's state was restored into this one (KeyError 'plan'), reported as a loader entry
    "damaged or written by another nanopt version" with advice to move a sound checkpoint aside."""
    assert train_short(tmp_path, "--train.max_steps=1", "--checkpoint.every=1", "--data.packing=windows") == 0
    for steps, after in ((2, "bos_bestfit"), (3, "windows")):  # one run, changed each way
        changed = [f"--train.max_steps={steps}", "--checkpoint.every=1", f"--data.packing={after}"]
        assert train_short(tmp_path, *changed) == 2  # refused, naming the way on
        assert "--checkpoint.allow_changes=KEY" in capsys.readouterr().err
        assert train_short(tmp_path, *changed, "--checkpoint.allow_changes=data.packing") == 0
        out = capsys.readouterr()
        assert "damaged" not in out.err + out.out
        assert json.loads((tmp_path / "summary.json").read_text())["steps"] == steps
