"""The profiler around the training loop: nothing when off; when on, a torch.profiler schedule, per-rank traces where
TensorBoard's PyTorch Profiler plugin finds them, and a summary of where the time went (summarize). The loop enters
`profiler(...)`, labels its steps' parts (`label(DATA)`, ...) and calls `.step()` once per optimizer step."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from nanopt.config import Config, ConfigError, ProfileConfig
from nanopt.distributed.runtime import Runtime
from nanopt.io import write_text
from nanopt.lab import plots
from nanopt.rundirs import PROFILE_FILE, TB_DIR
from nanopt.training.metrics import MetricsLogger

log = logging.getLogger("nanopt")

SUMMARY_FILE = PROFILE_FILE
DATA = "nanopt/data"
FORWARD = "nanopt/forward"
BACKWARD = "nanopt/backward"
OPTIMIZER = "nanopt/optimizer"
COMPUTE_LABELS = (FORWARD, BACKWARD, OPTIMIZER)
TOP_OPS = 10

# kineto (torch 2.13) writes "USDT:<date> <time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start" (and
# _stop) to stderr at each trace start and stop, above its ERROR severity: no KINETO_LOG_LEVEL hides them alone.
KINETO_MARKER = re.compile(rb"USDT:[^\n]*\] profiler_(start|stop)\r?\n?")

# True only while a profile is running, so label() costs one global read when profiling is off.
_active = False
_OFF_LABEL = contextlib.nullcontext()


def label(name: str) -> contextlib.AbstractContextManager:
    """A named range in the trace (record_function) while profiling; a shared no-op otherwise."""
    return torch.profiler.record_function(name) if _active else _OFF_LABEL


class Off(contextlib.nullcontext):
    """The profiler when `profile.enabled` is off (or this rank is not profiled): does nothing at all."""

    def __init__(self) -> None:
        super().__init__(self)

    def step(self) -> None:
        pass


def fit_schedule(wait: int, warmup: int, active: int, steps: int) -> tuple[int, int, int]:
    """Shrink (wait, warmup, active) to fit a run of `steps` optimizer steps, keeping the proportions (rounded
    down) and, when there is room, one skipped first step (allocation, compilation) and one warmup step (the
    profiler's own start-up); `active` takes the rest."""
    if steps <= 0:
        return 0, 0, 0
    if wait + warmup + active <= steps:
        return wait, warmup, active
    scale = steps / (wait + warmup + active)
    new_wait = max(int(wait * scale), 1 if wait > 0 and steps >= 3 else 0)
    new_warmup = max(int(warmup * scale), 1 if warmup > 0 and steps >= 2 else 0)
    return new_wait, new_warmup, max(1, steps - new_wait - new_warmup)


@contextlib.contextmanager
def kineto_markers_dropped() -> Iterator[None]:
    """Run the block with stderr (fd 2, where kineto writes) spooled to a temporary file, then write back all it got
    but kineto's markers, in order, as the block ends. Where stderr cannot be duplicated the block just runs."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    sys.stderr.flush()
    with tempfile.TemporaryFile() as spool:
        os.dup2(spool.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            spool.seek(0)
            kept = [line for line in spool.read().splitlines(keepends=True) if not KINETO_MARKER.fullmatch(line)]
            if kept:
                os.write(2, b"".join(kept))


def worker_name(rank: int) -> str:
    """Trace files are <host>_<rank>.<timestamp>.pt.trace.json: the plugin reads node and process from this."""
    return f"{socket.gethostname()}_{rank}"


def profiler(cfg: Config, rt: Runtime, start_step: int = 0,
             metrics: Optional[MetricsLogger] = None) -> Union[Off, "Profile"]:
    """The profiler context for this rank: Off (a nullcontext) unless `profile.enabled` and this rank is listed."""
    p = cfg.profile
    if not p.enabled:
        return Off()
    if p.ranks is not None and max(p.ranks) >= rt.world_size:  # None: all
        raise ConfigError(f"`profile.ranks` is {p.ranks} but the run has {rt.world_size} rank(s) "
                          f"(0..{rt.world_size - 1}); list ranks that exist, or use all.")
    activities = rt.backend.profiler_activities
    if p.ranks is not None and rt.rank not in p.ranks:
        return Off()
    if activities is None:
        if rt.is_main:
            log.warning("profile.enabled is on, but this profiler path does not support %s devices; no trace is "
                        "written. On TPU use torch_xla.debug.profiler (start_server, then capture with TensorBoard's "
                        "profile plugin).", rt.kind)
        return Off()
    wait, warmup, active = fit_schedule(p.wait, p.warmup, p.active, cfg.train.max_steps - start_step)
    if active == 0:
        return Off()
    if (wait, warmup, active) != (p.wait, p.warmup, p.active) and rt.is_main:
        log.info("profile: the run has %d steps left; schedule shrunk from wait/warmup/active %d/%d/%d to %d/%d/%d",
                 cfg.train.max_steps - start_step, p.wait, p.warmup, p.active, wait, warmup, active)
    return Profile(p, rt, cfg.run_dir, start_step, (wait, warmup, active), activities, metrics)


class Profile:
    """torch.profiler.profile with a one-shot schedule; it stops itself once the schedule is done."""

    def __init__(self, p: ProfileConfig, rt: Runtime, run_dir: Path, start_step: int,
                 schedule: tuple[int, int, int], activities: list, metrics: Optional[MetricsLogger] = None) -> None:
        self.p, self.rt, self.run_dir, self.activities, self.metrics = p, rt, Path(run_dir), activities, metrics
        self.wait, self.warmup, self.active = schedule
        self.first_step = start_step + self.wait + self.warmup + 1  # optimizer steps are counted from 1
        # A run of TensorBoard's pytorch_profiler plugin under <run>/tb/.
        self.dir = self.run_dir / TB_DIR / "plugins" / "profile" / f"step_{self.first_step:06d}"
        self.steps_done, self._prof, self._snapshot = 0, None, False

    def __enter__(self) -> "Profile":
        global _active
        self._device_mode = any(a != ProfilerActivity.CPU for a in self.activities)
        self._prof = torch.profiler.profile(
            activities=self.activities, on_trace_ready=self._on_trace_ready,
            schedule=torch.profiler.schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            record_shapes=self.p.record_shapes, profile_memory=self.p.memory, with_stack=self.p.with_stack)
        with kineto_markers_dropped():
            self._prof.__enter__()
        _active = True
        if self.p.memory_snapshot:
            self._snapshot = self.rt.backend.start_memory_history()
            if not self._snapshot and self.rt.is_main:
                log.info("profile.memory_snapshot is on but needs a CUDA device (this run is on %s); skipped",
                         self.rt.kind)
        return self

    def step(self) -> None:
        """Once per optimizer step. After the last scheduled step the profiler is closed."""
        if self._prof is None:
            return
        self.steps_done += 1  # before .step(): the trace (and its summary) may be written inside it
        with kineto_markers_dropped():  # a step may start or stop the trace
            self._prof.step()
        if self.steps_done >= self.wait + self.warmup + self.active:
            self.__exit__(None, None, None)

    def __exit__(self, *exc: Any) -> None:
        """Close the profiler; a window cut short (the run ended early) is still written and summarised."""
        global _active
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        _active = False
        with kineto_markers_dropped():
            prof.__exit__(*exc)
        if self._snapshot:
            self._snapshot = False
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.dir / f"{worker_name(self.rt.rank)}.memory_snapshot.pickle"
            self.rt.backend.dump_memory_snapshot(str(path))
            log.info("profile: CUDA memory snapshot in %s (open it at pytorch.org/memory_viz)", path)

    def _on_trace_ready(self, prof: Any) -> None:
        before = set(self.dir.glob("*.pt.trace.json"))
        torch.profiler.tensorboard_trace_handler(str(self.dir), worker_name=worker_name(self.rt.rank))(prof)
        written = sorted(set(self.dir.glob("*.pt.trace.json")) - before)
        try:
            recorded = min(self.active, self.steps_done - self.wait - self.warmup)
            summary = summarize(prof, self._device_mode, recorded if recorded > 0 else None)
        except Exception as e:  # a summary bug must not end a training run; the trace is already saved
            log.warning("profile: trace written to %s, but the summary failed: %r", self.dir, e)
            return
        last = self.first_step + summary["profiled_steps"] - 1
        summary.update({
            "rank": self.rt.rank, "first_step": self.first_step, "last_step": last,
            "schedule": {"wait": self.wait, "warmup": self.warmup, "active": self.active},
            "peak_memory_bytes": self.rt.backend.peak_memory_bytes(),
            "trace_file": str(written[-1]) if written else None,
        })
        self._publish(summary, last)

    def _publish(self, summary: dict, step: int) -> None:
        name = SUMMARY_FILE if self.rt.is_main else f"profile_summary_rank{self.rt.rank}.json"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_text(self.run_dir / name, json.dumps(summary, indent=2) + "\n")  # replaces a link, never follows it
        if not self.rt.is_main:
            return
        plots.profile_page_quietly(summary, self.run_dir)  # profile.html: the summary, viewable offline
        for line in format_summary(summary).splitlines():
            log.info("%s", line)
        log.info("profile: summary in %s; trace in %s: `tensorboard --logdir %s` (PYTORCH_PROFILER tab) "
                 "or ui.perfetto.dev", self.run_dir / name, self.dir, self.run_dir)
        writer = getattr(self.metrics, "writer", None)
        if writer is not None:
            for key in ("host_overhead_share", "data_loader_share", "compute_share", "step_ms_mean",
                        "peak_memory_bytes"):
                if summary[key] is not None:  # peak memory: None where the device cannot tell
                    writer.add_scalar(f"profile/{key}", summary[key], step)
            writer.add_text("profile/summary", summary_markdown(summary), step)
            writer.flush()


Interval = tuple[float, float]


def _merge(intervals: list[Interval]) -> list[Interval]:
    """Sorted, non-overlapping union of [start, end) intervals."""
    out: list[Interval] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two merged interval lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: list[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def summarize(prof: Any, device_mode: bool, steps_recorded: Optional[int] = None) -> dict[str, Any]:
    """Where the profiled steps' time went, from the profiler's events (times in ms). Each step (ProfilerStep#)
    splits into compute (CPU: inside the forward/backward/optimizer labels; GPU: the device is running work),
    data loader (inside the data label, not overlapping compute) and host overhead (the rest).

    `steps_recorded` keeps only the first that many steps: when the profiler is stopped mid-window, the last
    ProfilerStep range holds whatever ran after the final .step() (evaluation, saving), not a step."""
    events = prof.events()
    spans: dict[str, list[Interval]] = {name: [] for name in ("step", "device", DATA, *COMPUTE_LABELS)}
    for e in events:
        span = (e.time_range.start, e.time_range.end)  # microseconds
        if e.device_type != DeviceType.CPU:
            if not e.is_user_annotation:  # kernels, copies, memsets; not the device echo of our labels
                spans["device"].append(span)
        elif e.name.startswith("ProfilerStep"):
            spans["step"].append(span)
        elif e.name in (DATA, *COMPUTE_LABELS):
            spans[e.name].append(span)
    step_spans = sorted(spans.pop("step"))[:steps_recorded]
    steps = _merge(step_spans)
    total_us = _length(steps)
    if total_us <= 0:
        raise ValueError("no ProfilerStep ranges in the profile (was .step() called during the active window?)")
    in_steps = {name: _intersect(_merge(s), steps) for name, s in spans.items()}  # merged, as both sides are
    busy = in_steps["device"] if device_mode else _merge([i for name in COMPUTE_LABELS for i in in_steps[name]])
    busy_us = _length(busy)
    data_us = _length(in_steps[DATA]) - _length(_intersect(in_steps[DATA], busy))
    overhead_us = max(0.0, total_us - busy_us - data_us)

    return {
        "mode": "device-busy" if device_mode else "cpu-labels",
        "profiled_steps": len(step_spans),
        "step_ms_total": total_us / 1e3,
        "step_ms_mean": total_us / 1e3 / len(step_spans),
        "host_overhead_share": overhead_us / total_us,
        "data_loader_share": data_us / total_us,
        "compute_share": busy_us / total_us,
        # Host time inside each label, for orientation (on GPU these are launch times, not device time).
        "label_ms": {key: _length(in_steps[name]) / 1e3 for key, name in (
            ("data_loader", DATA), ("forward", FORWARD), ("backward", BACKWARD), ("optimizer", OPTIMIZER))},
        "top_ops": top_ops(events, device_mode, total_us),
    }


# CUDA runtime rows, not operators: CUPTI's "Command Buffer Full" (the host waited for room in the launch queue) is
# credited with the device time of the kernels launched meanwhile, which their operators already count, so keeping
# it counts that time twice (a 1B profile's top ops added up to 128%).
NOT_OPERATORS = ("Command Buffer Full",)


def top_ops(events: Any, device_mode: bool, total_us: float) -> list[dict[str, Any]]:
    """The TOP_OPS torch operators (not our labels, runtime rows or with_stack's Python frames) with the most self
    time on the device (GPU) or on the host (CPU)."""
    ops: dict[str, list] = {}  # name -> [self us, calls, self CPU us]
    for e in events:
        # is_python_function is newer than some supported torch (2.11 lacks it): absent means not one.
        if e.device_type != DeviceType.CPU or e.is_user_annotation or getattr(e, "is_python_function", False) \
                or e.key in NOT_OPERATORS:
            continue
        row = ops.setdefault(e.key, [0.0, 0, 0.0])
        row[0] += e.self_device_time_total if device_mode else e.self_cpu_time_total
        row[1] += 1
        row[2] += e.self_cpu_time_total
    top = sorted(((name, *row) for name, row in ops.items() if row[0] > 0), key=lambda r: r[1], reverse=True)
    return [{"name": name, "calls": calls, "self_ms": self_us / 1e3, "self_share": self_us / total_us,
             "self_cpu_ms": cpu_us / 1e3} for name, self_us, calls, cpu_us in top[:TOP_OPS]]


def format_summary(s: dict) -> str:
    """The console block printed on rank 0."""
    ops = ", ".join(f"{op['name']} {op['self_ms']:.1f} ms ({100 * op['self_share']:.0f}%)" for op in s["top_ops"][:5])
    return (f"profile: steps {s['first_step']}-{s['last_step']} ({s['profiled_steps']} steps, "
            f"{s['step_ms_mean']:.1f} ms/step) | host overhead {100 * s['host_overhead_share']:.1f}% | data loader "
            f"{100 * s['data_loader_share']:.1f}% | compute {100 * s['compute_share']:.1f}% ({s['mode']}) | peak "
            f"memory {plots.mib(s['peak_memory_bytes'])}\nprofile: top ops by self time: {ops}")


def summary_markdown(s: dict) -> str:
    """The TensorBoard text panel: the shares and the top-ops table."""
    rows = "\n".join(f"| {op['name']} | {op['calls']} | {op['self_ms']:.2f} | {100 * op['self_share']:.1f}% |"
                     for op in s["top_ops"])
    return (f"**Steps {s['first_step']}-{s['last_step']}** ({s['mode']}): {s['step_ms_mean']:.1f} ms/step, host "
            f"overhead **{100 * s['host_overhead_share']:.1f}%**, data loader {100 * s['data_loader_share']:.1f}%, "
            f"compute {100 * s['compute_share']:.1f}%, peak memory {plots.mib(s['peak_memory_bytes'])}\n\n"
            f"| op | calls | self ms | share of step time |\n| --- | --- | --- | --- |\n{rows}\n")
