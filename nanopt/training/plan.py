"""The stage plan: train.batch_schedule and seq_len_schedule as a run of max_steps trains them, computed once for a
world size. The loop, loaders, MFU meter, XLA step and `nanopt estimate` read it. Torch-free."""
from __future__ import annotations

import math
from dataclasses import dataclass

from nanopt.config import TrainConfig

LR_POWER = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}  # train.batch_lr_rule


@dataclass(frozen=True)
class Stage:
    """A stretch where neither schedule changes, as this world size runs it."""

    number: int  # from 1
    start: int  # in train.schedule_unit, as the schedules write it
    first_step: int  # the optimizer step it begins at (max_steps for a stage the run never reaches)
    steps: int  # optimizer steps in it, within max_steps: 0 when never reached (or skipped over, in tokens)
    batch_tokens: int
    seq_len: int
    accum: int  # micro_batch_size is fixed: a batch change changes only this, never a shape
    lr_factor: float  # (batch / the first stage's batch) ** p, p from train.batch_lr_rule
    tokens: int  # steps × batch_tokens


@dataclass(frozen=True)
class Plan:
    """Every stage, in order; without schedules one stage of train.global_batch_tokens at train.seq_len."""

    stages: tuple[Stage, ...]
    unit: str  # train.schedule_unit

    def at(self, step: int, tokens_seen: int) -> Stage:
        """Step `step`'s stage, from the run's counters (steps or tokens seen), so a resume continues in it."""
        where = step if self.unit == "steps" else tokens_seen
        return [s for s in self.stages if s.start <= where][-1]

    def tokens_left(self, step: int) -> int:
        """The tokens of the steps after `step` up to max_steps, each stage at its own batch (for the ETA)."""
        return sum(s.batch_tokens * max(0, s.first_step + s.steps - max(step, s.first_step)) for s in self.stages)


def build_plan(t: TrainConfig, world_size: int) -> Plan:
    """The plan of `t` on `world_size` ranks. A stage ends where the next starts (in tokens: a start jumped past
    gets 0 steps); the last at max_steps."""
    schedule = t.stages()
    first, power = schedule[0][1], LR_POWER[t.batch_lr_rule]
    stages, step, where = [], 0, 0  # `where`: steps or tokens done, in train.schedule_unit
    for i, (start, batch, seq_len) in enumerate(schedule):
        per_step = 1 if t.schedule_unit == "steps" else batch
        steps = t.max_steps - step
        if i + 1 < len(schedule):
            steps = min(steps, max(0, math.ceil((schedule[i + 1][0] - where) / per_step)))
        stages.append(Stage(i + 1, start, step, steps, batch, seq_len,
                            batch // (t.micro_batch_size * seq_len * world_size), (batch / first) ** power,
                            steps * batch))
        step, where = step + steps, where + steps * per_step
    return Plan(tuple(stages), t.schedule_unit)
