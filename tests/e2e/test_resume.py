"""Exact resume: a run killed, preempted or crashed anywhere ends bitwise identical to one that never stopped; a
rerun never restarts silently and a finished run stays finished; a muon run keeping averaged weights resumes exactly.

Runs are CPU, fp32, the SMALL model. Crashes are real processes killed with SIGKILL at precise points through the
NANOPT_TEST_HOOK test hook (nanopt/training/faults.py); resumes run in-process through nanopt.main.run, and every
result is compared byte for byte with an uninterrupted reference run (module-scoped, shared by the tests).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import fsspec
import pytest
import torch
from conftest import MUON_ARG, REPO, small_overrides, torchrun_started
from safetensors.torch import load_file

from nanopt import errors, rundirs
from nanopt.main import run
from nanopt.training import checkpoint, profiling

STEPS = 8
ARGS = small_overrides(**{
    "train.precision": "fp32", "train.max_steps": STEPS, "checkpoint.every": 2, "log.tensorboard": "false",
})
# A muon run that keeps averaged weights: the average starts at step 3, so the kill at step 5 resumes from step 4's
# checkpoint, whose ema.safetensors carries it; the evaluations (every 2 steps) are of the average.
MUON_EMA = (MUON_ARG, "--train.ema_decay=0.9", "--train.ema_start=3", "--eval.weights=ema", "--eval.every=2")
MEMORY_MIRROR = "memory://nanopt-test-muon-ema"  # the muon reference's mirror (fsspec's memory is per process)
# The runs killed through a hook, by name: (hook, extra arguments).
KILLED = {"kill-in-save:4": ("kill-in-save:4", ()), "kill-after-save:6": ("kill-after-save:6", ()),
          "muon-ema": ("kill-in-step:5", MUON_EMA)}


def step_dir(run_dir: Path, step: int = STEPS) -> Path:
    return run_dir / rundirs.CHECKPOINTS_DIR / f"step_{step:06d}"


def complete_checkpoints(run_dir: Path) -> list[str]:
    """The names of the checkpoints that verify, oldest first."""
    return [c.name for c in checkpoint.checkpoint_dirs(run_dir) if checkpoint.verify_checkpoint(c) is None]


def final_weights(run_dir: Path, step: int = STEPS) -> bytes:
    return (step_dir(run_dir, step) / rundirs.MODEL_FILE).read_bytes()


def resumable_state(ckpt: Path) -> dict[str, Any]:
    """Everything a checkpoint's dcp/ holds (weights, optimizer state by parameter name, average), read whole."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(ckpt / rundirs.DCP_DIR, Path(tmp) / "state.pt")
        return torch.load(Path(tmp) / "state.pt", weights_only=False)


def logged(run_dir: Path, key: str = "loss") -> list[tuple]:
    """(step, value) of every record with `key` (a resumed run's log must read like the uninterrupted one); for
    val_loss also which weights were evaluated."""
    records = rundirs.read_metrics(run_dir)
    return [(r["step"], r[key], *([r["weights"]] if key == "val_loss" else [])) for r in records if key in r]


def train_here(run_dir: Path, *extra: str) -> int:
    return run([*ARGS, f"--run.dir={run_dir}", *extra])


def train_started(run_dir: Path, hook: str, *extra: str) -> tuple[subprocess.Popen, Callable[[], Any]]:
    """A run in a process of its own with NANOPT_TEST_HOOK=hook, started, and what waits for it (its stderr)."""
    env = {**os.environ, "NANOPT_TEST_HOOK": hook, "OMP_NUM_THREADS": "1"}
    err = tempfile.TemporaryFile("w+")  # a file, which never fills up as an unread pipe does
    proc = subprocess.Popen([sys.executable, "-m", "nanopt.main", *ARGS, f"--run.dir={run_dir}", *extra],
                            stdout=subprocess.DEVNULL, stderr=err, text=True, env=env, cwd=REPO)

    def finished() -> subprocess.CompletedProcess:
        try:
            proc.wait(timeout=300)  # only stops a hung run; speed is not asserted
        finally:
            proc.kill()  # a no-op once it has exited
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, "", err.read())

    return proc, finished


def wait_for(marker: Path, alive: Callable[[], bool] = lambda: True, timeout: float = 120) -> bool:
    """Whether the pause hook's `marker` appeared (while `alive`, within `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while not marker.exists() and alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    return marker.exists()


def sigterm_once_paused(marker: Path, finished: Callable[..., Any], pid: Callable[[], int],
                        alive: Callable[[], bool] = lambda: True) -> Callable[[], tuple[Any, bool]]:
    """SIGTERM to pid() as soon as the pause hook's `marker` appears (a thread watches, however long a loaded machine
    takes to get there); what this returns waits for the run: (its process, whether the marker appeared)."""
    seen: list[bool] = []
    over = threading.Event()

    def send() -> None:
        seen.append(wait_for(marker, lambda: alive() and not over.is_set(), math.inf))
        if seen[0]:
            os.kill(pid(), signal.SIGTERM)

    (thread := threading.Thread(target=send, daemon=True)).start()

    def done() -> tuple[Any, bool]:
        proc = finished()
        over.set()
        thread.join()
        return proc, seen[0]

    return done


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> Iterator[Callable[..., Any]]:
    """Every run of this file in processes of its own (KILLED, one SIGTERMed, two torchruns), all started together the
    first time a test asks for one: on 2 cores they run beside each other and this process's references; the paused
    ones get their SIGTERM from a thread. started(name, run_dir) waits for that run and copies what it left (a test
    resumes its own copy: two tests share kill-after-save:6), returning what its waiter returns (its process)."""
    dirs = {name: tmp_path_factory.mktemp(name.split(":")[0]) for name in [*KILLED, "sigterm", "fsdp", "ranks"]}
    waiting = {name: train_started(dirs[name], hook, *extra)[1] for name, (hook, extra) in KILLED.items()}
    proc, finished = train_started(dirs["sigterm"], "pause:3")
    waiting["sigterm"] = sigterm_once_paused(dirs["sigterm"] / ".test_paused.rank0", finished, lambda: proc.pid,
                                             lambda: proc.poll() is None)
    waiting["fsdp"] = torchrun_started(2, [*ARGS, "--runtime.parallel=fsdp", "--train.grad_clip=0",
                                           f"--run.dir={dirs['fsdp']}"], extra=["--standalone", "--max-restarts=1"],
                                       env={"NANOPT_TEST_HOOK": "kill-in-step:5:1"})
    marker = dirs["ranks"] / ".test_paused.rank1"  # rank 1 only; torchrun and rank 0 hear nothing
    waiting["ranks"] = sigterm_once_paused(marker, torchrun_started(2, [*ARGS, f"--run.dir={dirs['ranks']}"],
                                                                    env={"NANOPT_TEST_HOOK": "pause:3:1"}),
                                           lambda: int(marker.read_text()))
    done: dict[str, Any] = {}

    def copy(name: str, run_dir: Path) -> Any:
        if name not in done:
            done[name] = waiting[name]()
        shutil.copytree(dirs[name], run_dir, dirs_exist_ok=True)
        return done[name]

    yield copy
    for name, finished in waiting.items():  # a run no selected test waited for
        if name not in done:
            finished()


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run (AdamW, started with checkpoint.resume=false): the start of every test that resumes it
    changed; each takes its own copy."""
    run_dir = tmp_path_factory.mktemp("two_steps")
    assert train_here(run_dir, "--train.max_steps=2", "--checkpoint.resume=false") == 0
    return run_dir


@pytest.fixture
def copied(two_steps: Path, tmp_path: Path) -> Path:
    shutil.copytree(two_steps, tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run: the bytes every interrupted run must end with. Its mirror (beside it) is the mirror
    test's, local case."""
    root = tmp_path_factory.mktemp("reference")
    assert train_here(root / "run", f"--checkpoint.mirror=file://{root / 'mirror'}") == 0
    return root / "run"


@pytest.fixture(scope="module")
def muon_ema_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted MUON_EMA run, mirrored to MEMORY_MIRROR (the mirror test's memory case)."""
    run_dir = tmp_path_factory.mktemp("muon_ema_reference")
    assert train_here(run_dir, *MUON_EMA, f"--checkpoint.mirror={MEMORY_MIRROR}") == 0
    return run_dir


def assert_same_as(reference: Path, run_dir: Path) -> None:
    assert final_weights(run_dir) == final_weights(reference)
    assert logged(run_dir) == logged(reference)
    assert len(logged(run_dir)) == STEPS  # each step logged once: the rows after the checkpoint were trimmed
    ref_opt, opt = (resumable_state(step_dir(d))["optimizer"] for d in (reference, run_dir))
    assert ref_opt["state"] and ref_opt["state"].keys() == opt["state"].keys()
    for key, state in ref_opt["state"].items():
        for name, value in state.items():
            assert torch.equal(value, opt["state"][key][name]), (key, name)


@pytest.mark.parametrize("name, corrupt, resumes_from", [
    ("kill-in-save:4", False, 2),     # mid-write: the half-written step 4 is discarded, step 2 is used
    ("kill-after-save:6", False, 6),  # after the rename, before `latest` moved: the directory scan still finds 6
    ("kill-after-save:6", True, 4),   # and one flipped byte in step 6's weights: skipped for the previous one
    ("muon-ema", False, 4),           # mid-step 5: the work since step 4 is lost and redone
])
@pytest.mark.slow
def test_sigkill_anywhere_then_resume_is_bitwise_identical(started, request, tmp_path, name, corrupt, resumes_from,
                                                          capsys):
    """Weights, every logged loss and the optimizer's state (Muon's and AdamW's) end as in the uninterrupted run;
    with averaged weights, the average and every evaluation of it too."""
    muon = name == "muon-ema"
    reference = request.getfixturevalue("muon_ema_reference" if muon else "reference")
    proc = started(name, tmp_path)  # the killed run's lock is left behind
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    if corrupt:
        data = bytearray((newest := step_dir(tmp_path, 6) / rundirs.MODEL_FILE).read_bytes())
        data[-100] ^= 0xFF
        newest.write_bytes(bytes(data))
    assert complete_checkpoints(tmp_path)[-1] == f"step_{resumes_from:06d}"
    if name.startswith("kill-in-save"):
        assert (tmp_path / "checkpoints" / ".tmp_step_000004").is_dir()  # the interrupted write is really there
    capsys.readouterr()
    assert train_here(tmp_path, *(MUON_EMA if muon else ())) == 0
    out = capsys.readouterr().out  # nanopt logs to stdout
    assert f"resuming from {step_dir(tmp_path, resumes_from)}" in out
    assert not corrupt or ("skipping checkpoint step_000006" in out and "crc32" in out)
    assert_same_as(reference, tmp_path)
    if muon:  # the uninterrupted muon run lowered the loss
        values = [loss for _, loss in logged(reference)]
        assert values[-1] < values[0] - 0.5 and "name: muon" in (reference / "config.yaml").read_text(), values
        averaged = [step_dir(d) / rundirs.EMA_FILE for d in (reference, tmp_path)]
        assert averaged[0].read_bytes() == averaged[1].read_bytes()
        assert logged(tmp_path, "val_loss") == logged(reference, "val_loss")
        assert [w for _, _, w in logged(tmp_path, "val_loss")] == ["model", "model", "ema", "ema", "ema"]  # 0 2 4 6 8


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_exits_75_and_says_resumable(started, tmp_path, reference):
    run_dir = tmp_path / "run"
    proc, paused = started("sigterm", run_dir)  # SIGTERMed once paused after step 3
    assert paused, "the run never reached step 3"
    stderr = proc.stderr
    assert proc.returncode == errors.EXIT_PREEMPTED == 75, stderr
    assert "received SIGTERM" in stderr and "resumable" in stderr and "step 3" in stderr
    # At once: step 3 (not a periodic save) is checkpointed and no further step is trained.
    assert complete_checkpoints(run_dir)[-1] == "step_000003"
    assert max(step for step, _ in logged(run_dir)) <= 3
    assert train_here(run_dir) == 0
    assert_same_as(reference, run_dir)


@pytest.mark.slow
def test_time_limit_and_sigint_checkpoint_exit_75_and_resume(tmp_path, reference, monkeypatch, capsys):
    """run.time_limit_s: past it, the run checkpoints after the current step and exits 75 like a preemption (a
    scheduler's hard timeout would otherwise lose the steps since the last checkpoint). Modal preempts with SIGINT:
    the same, here through nanopt.main.run in this very process."""
    assert train_here(tmp_path, "--run.time_limit_s=1e-6") == errors.EXIT_PREEMPTED  # over at once: step 1
    err = capsys.readouterr().err
    assert "preempted by the time limit (run.time_limit_s = 1e-06 s of wall time) after step 1" in err
    assert checkpoint.verify_checkpoint(step_dir(tmp_path, 1)) is None  # not a periodic save
    monkeypatch.setenv("NANOPT_TEST_HOOK", "pause:5")
    marker = tmp_path / ".test_paused.rank0"
    threading.Thread(target=lambda: (wait_for(marker), os.kill(os.getpid(), signal.SIGINT)), daemon=True).start()
    assert train_here(tmp_path, "--run.time_limit_s=0") == errors.EXIT_PREEMPTED  # a safe change on resume
    assert "preempted by SIGINT after step 5" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers are restored
    monkeypatch.delenv("NANOPT_TEST_HOOK")
    assert train_here(tmp_path, "--run.time_limit_s=0") == 0
    assert_same_as(reference, tmp_path)


@pytest.mark.slow
def test_fsdp_torchrun_restart_after_sigkill_resumes_bitwise(started, tmp_path):
    """Rank 1 of 2 fsdp ranks is SIGKILLed in step 5; torchrun --max-restarts restarts both, which resume from the
    step-4 checkpoint (DCP's shards) and end byte for byte as the one-process run trained here meanwhile. Without
    gradient clipping (train.grad_clip=0): fsdp averages the ranks' gradients exactly (halving a sum is exact), but
    adds the shards' squares of the gradient norm in another order (tests/e2e/test_ddp.py)."""
    unclipped, killed = tmp_path / "unclipped", tmp_path / "killed"
    assert train_here(unclipped, "--train.grad_clip=0") == 0
    proc = started("fsdp", killed)
    log = f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}"  # seen to flake once: keep the evidence
    assert proc.returncode == 0, log
    assert "test hook kill-in-step:5: SIGKILL" in proc.stderr, log
    assert "resuming from" in proc.stdout and "step_000004" in proc.stdout, log
    assert_same_as(unclipped, killed)


@pytest.mark.slow
def test_signal_to_one_rank_stops_every_rank_at_the_same_step(started, tmp_path, reference):
    """torchrun workers hear a signal at different moments: here only rank 1 gets SIGTERM, while paused
    after step 3. The all-reduced flag makes rank 0 stop after the same step; both save one checkpoint."""
    run_dir = tmp_path / "run"
    proc, paused = started("ranks", run_dir)
    assert paused, "rank 1 never reached step 3"
    log = proc.stdout + proc.stderr
    assert "preempted by SIGTERM after step 3" in log  # rank 1
    assert "preempted by a signal to another rank after step 3" in log  # rank 0, same step
    # torchrun's report: both workers said "preempted, resumable". Seen once (1 in ~10): a worker aborted (SIGABRT)
    # after both had logged the preemption; the tail shows where, next time.
    assert "exitcode  : 75" in log, log[-4000:]
    assert complete_checkpoints(run_dir)[-1] == "step_000003"
    rngs = torch.load(step_dir(run_dir, 3) / rundirs.RNG_FILE, weights_only=True)["ranks"]
    assert len(rngs) == 2  # every rank's RNG state was saved
    assert train_here(run_dir) == 0  # resumed on one process
    assert final_weights(run_dir) == final_weights(reference)


def test_diverged_loss_stops_keeps_the_last_good_checkpoint_and_closes_the_profiler_and_mirror(tmp_path, capsys):
    """Logging only every 100 steps: the NaN must still be caught before the next checkpoint save. TrainingError
    leaves through the same with/finally as a finished run: the profiler is stopped and its trace written, and the
    mirror's queued copies are waited for."""
    run_dir, mirror = tmp_path / "run", tmp_path / "mirror"
    rc = run([*ARGS, f"--run.dir={run_dir}", "--train.lr=1e30", "--checkpoint.every=1", "--log.every=100",
              "--train.warmup_steps=0", f"--checkpoint.mirror={mirror}", "--profile.enabled=true",
              "--profile.wait=0", "--profile.warmup=0", "--profile.active=6"])
    err = capsys.readouterr().err
    assert rc == errors.EXIT_DIVERGED == 3, err
    assert "NaN/inf" in err and "train.lr" in err and "Traceback" not in err
    kept = complete_checkpoints(run_dir)
    for name in kept:  # every checkpoint on disk holds finite weights
        weights = load_file(run_dir / "checkpoints" / name / rundirs.MODEL_FILE).values()
        assert all(torch.isfinite(t).all() for t in weights), name
    assert (f"{run_dir / 'checkpoints' / kept[-1]}" in err) if kept else ("No checkpoint was written" in err)
    assert not profiling._active  # not left recording in this process
    assert list((run_dir / "tb" / "plugins" / "profile").rglob("*.pt.trace.json")), "no trace written"
    assert kept == sorted(p.name for p in mirror.glob("step_*") if (p / "COMPLETE").exists())


@pytest.mark.slow
def test_no_usable_checkpoint_is_refused_every_time_until_start_over(copied, capsys):
    (step_dir(copied, 2) / "dcp" / "__0_0.distcp").write_bytes(b"garbage")
    metrics = (copied / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    for _ in range(2):  # the same paragraph every time: nothing is set aside, nothing restarts
        assert train_here(copied, "--train.max_steps=3") == 2
        err = capsys.readouterr().err
        assert "no usable checkpoint" in err and "dcp/__0_0.distcp" in err and "start_over" in err
        assert "Traceback" not in err
        assert (copied / "metrics.jsonl").read_bytes() == metrics
        assert step_dir(copied, 2).is_dir()
    assert train_here(copied, "--train.max_steps=3", "--checkpoint.start_over=true") == 0
    steps = [json.loads(line)["step"] for line in (copied / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] in (0, 1) and steps[-1] == 3 and steps == sorted(steps)  # one run from step 0, not appended


# (id, the resume's arguments on the 2-step AdamW run, words its one-paragraph refusal holds)
REFUSED = [
    ("model_and_lr", ("--train.max_steps=2", "--model.dim=32", "--train.lr=0.001"),
     ["model.dim: 64 in the checkpoint, 32 now", "train.lr", "checkpoint.allow_changes"]),
    # The validation windows are part of the run: another eval.seed would measure different tokens.
    ("eval_seed", ("--train.max_steps=2", "--eval.seed=7"), ["eval.seed: 0 in the checkpoint, 7 now"]),
    ("optimizer", ("--train.max_steps=4", MUON_ARG), ["optim.name: 'adamw' in the checkpoint, 'muon' now"]),
    ("optimizer_allowed", ("--train.max_steps=4", MUON_ARG, "--checkpoint.allow_changes=optim.name"),
     ["optimizer state does not fit this run", "--optim.name=adamw"]),
    # two_steps trained a fresh directory with checkpoint.resume=false; in one that is not empty it refuses.
    ("resume_false", ("--train.max_steps=2", "--checkpoint.resume=false"), ["not empty"]),
]


@pytest.mark.parametrize("extra, words", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_resume_that_would_not_be_exact_is_refused_in_one_paragraph(copied, capsys, extra, words):
    assert train_here(copied, *extra) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(word in err for word in words), err


@pytest.mark.slow
def test_safe_and_allowed_config_changes_resume(copied, capsys):
    # Known-safe keys (length, cadence, logging) resume without complaint.
    assert train_here(copied, "--train.max_steps=3", "--checkpoint.every=3", "--log.every=2", "--eval.every=3") == 0
    assert complete_checkpoints(copied)[-1] == "step_000003"
    # An explicitly allowed change is accepted.
    assert train_here(copied, "--train.max_steps=4", "--train.lr=0.001", "--checkpoint.allow_changes=train.lr") == 0


def test_shards_that_differ_from_the_checkpoint_are_refused(tmp_path, corpus_dir, capsys):
    from nanopt.data.shards import open_shard, write_shard

    shards = tmp_path / "shards"
    for name in ("train_000000.bin", "val_000000.bin"):
        write_shard(shards / name, open_shard(corpus_dir / name)[:20000], 257)
    run_dir = tmp_path / "run"
    assert train_here(run_dir, "--train.max_steps=2", f"--data.source={shards}") == 0
    write_shard(shards / "train_000000.bin", open_shard(corpus_dir / "train_000000.bin")[5:20005], 257)
    assert train_here(run_dir, "--train.max_steps=4", f"--data.source={shards}") == 2
    err = capsys.readouterr().err
    assert "training shards do not match" in err and "train_000000.bin" in err


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["memory", "local"])
def test_mirror_copy_is_used_when_the_local_directory_is_gone(tmp_path, request, scheme, capsys):
    """The reference runs' mirrors: a new machine (an empty run directory) resumes from the mirror's newest complete
    checkpoint."""
    if scheme == "memory":
        ref, url, extra = request.getfixturevalue("muon_ema_reference"), MEMORY_MIRROR, MUON_EMA
    else:
        ref, extra = request.getfixturevalue("reference"), ()
        url = f"file://{ref.parent / 'mirror'}"
    fs, root = fsspec.core.url_to_fs(url)
    assert fs.cat(f"{root}/latest").decode().strip() == "step_000008"
    remote = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert remote == ["latest", "step_000004", "step_000006", "step_000008"]  # keep=3, like the local directory
    assert fs.cat(f"{root}/step_000008/model.safetensors") == final_weights(ref)
    fs.rm(f"{root}/step_000008/COMPLETE")  # the machine vanished before the last upload finished
    capsys.readouterr()
    run_dir = tmp_path / "run"  # the machine is gone; the mirror is not
    assert train_here(run_dir, *extra, f"--checkpoint.mirror={url}") == 0
    assert "fetched step_000006 from the mirror" in capsys.readouterr().out
    assert final_weights(run_dir) == final_weights(ref)
    assert [s for s, _ in logged(run_dir)] == [7, 8]  # the log of steps 1-6 stayed on the lost machine
    assert dict(logged(run_dir)) == {s: v for s, v in logged(ref) if s > 6}
    assert not math.isnan(logged(run_dir)[-1][1])


# ---------------------------------------------------------------- no restart nobody asked for
def test_every_rerun_refuses_when_the_run_trained_but_no_checkpoint_remains(copied, capsys):
    """A checkpoints/ directory not yet synced (or deleted) must not turn into a silent restart."""
    os.rename(copied / "checkpoints", copied / "elsewhere")
    metrics = (copied / "metrics.jsonl").read_bytes()
    for _ in range(2):
        assert train_here(copied, "--train.max_steps=3") == 2
        err = capsys.readouterr().err
        assert "shows saved training but holds no usable checkpoint" in err and "start_over" in err
        assert (copied / "metrics.jsonl").read_bytes() == metrics


# ---------------------------------------------------------------- a finished run is finished
@pytest.mark.slow
def test_rerunning_a_finished_run_prints_its_summary_and_changes_nothing(tmp_path, reference, capsys):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert train_here(tmp_path) == 0
    out = capsys.readouterr().out
    assert "is finished; nothing to train" in out and f"{STEPS} steps" in out and f"step      1/{STEPS}" not in out
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files
    # Another config on the finished run is refused, naming the key.
    assert train_here(tmp_path, "--train.lr=0.001") == 2
    assert "finished run of another config" in capsys.readouterr().err
    # So is a resume-safe key that changes results: the re-run would have ignored it (exit 0, before).
    assert train_here(tmp_path, "--train.target_val_loss=1.6") == 2
    assert "train.target_val_loss: None in the checkpoint, 1.6 now" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files


def test_a_run_stopped_at_its_target_is_finished(tmp_path, capsys):
    target = ["--train.target_val_loss=100", "--train.stop_at_target=true", "--eval.every=2", "--train.max_steps=6"]
    assert train_here(tmp_path, *target) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    # The clock saw the target at the step-0 evaluation; the loop stops at the next one.
    assert summary["stopped_at_target"] is True and summary["steps"] == 2 and summary["step_to_target"] == 0
    assert rundirs.finished(tmp_path, 6, True) == summary
    assert rundirs.finished(tmp_path, 6, False) is None  # without stop_at_target it would train on to 6
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert train_here(tmp_path, *target) == 0
    assert "is finished" in capsys.readouterr().out
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics
