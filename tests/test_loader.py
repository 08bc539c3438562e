"""The loader (nanopt/training/loader.py): rank-disjoint, deterministic, resumable batches of windows that never cross a
shard, across batch and seq_len stages too, and seeded evaluation batches."""
from __future__ import annotations

import json

import numpy as np
import torch

from nanopt.data import shards
from nanopt.training import loader as data


def _windows(tmp_path, n_tokens=5000, seq_len=16, n_shards=2):
    per = n_tokens // n_shards  # distinct ids everywhere, so a window's content identifies the window
    return data.TokenWindows([shards.write_shard(tmp_path / f"train_{s:06d}.bin", np.arange(s * per, (s + 1) * per),
                                                 65536) for s in range(n_shards)], seq_len)


def _rows(loader: data.Loader, steps: int, accum=None, seq_len=None) -> list[tuple[int, ...]]:
    rows = []
    for _ in range(steps):
        for x, y in loader.micro_batches(accum, seq_len):
            assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
            rows += [tuple(r) for r in x.tolist()]
    return rows


def test_ranks_never_overlap_the_loader_is_deterministic_and_its_state_resumes_the_exact_batches(tmp_path):
    w = _windows(tmp_path)
    one = data.Loader(w, micro_batch=4, rank=0, world=1, accum=4, seed=3)
    r0, r1 = (data.Loader(w, micro_batch=4, rank=r, world=2, accum=2, seed=3) for r in range(2))
    for _ in range(5):
        a, b, c = _rows(one, 1), _rows(r0, 1), _rows(r1, 1)
        assert not set(b) & set(c)
        assert sorted(a) == sorted(b + c)
    a, b, c = (_rows(data.Loader(w, 4, 0, 1, 2, seed=seed), 3) for seed in (1, 1, 2))
    assert a == b and a != c
    want = _rows(data.Loader(w, 4, 0, 1, 2, seed=5), 40)  # 40 steps x 8 windows > 312 windows: past an epoch
    first = data.Loader(w, 4, 0, 1, 2, seed=5)
    got = _rows(first, 17)
    resumed = data.Loader(w, 4, 0, 1, 2, seed=0)
    resumed.load_state_dict(first.state_dict())
    assert got + _rows(resumed, 23) == want
    resumed = data.Loader(w, 4, 0, 1, 2, seed=0)  # a checkpoint from before the cursor resumes where it was
    resumed.load_state_dict({"step": 5, "seed": 5, "world": 1, "accum": 2, "micro_batch": 4})
    assert _rows(resumed, 5) == want[5 * 8 : 10 * 8]


def test_windows_do_not_cross_shard_boundaries(tmp_path):
    w = _windows(tmp_path, n_tokens=100, seq_len=10, n_shards=2)
    assert len(w) == 2 * ((50 - 1) // 10)
    for row in map(w.get, range(len(w))):  # contiguous ids: never spans two shards
        assert len(row) == 11 and np.all(np.diff(row) == 1)


def test_windows_without_a_schedule_are_the_old_formula_bit_for_bit(tmp_path):
    w = _windows(tmp_path)
    mb, world, accum, seed = 4, 2, 3, 11
    for rank in range(world):
        loader = data.Loader(w, mb, rank, world, accum, seed)
        for t in range(30):  # past an epoch (312 windows)
            for m, (x, y) in enumerate(loader.micro_batches()):
                samples = [t * accum * world * mb + (m * world + rank) * mb + b for b in range(mb)]
                perms = {e: torch.randperm(len(w), generator=torch.Generator().manual_seed(seed * 1_000_003 + e))
                         for e in {s // len(w) for s in samples}}
                rows = np.stack([w.get(int(perms[s // len(w)][s % len(w)])) for s in samples])
                assert torch.equal(x, torch.from_numpy(rows[:, :-1])) and torch.equal(y, torch.from_numpy(rows[:, 1:]))


def test_a_batch_change_serves_more_rows_a_seq_len_change_a_new_grid_and_both_resume_mid_stage(tmp_path):
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
    plan = [(2, 16)] * 3 + [(4, 16)] * 3 + [(2, 32)] * 40  # resumed mid-stage; 40 steps of 32: past an epoch (156)
    straight, first, resumed = (data.Loader(loader.windows, 2, 0, 1, 2, seed=seed) for seed in (4, 4, 0))
    want = [row for accum, seq in plan for row in _rows(straight, 1, accum, seq)]
    got = [row for accum, seq in plan[:8] for row in _rows(first, 1, accum, seq)]
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert got + [row for accum, seq in plan[8:] for row in _rows(resumed, 1, accum, seq)] == want


def test_eval_batches_are_fixed_split_over_ranks_and_a_seeded_sample_of_the_whole_split(tmp_path, corpus_dir):
    w = _windows(tmp_path)
    whole, r0, r1 = (data.eval_batches(w, 4, batches=6, rank=r, world=n) for r, n in ((0, 1), (0, 2), (1, 2)))
    key = lambda bs: sorted(tuple(r.tolist()) for x, _ in bs for r in x)  # noqa: E731
    assert key(whole) == key(r0 + r1)
    assert len(r0) == len(r1) == 3
    windows = data.TokenWindows(shards.split_paths(corpus_dir, "val"), 32)
    a, b, other = (data.eval_batches(windows, 4, 3, 0, 1, seed=seed) for seed in (0, 0, 1))
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert not torch.equal(a[0][0], other[0][0])
    # Not just the head of the first document: the windows come from all over the split.
    assert [row[:8].tolist() for x, _ in a for row in x] != [windows.get(i)[:8].tolist() for i in range(12)]
