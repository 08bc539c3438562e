"""Batches from token shards: windows, the seeded rank-disjoint loader, evaluation batches, a run's splits."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch

from nanopt.config import Config
from nanopt.data.shards import check_manifest, embedded_shards, open_shard, read_header, split_paths, verify_shards
from nanopt.distributed.runtime import Runtime
from nanopt.errors import ConfigError, ShardError


# ---------------------------------------------------------------- loader
class TokenWindows:
    """Non-overlapping windows of seq_len+1 tokens over shards (checksummed by verify_shards), by a flat index."""

    def __init__(self, paths: list[Path], seq_len: int):
        if not paths:
            raise ShardError("no token shards given")
        self.paths = paths
        self.shards = [open_shard(p, verify=False) for p in paths]
        self.infos = [read_header(p) for p in paths]  # what names each shard's content (the BOS index cache's key)
        self.vocab_size = max(info.vocab_size for info in self.infos)
        self._cut(seq_len)

    def _cut(self, seq_len: int) -> None:
        self.seq_len = seq_len
        per_shard = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self.offsets = np.cumsum([0] + per_shard)
        if self.offsets[-1] == 0:
            raise ShardError(f"shards {', '.join(map(str, self.paths))} hold fewer than seq_len+1 = {seq_len + 1} "
                             f"tokens; lower `train.seq_len` or prepare more data")

    def regrid(self, seq_len: int) -> TokenWindows:
        other = copy.copy(self)
        other._cut(seq_len)
        return other

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def get(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self.offsets, index, side="right") - 1)
        start = (index - int(self.offsets[shard])) * self.seq_len
        return np.asarray(self.shards[shard][start : start + self.seq_len + 1], dtype=np.int64)

    def batch(self, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each B T int64: y is x shifted by one token."""
        t = torch.from_numpy(np.stack([self.get(int(i)) for i in indices]))
        return t[:, :-1], t[:, 1:]


class Loader:
    """Deterministic, rank-disjoint micro-batches. Sample s of the run is window perm_e[s mod N], e = s div N (a
    seeded permutation per epoch). A step of G = accum × world × micro_batch samples owns [cursor, cursor + G) and
    rank r's micro-step m reads micro_batch samples from cursor + (m·world + r)·micro_batch; the cursor then moves
    by G (step t starts at t·G while G is fixed). So every step sees the same sequences whatever the world size, and
    ranks never overlap."""

    def __init__(self, windows: TokenWindows, micro_batch: int, rank: int, world: int, accum: int, seed: int):
        self.windows, self.micro_batch = windows, micro_batch
        self.rank, self.world, self.accum, self.seed = rank, world, accum, seed
        self.step = 0  # next optimizer step to serve
        self.sample, self.seq_len = 0, windows.seq_len  # the cursor, on the grid of windows of seq_len
        self._grids = {windows.seq_len: windows}
        self._perm_key, self._perm = (-1, -1), None

    def _window(self, grid: TokenWindows, sample: int) -> int:
        n, epoch = len(grid), sample // len(grid)
        if (grid.seq_len, epoch) != self._perm_key:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_key = torch.randperm(n, generator=g).numpy(), (grid.seq_len, epoch)
        return int(self._perm[sample % n])

    def _grid(self, seq_len: int) -> TokenWindows:
        if seq_len not in self._grids:  # built on first use, then kept
            self._grids[seq_len] = self.windows.regrid(seq_len)
        return self._grids[seq_len]

    def micro_batches(self, accum: Optional[int] = None,
                      seq_len: Optional[int] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches (x, y) for the next step, each B T int64, at the stage's accum and seq_len."""
        accum = accum or self.accum
        if seq_len and seq_len != self.seq_len:
            # A seq_len schedule's new grid continues past the tokens consumed, at sample ceil(tokens / seq_len) of
            # its own permutation. That order is drawn afresh (a permutation of another N, not a continuation of
            # the old grid's), so text seen in the old grid's unfinished epoch can come again.
            self.sample, self.seq_len = -(-self.sample * self.seq_len // seq_len), seq_len
        grid = self._grid(self.seq_len)
        firsts = [self.sample + (m * self.world + self.rank) * self.micro_batch for m in range(accum)]
        out = [grid.batch(self._window(grid, first + b) for b in range(self.micro_batch)) for first in firsts]
        self.sample += accum * self.world * self.micro_batch
        self.step += 1
        return out

    def metrics(self) -> dict[str, float]:
        return {}  # windows crop nothing

    def state_dict(self) -> dict:
        return {"step": self.step, "sample": self.sample, "seq_len": self.seq_len, "seed": self.seed,
                "world": self.world, "accum": self.accum, "micro_batch": self.micro_batch}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.seed = int(state["step"]), int(state["seed"])
        # A checkpoint from before the cursor: step t began at t·G.
        old_cursor = self.step * int(state["accum"]) * int(state["world"]) * int(state["micro_batch"])
        self.sample, self.seq_len = int(state.get("sample", old_cursor)), int(state.get("seq_len", self.seq_len))


def eval_batches(windows: TokenWindows, micro_batch: int, batches: int, rank: int, world: int,
                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed evaluation set: the first batches × micro_batch windows of a permutation drawn from `seed` alone
    (eval.seed), the same for every run on any world size. Batch b goes to rank b mod world."""
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed)).numpy()
    rows = np.arange(micro_batch)
    return [windows.batch(order[(b * micro_batch + rows) % len(windows)]) for b in range(rank, batches, world)]


# ---------------------------------------------------------------- a run's data
def data_dir(cfg: Config, rt: Runtime) -> Path:
    """The embedded corpus (rank 0 builds the cache, the others wait), or `data.dir` / `data.source`."""
    if cfg.data.source == "embedded":
        if rt.is_main:
            embedded_shards(cfg.data.tokenizer)
        rt.barrier()
        return embedded_shards(cfg.data.tokenizer)  # built: every rank finds it whole
    directory = Path(cfg.data.dir or cfg.data.source)
    if not directory.is_dir():
        raise ConfigError(f"`data.source` is {cfg.data.source!r} but {directory} is not a directory of token shards; "
                          f"use `data.source: embedded` or run `nanopt prepare --config ...` first.")
    check_manifest(directory)
    return directory


def open_split(directory: Path, split: str, cfg: Config, verify: bool = True) -> TokenWindows:
    """The split as windows of train.seq_len + 1 tokens, checked against the model's vocabulary; with `verify`
    and `data.verify_checksum`, checksummed (training: on one rank per node)."""
    paths = split_paths(directory, split)
    if not paths:
        raise ConfigError(f"no `{split}_*.bin` token shards in {directory}; run `nanopt prepare` for this config.")
    try:
        if verify and cfg.data.verify_checksum:
            verify_shards(directory, paths)
        windows = TokenWindows(paths, cfg.train.seq_len)
    except ShardError as e:
        raise ConfigError(str(e)) from None
    if windows.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the shards in {directory} use a vocabulary of {windows.vocab_size} ids but "
                          f"`model.vocab_size` is {cfg.model.vocab_size}; set `model.vocab_size` to at least "
                          f"{windows.vocab_size}.")
    return windows
