"""Evaluation: loss and bits per byte over the fixed validation/test sets (data.eval_batches: the same windows on
any world size), and the speedrun clock. bpb = nats / ln 2 / UTF-8 bytes of the targets, across tokenizers."""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Literal, Optional

import torch

from nanopt.config import Config
from nanopt.data import shards
from nanopt.data.tokenizer import Tokenizer
from nanopt.distributed import parallel
from nanopt.distributed.runtime import Runtime
from nanopt.training import loader as data

log = logging.getLogger("nanopt")

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def token_bytes_table(tokenizer: Tokenizer, vocab_size: int, device: torch.device) -> torch.Tensor:
    """(vocab_size,) UTF-8 bytes per id; ids the tokenizer does not know (model vocab padding) count 0."""
    return torch.tensor(tokenizer.token_bytes() + [0] * (vocab_size - tokenizer.vocab_size), device=device)


def split_batches(cfg: Config, rt: Runtime, directory: Path, split: str, batches: int) -> Optional[Batches]:
    """This rank's share of a split's fixed evaluation set, or None when the split has no shards."""
    if not shards.split_paths(directory, split):
        return None
    windows = data.open_split(directory, split, cfg)
    return data.eval_batches(windows, cfg.train.micro_batch_size, batches, rt.rank, rt.world_size, cfg.eval.seed)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Batches, token_bytes: torch.Tensor, rt: Runtime) -> tuple[float, float]:
    """(mean loss in nats per token, bits per byte) over a fixed evaluation set, summed over ranks."""
    model.eval()
    short = _forwards_short(model, len(batches), rt)  # before any forward: the count exchange is a collective too
    totals = torch.zeros(3, dtype=torch.float64, device=rt.device)  # nats, tokens, bytes
    for x, y in batches:
        x, y = rt.backend.batch_to_device(x), rt.backend.batch_to_device(y)
        with rt.autocast():
            loss = model(x, y)
        n = y.numel()
        totals[0] += loss.double() * n
        totals[1] += n
        totals[2] += token_bytes[y].sum()
        rt.backend.mark_step()  # XLA: one graph per batch (the same one every time), not one growing graph
    idle = torch.zeros(1, 1, dtype=torch.long, device=rt.device)  # B T: one token, its logits discarded
    for _ in range(short):
        with rt.autocast():
            model(idle)
    model.train()
    rt.all_reduce_sum(totals)
    nats, tokens, nbytes = totals.tolist()
    return nats / max(tokens, 1), nats / math.log(2) / max(nbytes, 1)


def _forwards_short(model: torch.nn.Module, batches: int, rt: Runtime) -> int:
    """How many forwards fewer than the busiest rank this one has: a sharded model's forward is a collective, so a
    rank with fewer batches runs that many discarded one-token forwards, or the others would wait forever."""
    return max(rt.gather_objects(batches)) - batches if parallel.is_sharded(model) else 0


class SpeedrunClock:
    """The first evaluation at or below train.target_val_loss (or target_val_bpb): its step, tokens and training
    seconds. Another target restarts it."""

    def __init__(self, target: Optional[float], metric: Literal["val_loss", "val_bpb"] = "val_loss"):
        self.target, self.metric = target, metric
        self.hit: Optional[dict[str, Any]] = None

    @classmethod
    def for_config(cls, cfg: Config) -> "SpeedrunClock":
        t = cfg.train
        return cls(t.target_val_loss) if t.target_val_bpb is None else cls(t.target_val_bpb, "val_bpb")

    @property
    def reached(self) -> bool:
        return self.hit is not None

    @property
    def key(self) -> str:  # the summary key that names the target
        return f"target_{self.metric}"

    def observe(self, val_loss: float, val_bpb: float, step: int, tokens: int, train_seconds: float,
                rt: Runtime) -> None:
        value = val_bpb if self.metric == "val_bpb" else val_loss
        if self.target is None or self.hit is not None or value > self.target:
            return
        self.hit = {self.key: self.target, "val_loss": val_loss, "val_bpb": val_bpb, "step": step,
                    "tokens": tokens, "train_seconds": train_seconds}
        if rt.is_main:
            log.info("target %s %.4f reached at step %d after %.1f s of training (%s tokens)",
                     self.metric.replace("_", " "), self.target, step, train_seconds, f"{tokens:,}")

    def missed(self, steps: int, best_val_loss: Optional[float], best_val_bpb: Optional[float]) -> Optional[str]:
        """The run's last word on a target set but not reached (None otherwise): the target and the best it came to."""
        if self.target is None or self.reached:
            return None
        closest = "no evaluation ran" if best_val_loss is None else f"best val loss {best_val_loss:.4f}"
        if best_val_bpb is not None:  # None after a resume from a checkpoint older than the bpb record
            closest += f", val bpb {best_val_bpb:.4f}"
        return (f"target {self.metric.replace('_', ' ')} {self.target:.4f} not reached in {steps} steps ({closest}); "
                f"summary.json says \"target_reached\": false")

    def summary(self) -> dict[str, Any]:
        if self.target is None:
            return {}
        hit = self.hit or {}
        return {self.key: self.target, "target_reached": bool(hit), "step_to_target": hit.get("step"),
                "tokens_to_target": hit.get("tokens"), "train_seconds_to_target": hit.get("train_seconds")}

    def state_dict(self) -> dict[str, Any]:
        return {"hit": self.hit}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hit = state.get("hit")
        self.hit = hit if hit is not None and hit.get(self.key) == self.target else None
