"""Stopping (nanopt/training/faults.py): the time limit is read on every step, and a second signal exits at once."""
from __future__ import annotations

import os
import signal

from nanopt.distributed import runtime
from nanopt.training import faults


def test_time_limit_is_read_on_every_step(monkeypatch):
    """The limit is checked against the clock at each step, not only at start-up; no limit never stops."""
    now = [100.0]
    monkeypatch.setattr(faults.time, "monotonic", lambda: now[0])
    rt = runtime.init("cpu", "fp32", 0)
    stop, unlimited = faults.StopSignal(rt, time_limit_s=60), faults.StopSignal(rt)
    now[0] = 159.9
    assert not stop.should_stop() and not stop.timed_out
    now[0] = 160.0
    assert stop.should_stop() and stop.timed_out and "time limit" in stop.signame
    now[0] = 1e9
    assert not unlimited.should_stop()


def test_second_signal_exits_at_once(monkeypatch):
    exits = []
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code))
    with faults.preemption_handlers():
        signal.raise_signal(signal.SIGTERM)
        assert faults.signalled() == signal.SIGTERM and exits == []  # first: just a flag, the step goes on
        signal.raise_signal(signal.SIGINT)
        assert exits == []  # within a second: the same request arriving twice (Ctrl-C + torchrun's SIGTERM)
        monkeypatch.setattr(faults, "_first_at", faults._first_at - 2 * faults.REPEAT_WINDOW_S)
        signal.raise_signal(signal.SIGTERM)
        assert exits == [128 + signal.SIGTERM]  # a real second signal: out now
    assert faults.signalled() is None
