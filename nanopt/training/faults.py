"""Faults a run must survive: preemption signals, a diverging loss, and the env hooks tests use to inject
crashes. The error types and exit statuses they lead to are in errors.py."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from nanopt.distributed.runtime import Runtime
from nanopt.errors import TrainingError
from nanopt.io import write_text

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: list[int] = []  # signals this process got while preemption_handlers() was active
_first_at = 0.0  # time.monotonic() of the first one
# Ctrl-C under torchrun reaches a worker twice: SIGINT from the terminal, then the SIGTERM torchrun forwards.
# A repeat that close to the first is the same request, not a "second signal".
REPEAT_WINDOW_S = 1.0


def signalled() -> Optional[int]:
    """The first SIGTERM/SIGINT received, or None."""
    return _received[0] if _received else None


def _handle(signum: int, frame: object) -> None:
    global _first_at
    name = signal.Signals(signum).name
    if _received and time.monotonic() - _first_at < REPEAT_WINDOW_S:
        return
    if _received:
        print(f"nanopt: second signal ({name}): exiting now, without a checkpoint.", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    _received.append(signum)
    _first_at = time.monotonic()
    print(f"nanopt: received {name}: finishing the current step, then saving a checkpoint and exiting (send it again "
          f"to exit at once).", file=sys.stderr, flush=True)


@contextlib.contextmanager
def preemption_handlers() -> Iterator[None]:
    """SIGTERM / SIGINT set a flag that the training loop turns into checkpoint-and-exit; restored afterwards (the
    train command owns the process's signals: train() called as a library keeps the defaults)."""
    previous = {}
    if threading.current_thread() is threading.main_thread():  # only the main thread may install handlers
        previous = {sig: signal.signal(sig, _handle) for sig in SIGNALS}
    _received.clear()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _received.clear()


class StopSignal:
    """All ranks agree after every step whether any was signalled or ran past `run.time_limit_s`, so they stop
    (checkpoint, exit 75) after the same step: torchrun signals each worker separately. The sum runs on a CPU (gloo)
    group, never waiting for the accelerator's queue. The limit counts from set-up, like a scheduler's timeout."""

    def __init__(self, rt: Runtime, time_limit_s: float = 0.0):
        self.rt, self.time_limit_s = rt, time_limit_s
        self.deadline = time.monotonic() + time_limit_s if time_limit_s > 0 else None
        self.timed_out = False  # on any rank, as of the last should_stop()
        # A collective: every rank builds it, in the same order.
        self._group = dist.new_group(backend="gloo") if rt.distributed and dist.get_backend() != "gloo" else None

    @property
    def signame(self) -> str:
        if signalled():
            return signal.Signals(signalled()).name
        if self.timed_out:
            return f"the time limit (run.time_limit_s = {self.time_limit_s:g} s of wall time)"
        return "a signal to another rank"

    def should_stop(self) -> bool:
        """True on every rank when any rank was signalled or is past the deadline; a collective, every step."""
        late = self.deadline is not None and time.monotonic() >= self.deadline
        flags = torch.tensor([1 if signalled() else 0, 1 if late else 0], dtype=torch.int32)
        if self.rt.distributed:
            dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self._group)
        any_signalled, any_late = flags.tolist()  # a host tensor: no device sync
        self.timed_out = any_late > 0
        return any_signalled + any_late > 0


class FiniteGuard:
    """Notices a non-finite loss on any rank without a host sync per step: update() folds each loss into a device
    flag; check() reads it, summed over ranks, on logging steps and before every save, with the weights."""

    def __init__(self, rt: Runtime, start_step: int):
        self.rt, self.checked_step = rt, start_step
        self.bad = torch.zeros((), device=rt.device)

    def update(self, loss: torch.Tensor) -> None:
        self.bad += (~torch.isfinite(loss.detach().float())).float()

    def check(self, step: int, last_good: Optional[Path], model: Optional[torch.nn.Module] = None) -> None:
        """Raise TrainingError if any step in (checked_step, step] had a NaN/inf loss (or `model` a NaN/inf weight)."""
        if model is not None:
            for p in model.parameters():
                # A sharded (DTensor) parameter: each rank checks its own shard; the sum below covers them all.
                local = p.to_local() if hasattr(p, "to_local") else p
                self.bad += (~torch.isfinite(local.detach())).any().float()
        self.rt.all_reduce_sum(self.bad)
        if self.bad.item() > 0:
            first = min(self.checked_step + 1, step)  # == step when only the weights of this step are bad
            where = f"at step {step}" if first == step else f"between steps {first} and {step}"
            kept = (f"The newest good checkpoint, {last_good}, is untouched; re-running the same command resumes "
                    f"from it" if last_good else "No checkpoint was written before it")
            raise TrainingError(
                f"the loss or the weights became NaN/inf {where}: training diverged, so nothing was saved. {kept}. "
                f"Lower the learning rate (e.g. --train.lr=<smaller> --checkpoint.allow_changes=train.lr to keep "
                f"the checkpoint), or raise `train.warmup_steps`, or set `train.grad_clip`.")
        self.checked_step = step


# ---------------------------------------------------------------- test hooks
# NANOPT_TEST_HOOK=POINT:STEP[:RANK] makes a run fail at a precise place (tests/e2e/test_resume.py); never in real runs:
#   kill-in-step:K    SIGKILL itself in step K, after its optimizer update, before its bookkeeping and logs
#   kill-in-save:K    SIGKILL while writing checkpoint K (weights written, COMPLETE not yet)
#   kill-after-save:K SIGKILL after checkpoint K is renamed into place but before `latest` is updated
#   pause:K           after step K, wait (up to 300 s) for a signal; writes RUN_DIR/.test_paused.rankR
# Under torchrun --max-restarts the hook fires only in the first attempt (TORCHELASTIC_RESTART_COUNT=0).


def fault_hook(point: str, step: int, rank: int = 0, run_dir: Optional[Path] = None) -> None:
    parts = os.environ.get("NANOPT_TEST_HOOK", "").split(":")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0") or parts[:2] != [point, str(step)] \
            or parts[2:3] not in ([], [str(rank)]):
        return
    if point.startswith("kill"):
        print(f"nanopt: test hook {point}:{step}: SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "pause" and run_dir is not None:
        marker = write_text(run_dir / f".test_paused.rank{rank}", str(os.getpid()))  # atomic: never half a pid
        deadline = time.monotonic() + 300
        while signalled() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        marker.unlink(missing_ok=True)
