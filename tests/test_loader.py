"""The loader (nanopt/training/loader.py): rank-disjoint, deterministic, resumable batches of windows that never cross a shard,
across batch and seq_len stages too, and seeded evaluation batches."""
from __future__ import annotations

import json

import numpy as np
import torch

from nanopt.data import shards
from nanopt.training import loader as data


def _windows(tmp_path, n_tokens=5000, seq_len=16, n_shards=2):
    paths = []
    per = n_tokens // n_shards
    for s in range(n_shards):
        # Distinct ids everywhere, so a window's content identifies the window.
        paths.append(shards.write_shard(tmp_path / f"train_{s:06d}.bin", np.arange(s * per, (s + 1) * per), 65536))
    return data.TokenWindows(paths, seq_len)


def _seen(loader, steps):
    rows = []
    for _ in range(steps):
        for x, y in loader.micro_batches():
            assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
            rows += [tuple(r.tolist()) for r in x]
    return rows


def test_ranks_never_overlap_and_cover_the_same_set_as_one_rank(tmp_path):
    w = _windows(tmp_path)
    one = data.Loader(w, micro_batch=4, rank=0, world=1, accum=4, seed=3)
    r0 = data.Loader(w, micro_batch=4, rank=0, world=2, accum=2, seed=3)
    r1 = data.Loader(w, micro_batch=4, rank=1, world=2, accum=2, seed=3)
    for _ in range(5):
        a = [tuple(r.tolist()) for x, _ in one.micro_batches() for r in x]
        b = [tuple(r.tolist()) for x, _ in r0.micro_batches() for r in x]
        c = [tuple(r.tolist()) for x, _ in r1.micro_batches() for r in x]
        assert not set(b) & set(c)
        assert sorted(a) == sorted(b + c)


def test_loader_is_deterministic_and_seed_dependent(tmp_path):
    w = _windows(tmp_path)
    a = _seen(data.Loader(w, 4, 0, 1, 2, seed=1), 3)
    b = _seen(data.Loader(w, 4, 0, 1, 2, seed=1), 3)
    c = _seen(data.Loader(w, 4, 0, 1, 2, seed=2), 3)
    assert a == b and a != c


def test_state_dict_resumes_the_exact_batch_sequence(tmp_path):
    w = _windows(tmp_path)
    straight = data.Loader(w, 4, 0, 1, 2, seed=5)
    want = _seen(straight, 40)  # 40 steps x 8 windows > 312 windows: crosses an epoch boundary
    first = data.Loader(w, 4, 0, 1, 2, seed=5)
    got = _seen(first, 17)
    resumed = data.Loader(w, 4, 0, 1, 2, seed=0)
    resumed.load_state_dict(first.state_dict())
    got += _seen(resumed, 23)
    assert got == want


def test_windows_do_not_cross_shard_boundaries(tmp_path):
    w = _windows(tmp_path, n_tokens=100, seq_len=10, n_shards=2)
    assert len(w) == 2 * ((50 - 1) // 10)
    for i in range(len(w)):
        row = w.get(i)
        assert len(row) == 11
        assert np.all(np.diff(row) == 1)  # contiguous ids: never spans two shards


def test_eval_batches_are_fixed_and_split_over_ranks(tmp_path):
    w = _windows(tmp_path)
    whole = data.eval_batches(w, 4, batches=6, rank=0, world=1)
    r0 = data.eval_batches(w, 4, batches=6, rank=0, world=2)
    r1 = data.eval_batches(w, 4, batches=6, rank=1, world=2)
    key = lambda bs: sorted(tuple(r.tolist()) for x, _ in bs for r in x)  # noqa: E731
    assert key(whole) == key(r0 + r1)
    assert len(r0) == len(r1) == 3


# ---------------------------------------------------------------- the windows loader across stages


def _rows(loader: data.Loader, steps: int, accum=None, seq_len=None) -> list[tuple[int, ...]]:
    return [tuple(r) for _ in range(steps) for x, _ in loader.micro_batches(accum, seq_len) for r in x.tolist()]


def test_windows_without_a_schedule_are_the_old_formula_bit_for_bit(tmp_path):
    w = _windows(tmp_path)
    mb, world, accum, seed = 4, 2, 3, 11
    per_step = accum * world * mb
    for rank in range(world):
        loader = data.Loader(w, mb, rank, world, accum, seed)
        for t in range(30):  # past an epoch (312 windows)
            got = loader.micro_batches()
            for m, (x, y) in enumerate(got):
                samples = [t * per_step + (m * world + rank) * mb + b for b in range(mb)]
                perms = {e: torch.randperm(len(w), generator=torch.Generator().manual_seed(seed * 1_000_003 + e))
                         for e in {s // len(w) for s in samples}}
                rows = np.stack([w.get(int(perms[s // len(w)][s % len(w)])) for s in samples])
                assert torch.equal(x, torch.from_numpy(rows[:, :-1])) and torch.equal(y, torch.from_numpy(rows[:, 1:]))


def test_a_batch_change_serves_more_rows_and_a_seq_len_change_a_new_grid(tmp_path):
    loader = data.Loader(_windows(tmp_path, seq_len=32), 2, 0, 1, 2, seed=1)
    assert len(_rows(loader, 3, accum=2, seq_len=16)) == 12 and loader.sample == 12
    assert len(_rows(loader, 1, accum=5, seq_len=16)) == 10 and loader.sample == 22
    rows = _rows(loader, 2, accum=2, seq_len=32)
    # 22 windows of 16 tokens = 352 tokens consumed: the 32-token grid goes on at sample ceil(352 / 32) = 11
    assert {len(r) for r in rows} == {32} and loader.sample == 11 + 8
    grid = loader._grid(32)
    perm = torch.randperm(len(grid), generator=torch.Generator().manual_seed(1 * 1_000_003))
    assert rows[0] == tuple(grid.get(int(perm[11]))[:-1])
    assert set(loader._grids) == {16, 32}


def test_the_windows_loader_resumes_mid_stage_from_its_state(tmp_path):
    w = _windows(tmp_path)
    plan = [(2, 16)] * 3 + [(4, 16)] * 3 + [(2, 32)] * 40  # 40 steps of 32: past an epoch of that grid
    straight = data.Loader(w, 2, 0, 1, 2, seed=4)
    want = [row for accum, seq in plan for row in _rows(straight, 1, accum, seq)]
    first = data.Loader(w, 2, 0, 1, 2, seed=4)
    got = [row for accum, seq in plan[:8] for row in _rows(first, 1, accum, seq)]
    resumed = data.Loader(w, 2, 0, 1, 2, seed=0)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [row for accum, seq in plan[8:] for row in _rows(resumed, 1, accum, seq)]
    assert got == want


def test_a_checkpoint_from_before_the_cursor_resumes_where_it_was(tmp_path):
    w = _windows(tmp_path)
    straight = data.Loader(w, 4, 0, 1, 2, seed=5)
    want = _rows(straight, 10)[5 * 8:]
    resumed = data.Loader(w, 4, 0, 1, 2, seed=0)
    resumed.load_state_dict({"step": 5, "seed": 5, "world": 1, "accum": 2, "micro_batch": 4})
    assert _rows(resumed, 5) == want


# ---------------------------------------------------------------- evaluation batches


def test_eval_batches_are_a_seeded_sample_of_the_whole_split(corpus_dir):
    windows = data.TokenWindows(shards.split_paths(corpus_dir, "val"), 32)
    a = data.eval_batches(windows, 4, 3, 0, 1, seed=0)
    b = data.eval_batches(windows, 4, 3, 0, 1, seed=0)
    other = data.eval_batches(windows, 4, 3, 0, 1, seed=1)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert not torch.equal(a[0][0], other[0][0])
    # Not just the head of the first document: the windows come from all over the split.
    starts = [row[:8].tolist() for x, _ in a for row in x]
    first = [windows.get(i)[:8].tolist() for i in range(12)]
    assert starts != first
