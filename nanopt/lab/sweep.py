"""`nanopt sweep`: a grid of ordinary runs (every --set value × seeds), each its own process, at most one per
device slot; run again, it skips finished runs and resumes interrupted ones. Torch-free, so the driver costs the
runs nothing; Modal's launcher reuses plan() and point_states().

One writer per sweep directory: run_sweep holds DIR/lock.json for its life. Each run has its own session, so a
terminal's Ctrl-C reaches only the sweep, which passes one SIGTERM to each run (a second signal means "exit now,
without a checkpoint"). DIR/sweep.json, rewritten on every change, holds the meta and each point's Job.record().
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Optional

from tqdm import tqdm

from nanopt import lock, rundirs, schema
from nanopt.config import Config, comma_list, load_config, parse_overrides, resolve, resume_changes
from nanopt.errors import EXIT_PREEMPTED, ConfigError
from nanopt.io import open_append, refuse_link, write_json
from nanopt.lab.runs import cell, table

SWEEP_FILE = "sweep.json"
LOG_FILE = "stdout.log"  # each run's stdout and stderr, appended across sessions
# Keys the sweep sets itself for every point: where the run lives, what it is called, its seed.
RESERVED = ("run.dir", "run.name", "run.seed")


# ---------------------------------------------------------------- the grid
@dataclass(frozen=True)
class Point:
    """One run of the grid: its directory name, its --set values (as written) and its seed."""
    name: str
    values: dict[str, str]
    seed: int

    def overrides(self) -> list[str]:
        return [f"--{k}={v}" for k, v in self.values.items()] + [f"--run.seed={self.seed}"]


def normal_key(key: str) -> str:
    """` run.seed ` -> `run.seed`. A quoted flag keeps the spaces around its key; every check below (reserved
    keys, clashes) must compare the key the config will apply, or `--set "run.seed =1,2"` slips past them."""
    return ".".join(part.strip() for part in key.split("."))


def normal_overrides(overrides: list[str]) -> list[str]:
    """`--run.seed 5`, `--run.seed =5` -> `--run.seed=5`: one spelling for plan()'s checks and every run; values
    stay as written."""
    return [f"--{normal_key(key)}={value}" for key, value in parse_overrides(overrides)]


def parse_set(text: str) -> tuple[str, list[str]]:
    raw_key, sep, values = text.partition("=")
    key = normal_key(raw_key)
    items = [v.strip() for v in values.split(",")]
    if not sep or key.count(".") != 1 or not all(items):
        raise ConfigError(f"--set {text!r}: write `--set section.key=V1,V2,...`, e.g. `--set optim.name=adamw,muon` "
                          f"or `--set train.lr=1e-3,3e-3`: one config key, then its values separated by commas (no "
                          f"empty value).")
    if key in RESERVED:
        raise ConfigError(f"--set {text!r}: the sweep sets `{key}` itself for every run. Use --seeds N for seeds (they "
                          f"count up from the config's run.seed, or from --run.seed=S), and --name / --dir for where "
                          f"the runs go.")
    if len(set(items)) != len(items):
        raise ConfigError(f"--set {text!r}: a value is repeated; list each value of `{key}` once.")
    return key, items


def point_name(values: dict[str, str]) -> str:
    """`train.lr=1e-3,optim.name=muon` (a seed is added): one directory level; each value keeps only the characters
    a shell and a file system both take as they are."""
    return ",".join(f"{k}={re.sub(r'[^A-Za-z0-9._+-]', '_', v) or '_'}" for k, v in values.items())


def _seeded(settings: list[tuple[str, dict[str, str]]], seeds: list[int], clash: Callable[[str], str]) -> list[Point]:
    """Each (name, values) once per seed. Seeds vary slowest, so the first K runs launched cover different
    settings: a sweep stopped early has compared every setting once. `clash`: the refusal of a repeated name."""
    points = [Point(",".join(filter(None, (name, f"seed={seed}"))), values, seed)
              for seed in seeds for name, values in settings]
    names = [p.name for p in points]
    if too_long := next((n for n in names if len(n.encode()) > 255), None):  # the file system's limit for a name
        raise ConfigError(f"grid point {too_long[:60]}... makes a directory name over 255 bytes; sweep fewer keys "
                          f"at once or use shorter values.")
    if len(set(names)) != len(names):
        raise ConfigError(clash(", ".join(sorted({n for n in names if names.count(n) > 1}))))
    return points


def grid(sets: list[tuple[str, list[str]]], seeds: list[int]) -> list[Point]:
    """The cartesian product of every --set, once per seed."""
    keys = [k for k, _ in sets]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"--set names a key twice ({', '.join(keys)}); give each key once with all its values.")
    combos = [dict(zip(keys, combo)) for combo in itertools.product(*(vals for _, vals in sets))]
    return _seeded([(point_name(c), c) for c in combos], seeds, lambda names: (
        f"two grid points get the same directory name once their values are made filesystem-safe ({names}); use "
        f"values that differ in letters, digits or '._+-'."))


# A list of points, each its own setting (`nanopt scaling plan` writes a ladder as one): not a product of --set values.
POINTS = schema.Field(dict, fields={"points": schema.Field(list, required=True, items=schema.Field(dict, fields={
    "name": schema.Field(str, required=True, test=lambda s: re.fullmatch(r"[A-Za-z0-9._+=,-]{1,200}", s) is not None,
                         what="a directory name (letters, digits and ._+=,-)"),
    "set": schema.Field(dict, required=True, items=schema.Field(
        object, test=lambda v: isinstance(v, (str, int, float, bool)), what="a number, string or true/false"))}))})


def listed(path: Path, seeds: list[int]) -> list[Point]:
    """The points a --points file lists, once per seed (seeds vary slowest, as in grid())."""
    fix = "Write it as `nanopt scaling plan` does: `points: [{name: NAME, set: {KEY: VALUE, ...}}, ...]`."
    data = schema.read(path, POINTS, fix)
    if data is None or not data["points"]:
        raise ConfigError(f"--points {path}: {'no such file' if data is None else 'the list is empty'}. {fix}")
    show = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # YAML's true is the CLI's true
    return _seeded([(p["name"], {normal_key(k): show(v) for k, v in p["set"].items()}) for p in data["points"]],
                   seeds, lambda names: f"--points {path}: two points share a name ({names}); give each its own. {fix}")


def plan(config: Optional[str], set_args: list[str], seeds: int, overrides: list[str],
         nproc: int = 1, points_file: Optional[Path] = None) -> tuple[list[Point], dict[str, Config]]:
    """The points and each one's config by name, all checked before anything starts (a typo found after ten runs
    is ten runs late)."""
    if seeds < 1:
        raise ConfigError(f"--seeds {seeds}: give the number of seeds per setting, 1 or more.")
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: the number of processes (GPUs) per run; give 1 or more.")
    base = [(normal_key(k), v) for k, v in parse_overrides(overrides)]
    if key := next((k for k, _ in base if k in ("run.dir", "run.name")), None):
        raise ConfigError(f"--{key}: the sweep names and places every run itself; use --name NAME or --dir DIR.")
    sets = [parse_set(s) for s in set_args]
    if clash := {k for k, _ in base} & {k for k, _ in sets}:
        raise ConfigError(f"{', '.join(sorted(clash))} is both an override and a --set key; keep it in --set only.")
    base_seed = load_config(config, base).run.seed  # range-checked there; each point's seed below, per point
    if points_file is not None and sets:
        raise ConfigError("--points and --set both say which runs to make; give one (a listed point's own keys go "
                          "in its `set`).")
    seed_list = [base_seed + i for i in range(seeds)]
    points = listed(points_file, seed_list) if points_file is not None else grid(sets, seed_list)
    configs = {}
    for p in points:
        try:
            # resolve() with the runs' world size: a batch that does not split over --nproc ranks fails here.
            configs[p.name] = resolve(load_config(config, base + parse_overrides(p.overrides())), nproc)
        except ConfigError as e:
            raise ConfigError(f"grid point {p.name}: {e}") from None
        if not configs[p.name].checkpoint.resume:
            raise ConfigError(f"grid point {p.name}: checkpoint.resume is false (in {config or 'the defaults'} or an "
                              f"override), but a sweep resumes the runs it interrupted, and it writes each run's "
                              f"{LOG_FILE} into the run directory before the run starts, which a run that may not "
                              f"resume refuses. Drop it: a sweep under a new --name starts fresh.")
    return points, configs


# ---------------------------------------------------------------- placement
@dataclass(frozen=True)
class Slot:
    """Where one run goes: environment for its process and overrides for its config."""
    label: str
    env: dict[str, str] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()


def place(kind: str, devices: list[str], cores: int, nproc: int = 1, parallel: Optional[int] = None,
          runs: Optional[int] = None, threads: int = 0) -> list[Slot]:
    """Device slots for concurrent runs, never more than `runs`. CUDA: `nproc` GPUs per slot, at most `parallel`.
    CPU: `parallel` runs share the cores, each with cores // (parallel × nproc) threads per rank, or the user's
    runtime.threads (`threads`). XLA: one process drives every chip, so one run at a time."""
    if kind == "cuda":
        groups = [devices[i:i + nproc] for i in range(0, len(devices) - nproc + 1, nproc)]
        if not groups:
            raise ConfigError(f"--nproc {nproc}: each run wants {nproc} GPUs and {len(devices)} are visible; "
                              f"lower --nproc or make more GPUs visible (CUDA_VISIBLE_DEVICES).")
        if parallel is not None and parallel > len(groups):
            raise ConfigError(f"--parallel {parallel}: {len(devices)} GPUs hold {len(groups)} runs of {nproc} GPU(s) "
                              f"at a time; use --parallel {len(groups)} or fewer (one run per GPU never shares one).")
        k = min(parallel or len(groups), runs or len(groups))
        return [Slot(f"cuda:{','.join(g)}", {"CUDA_VISIBLE_DEVICES": ",".join(g)}) for g in groups[:k]]
    if kind == "xla":
        return [Slot("xla")] * min(parallel or 1, runs or 1)
    # One run per core: 2 concurrent 1-thread runs did more tiny runs per hour on 2 cores than 1 run with 2 threads
    # (docs/results.md "Sweeps"): small models' ops parallelise badly within a process, independent runs perfectly.
    k = min(parallel or cores, runs or sys.maxsize)
    n = threads or max(1, cores // (k * nproc))
    # Spinning idle OpenMP threads (train's default ACTIVE) steal the cores of the runs beside them: 1.4-10x
    # slower steps (docs/mfu.md). One thread per run never spins, so PASSIVE costs it nothing.
    env = {"OMP_NUM_THREADS": str(n), **({"OMP_WAIT_POLICY": "PASSIVE"} if k > 1 else {})}
    label = f"cpu: {n} thread{'s' if n > 1 else ''}" + (f" x {nproc} ranks" if nproc > 1 else "")
    return [Slot(label, env, (f"--runtime.threads={n}",))] * k


def discover(device: str) -> tuple[str, list[str]]:
    """The device kind the runs will get and, for CUDA, the ids to hand out. Asks torch in a child process,
    through runtime.detect_kind as the runs themselves will, so this process stays torch-free."""
    if device in ("cpu", "xla"):
        return device, []
    probe = ("import torch; from nanopt.distributed import runtime; "
             "print(torch.cuda.device_count() if runtime.detect_kind('auto') == 'cuda' else 0)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    count = int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0
    if count == 0:
        if device == "cuda":
            raise ConfigError("`runtime.device` is cuda but torch sees no CUDA device; use --runtime.device=cpu "
                              "or install a CUDA build of torch.")
        return "cpu", []
    return "cuda", visible_ids(count, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible_ids(count: int, visible: Optional[str]) -> list[str]:
    """Each run's CUDA_VISIBLE_DEVICES for torch's devices 0..count-1: under CUDA_VISIBLE_DEVICES=3,5 torch's
    device 0 is GPU 3, so a run must be given "3", not "0"."""
    return (comma_list(visible) or [str(i) for i in range(count)])[:count]


# ---------------------------------------------------------------- run directories
def sweep_dir(given: Optional[str | Path], default: str, flag: str) -> Path:
    """`given` (--dir, --out), else runs/<default>; never inside a run's checkpoints, which that run prunes."""
    root = Path(given or f"runs/{default}")
    rundirs.refuse_inside_checkpoints(root, flag)
    return root


def point_state(run_dir: Path, cfg: Config) -> str:
    """done (rundirs.finished), resume (a checkpoint) or new; whose config it ran: point_states."""
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise ConfigError(f"{run_dir} is a file, where the sweep keeps this point's run directory.")
    if rundirs.finished(run_dir, cfg.train.max_steps, cfg.train.stop_at_target) is not None:
        return "done"
    # The pointer, not a verified checkpoint: verifying reads every byte (GBs), and the run verifies it anyway.
    return "resume" if (Path(run_dir) / rundirs.CHECKPOINTS_DIR / rundirs.LATEST_FILE).exists() else "new"


def point_states(points: list[tuple[str, Path, Config]], where: Path) -> dict[str, str]:
    """Each point's state by name, from (name, run directory, config). Refuses when a directory ran another config
    (config.resume_changes' keys): skipping it would report another config's result under this sweep's name."""
    states: dict[str, str] = {}
    changed: dict[str, list[str]] = {}
    for name, run_dir, cfg in points:
        try:
            state = point_state(run_dir, cfg)
            saved = rundirs.read_config(run_dir)
            diff = [] if saved is None else resume_changes(saved, cfg, state == "done")  # lines "key: ..."
        except ConfigError as e:
            why = " ".join(str(e).split())  # one paragraph: a YAML error's own text spans lines
            raise ConfigError(f"grid point {name}: {why} The sweep cannot tell what this point ran or whether it is "
                              f"done: restore the file, or remove {run_dir} to run the point afresh.") from None
        if diff:  # each changed key as "key: old -> new"
            before, now = rundirs.flatten(saved), rundirs.flatten(cfg.to_dict())
            changed[name] = [f"{k}: {rundirs.format_value(before[k])} -> {rundirs.format_value(now[k])}"
                             for k in (line.split(":", 1)[0] for line in diff)]
        else:
            states[name] = state
    if not changed:
        return states
    which = "; ".join(f"{name} ({', '.join(diff)})" for name, diff in changed.items())
    earlier = Path(where) / SWEEP_FILE
    hint = f" (the earlier command is in {earlier})" if earlier.is_file() else ""
    raise ConfigError(f"{len(changed)} point(s) of this sweep already have a run directory under {where} that ran "
                      f"another config, so skipping or resuming them would record another config's runs as this "
                      f"sweep's: {which}. Run the sweep with the same config file and overrides as before{hint}, give "
                      f"this one a new --name or --dir to run these points afresh, or accept the change with "
                      f"--checkpoint.allow_changes=KEY[,KEY...].")


def summary_or_empty(run_dir: Path) -> dict[str, Any]:
    with contextlib.suppress(ConfigError):
        return rundirs.read_summary(run_dir) or {}
    return {}


# ---------------------------------------------------------------- running
@dataclass
class Job:
    point: Point
    dir: Path
    cfg: Config
    status: str = "queued"
    proc: Optional[subprocess.Popen] = None
    slot: Optional[int] = None
    command: list[str] = field(default_factory=list)
    exit_code: Optional[int] = None
    started: float = 0.0
    wall: Optional[float] = None
    resumed: bool = False  # it had a checkpoint when this session started it
    log: Optional[IO[bytes]] = None

    def record(self) -> dict[str, Any]:
        summary = summary_or_empty(self.dir) if self.status in ("done", "skipped") else {}
        return {"name": self.point.name, "dir": str(self.dir), "values": self.point.values, "seed": self.point.seed,
                "status": self.status, "exit_code": self.exit_code, "steps": summary.get("steps"),
                "final_val_loss": summary.get("final_val_loss"), "wall_seconds": self.wall,
                "command": self.command}


def _die_with_parent() -> None:
    """In the child: SIGTERM (checkpoint, exit 75) when the sweep dies: no orphan clashes with the next sweep."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def launch_command(config: Optional[str], job: Job, overrides: list[str], nproc: int, slot: Slot) -> list[str]:
    """`python -m nanopt.main CONFIG ...`, or torchrun (--standalone: each run its own rendezvous)."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    return [sys.executable, *torchrun, "-m", "nanopt.main", *([config] if config else []), *overrides,
            *job.point.overrides(), f"--run.dir={job.dir}", f"--run.name={job.point.name}", *slot.overrides]


class Progress:
    """A line per change of a run's state and, on a terminal only, tqdm bars below: the runs finished (how many
    run and failed in its description), then one per slot, its run's steps with loss and val loss."""

    def __init__(self, jobs: list[Job], out: IO[str], slots: int):
        self.jobs, self.out = jobs, out
        self.width = max(len(j.point.name) for j in jobs)
        bar = functools.partial(tqdm, file=out, dynamic_ncols=True, disable=not out.isatty())
        self.bar = bar(total=sum(j.status == "queued" for j in jobs), unit="run")
        self.rows = [bar(total=0, position=i + 1, leave=False, bar_format="{desc}: {bar} {n_fmt}/{total_fmt}{postfix}")
                     for i in range(slots)]

    def line(self, job: Job, slots: list[Slot]) -> str:
        text = f"{job.point.name:<{self.width}}  {job.status:<11}"
        if job.status == "running":
            text += f"  [{slots[job.slot].label}]" if job.slot is not None else ""
            text += "  resumed" if job.resumed else ""
        elif job.status in ("done", "skipped"):
            val = summary_or_empty(job.dir).get("final_val_loss")
            text += f"  val {val:.4f}" if val is not None else ""
        elif job.status in ("failed", "interrupted"):
            text += f"  exit {job.exit_code}, log {job.dir / LOG_FILE}"
        return text

    def note(self, text: str) -> None:
        tqdm.write(text, file=self.out)  # above the bars, which are drawn again below it
        self.out.flush()

    def redraw(self) -> None:
        if self.bar.disable:
            return
        self.bar.n = sum(j.status in ("done", "failed", "interrupted") for j in self.jobs)
        running = {j.slot: j for j in self.jobs if j.status == "running"}
        failed = sum(j.status == "failed" for j in self.jobs)
        self.bar.set_description_str(f"{len(running)} running, {failed} failed")
        for slot, row in enumerate(self.rows):
            job = running.get(slot)
            m = rundirs.latest_figures(job.dir) if job is not None else {}
            row.total, row.n = (job.cfg.train.max_steps if job else 0), m.get("step") or 0
            row.set_description_str(job.point.name if job else "idle", refresh=False)
            row.set_postfix_str("  ".join(f"{k.replace('_', ' ')} {m[k]:.4f}" for k in ("loss", "val_loss") if k in m))

    def close(self) -> None:
        for bar in (*self.rows, self.bar):
            bar.close()


def run_sweep(config: Optional[str], root: Path, points: list[Point], configs: dict[str, Config],
              overrides: list[str], nproc: int = 1, parallel: Optional[int] = None,
              meta: Optional[dict[str, Any]] = None, out: Optional[IO[str]] = None, poll_s: float = 0.5) -> int:
    """Run every point not yet done, one per slot at a time: 0 all done, 1 any failed, 75 stopped by a signal.
    `out`: sys.stdout at the call, not at import (a caller may have replaced and closed that one since)."""
    out = out or sys.stdout
    with lock.DirLock(root, what="sweep"):
        jobs, slots = _jobs(root, points, configs, overrides, nproc, parallel)
        pending = [j for j in jobs if j.status == "queued"]
        meta = {**(meta or {}), "nproc": nproc, "parallel": len(slots) or parallel}

        def save(changed: Optional[Job] = None) -> None:
            if changed is not None:  # a line for its new state
                progress.note(progress.line(changed, slots))
            write_json(root / SWEEP_FILE, {**meta, "points": [j.record() for j in jobs]})

        # Signals received; the loop acts on them (a handler could miss a run being started). `acted`: how many.
        stop: list[int] = []
        acted = 0
        previous = {s: signal.signal(s, lambda signum, frame: stop.append(signum))
                    for s in (signal.SIGTERM, signal.SIGINT)}
        print(f"sweep {root}: {len(jobs)} runs, {len(jobs) - len(pending)} already done, {len(pending)} to run"
              + (f", {len(slots)} at a time ({slots[0].label})" if slots else ""), file=out, flush=True)
        progress = Progress(jobs, out, len(slots))
        save()
        try:
            while True:
                if len(stop) > acted:  # no run starts after the first, so each running run is sent one SIGTERM
                    _stop_runs(jobs, progress, repeated=acted > 0)
                    acted = len(stop)
                while pending and not stop and (free := sorted(
                        set(range(len(slots))) - {j.slot for j in jobs if j.status == "running"})):
                    job, job.slot = pending.pop(0), free[0]
                    _start(job, config, overrides, nproc, slots[job.slot])
                    save(job)
                running = [j for j in jobs if j.status == "running"]
                if not running and (not pending or stop):
                    break
                for j in running:
                    if j.proc is not None and j.proc.poll() is not None:
                        _ended(j)
                        save(j)
                progress.redraw()
                time.sleep(poll_s)
        finally:
            progress.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
        for j in pending:
            j.status = "not started"
        save()
        return _report(jobs, root, out, stopped=bool(stop))


def _jobs(root: Path, points: list[Point], configs: dict[str, Config], overrides: list[str], nproc: int,
          parallel: Optional[int]) -> tuple[list[Job], list[Slot]]:
    states = point_states([(p.name, root / p.name, configs[p.name]) for p in points], root)
    jobs = [Job(p, root / p.name, configs[p.name], "skipped" if states[p.name] == "done" else "queued",
                resumed=states[p.name] == "resume") for p in points]
    pending = [j for j in jobs if j.status == "queued"]
    for j in pending:  # each run's log is appended to: never a file elsewhere through a link (refused up front)
        refuse_link(j.dir / LOG_FILE)
    if not pending:  # discovery starts torch in a child (seconds): not worth it when everything is done
        return jobs, []
    kind, devices = discover(pending[0].cfg.runtime.device)
    # The user's runtime.threads, as the config parsed it (an override, so the config file's stays the sweep's).
    user_threads = pending[0].cfg.runtime.threads if any(
        k == "runtime.threads" for k, _ in parse_overrides(overrides)) else 0
    # The cores this process may run on (taskset/cgroup affinity; not on macOS), not the machine's count.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return jobs, place(kind, devices, cores, nproc, parallel, len(pending), user_threads)


def _report(jobs: list[Job], root: Path, out: IO[str], stopped: bool) -> int:
    """The final table (training seconds from summary.json, wall seconds of this session) and each failed run's
    log tail; the sweep's exit status."""
    rows = [(j.point.name, f"{j.status} (exit {j.exit_code})" if j.status in ("failed", "interrupted") else j.status,
             cell(s.get("steps"), ""), cell(s.get("final_val_loss"), ".4f"), cell(s.get("train_seconds"), ".1f"),
             cell(j.wall, ".1f")) for j in jobs for s in [summary_or_empty(j.dir)]]  # figures: numbers or None
    print("\n" + table(("point", "status", "steps", "final val loss", "train (s)", "wall (s)"), rows), file=out)
    for j in jobs:
        if j.status == "failed":
            print(f"\n{j.point.name} failed with exit {j.exit_code}; last lines of {j.dir / LOG_FILE}:", file=out)
            print("\n".join("  " + line for line in rundirs.tail_lines(j.dir / LOG_FILE, 16384)[-10:]), file=out)
    print(f"\n{root / SWEEP_FILE} describes the sweep; `nanopt runs {root}` compares the runs.", file=out, flush=True)
    return 1 if any(j.status == "failed" for j in jobs) else EXIT_PREEMPTED if stopped or any(
        j.status in ("interrupted", "not started") for j in jobs) else 0


def _stop_runs(jobs: list[Job], progress: Progress, repeated: bool) -> None:
    """On SIGINT/SIGTERM: launch nothing more and send each running run one SIGTERM, its cue to checkpoint and
    exit 75. Never a second, also not on a repeated Ctrl-C: a run takes that as "exit now", without a checkpoint."""
    running = [j for j in jobs if j.proc is not None and j.proc.poll() is None]
    for j in [] if repeated else running:
        j.proc.send_signal(signal.SIGTERM)
    progress.note(f"nanopt sweep: already stopping; waiting for {len(running)} run(s) to save a checkpoint and exit "
                  f"(each was sent one SIGTERM; `kill -9 {os.getpid()}` abandons them)." if repeated else
                  f"nanopt sweep: stopping: no new runs; {len(running)} running run(s) sent SIGTERM to save a "
                  f"checkpoint and exit. Run the same command again to go on.")


def _start(job: Job, config: Optional[str], overrides: list[str], nproc: int, slot: Slot) -> None:
    job.dir.mkdir(parents=True, exist_ok=True)
    job.command = launch_command(config, job, overrides, nproc, slot)
    # The user's explicit OMP_WAIT_POLICY wins over the sweep's default.
    env = {**os.environ, **{k: v for k, v in slot.env.items() if k != "OMP_WAIT_POLICY" or k not in os.environ}}
    job.log = open(open_append(job.dir / LOG_FILE), "ab", buffering=0)  # unbuffered: the run writes here too
    job.log.write(f"\n=== nanopt sweep {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(job.command)}\n".encode())
    job.started, job.status = time.monotonic(), "running"
    try:
        # Its own session: the terminal's Ctrl-C goes to the sweep's process group only, and the sweep sends
        # the run its one SIGTERM (_stop_runs). In the same group the run would get both: two signals.
        job.proc = subprocess.Popen(job.command, stdout=job.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, preexec_fn=_die_with_parent)
    except OSError as e:  # the launcher itself is missing: this run fails, the others may still go
        job.log.write(f"nanopt sweep: cannot start the run: {e}\n".encode())
        job.log.close()
        job.status, job.exit_code, job.wall = "failed", 127, 0.0


def _ended(job: Job) -> None:
    """Its process ended: done (exit 0 and rundirs.finished), interrupted or failed (a damaged summary.json too,
    the reason at the end of its log, where the report looks)."""
    assert job.proc is not None and job.log is not None
    job.exit_code, job.wall = job.proc.returncode, time.monotonic() - job.started
    try:
        done = job.exit_code == 0 and rundirs.finished(job.dir, job.cfg.train.max_steps,
                                                        job.cfg.train.stop_at_target) is not None
    except ConfigError as e:
        job.log.write(f"nanopt sweep: the run exited 0 but {e}\n".encode())
        done = False
    job.log.close()
    job.status = "done" if done else (
        "interrupted" if job.exit_code in (EXIT_PREEMPTED, -signal.SIGTERM, -signal.SIGINT) else "failed")
