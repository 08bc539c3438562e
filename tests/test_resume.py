"""Exact resume: a run killed, preempted or crashed anywhere ends bitwise identical to one that never stopped.

Runs are CPU, fp32, the SMALL model. Crashes are real processes killed with SIGKILL at precise points
through the NANOPT_TEST_HOOK test hook (nanopt/faults.py); resumes run in-process through nanopt.main.run
(same code, no interpreter start-up), and every result is compared byte for byte with one uninterrupted
reference run.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, small_overrides, torchrun
from nanopt import checkpoint, errors, faults, profiling, runtime
from nanopt.main import run

STEPS = 8
ARGS = small_overrides(**{
    "train.precision": "fp32", "train.max_steps": STEPS, "checkpoint.every": 2, "log.tensorboard": "false",
})


def complete_checkpoints(root: Path) -> list[Path]:
    """The checkpoints that verify, oldest first."""
    return [c for c in checkpoint.checkpoint_dirs(root) if checkpoint.verify_checkpoint(c) is None]


def final_weights(run_dir: Path, step: int = STEPS) -> bytes:
    return (run_dir / "checkpoints" / f"step_{step:06d}" / "model.safetensors").read_bytes()


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, training loss) of every logged step: a resumed run's log must read like the uninterrupted one."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out.append((record["step"], record["loss"]))
    return out


def train_here(run_dir: Path, *extra: str) -> int:
    return run([*ARGS, f"--run.dir={run_dir}", *extra])


def train_process(run_dir: Path, hook: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NANOPT_TEST_HOOK": hook, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "nanopt.main", *ARGS, f"--run.dir={run_dir}", *extra],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run: the bytes every interrupted run must end with."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert train_here(run_dir) == 0
    return run_dir


def assert_same_as(reference: Path, run_dir: Path) -> None:
    assert final_weights(run_dir) == final_weights(reference)
    assert losses(run_dir) == losses(reference)
    assert len(losses(run_dir)) == STEPS  # each step logged once: the rows after the checkpoint were trimmed
    ref_opt = torch.load(reference / "checkpoints" / f"step_{STEPS:06d}" / "optimizer.pt", weights_only=True)
    opt = torch.load(run_dir / "checkpoints" / f"step_{STEPS:06d}" / "optimizer.pt", weights_only=True)
    for key, state in ref_opt["state"].items():
        for name, value in state.items():
            assert torch.equal(value, opt["state"][key][name]), (key, name)


@pytest.mark.parametrize("hook, resumes_from", [
    ("kill-in-step:5", 4),      # mid-step: the work since step 4 is lost and redone
    ("kill-in-save:4", 2),      # mid-write: the half-written step 4 is discarded, step 2 is used
    ("kill-after-save:6", 6),   # after the rename, before `latest` moved: the directory scan still finds 6
])
@pytest.mark.slow
def test_sigkill_anywhere_then_resume_is_bitwise_identical(tmp_path, reference, hook, resumes_from, capsys):
    proc = train_process(tmp_path, hook)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    complete = [p.name for p in complete_checkpoints(tmp_path / "checkpoints")]
    assert complete[-1] == f"step_{resumes_from:06d}"
    if hook.startswith("kill-in-save"):
        assert (tmp_path / "checkpoints" / ".tmp_step_000004").is_dir()  # the interrupted write is really there
    assert train_here(tmp_path) == 0
    assert f"resuming from {tmp_path / 'checkpoints' / f'step_{resumes_from:06d}'}" in capsys.readouterr().out
    assert_same_as(reference, tmp_path)


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_exits_75_and_says_resumable(tmp_path, reference):
    env = {**os.environ, "NANOPT_TEST_HOOK": "pause:3", "OMP_NUM_THREADS": "1"}
    err = open(tmp_path / "stderr.txt", "w+")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "nanopt.main", *ARGS, f"--run.dir={run_dir}"],
                            stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=REPO)
    marker = run_dir / ".test_paused.rank0"
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the run never reached step 3"
    proc.send_signal(signal.SIGTERM)
    returncode = proc.wait(timeout=60)  # only stops a hung run; speed is not asserted
    err.seek(0)
    stderr = err.read()
    assert returncode == errors.EXIT_PREEMPTED == 75, stderr
    assert "received SIGTERM" in stderr and "resumable" in stderr and "step 3" in stderr
    # At once: step 3 (not a periodic save) is checkpointed and no further step is trained.
    assert complete_checkpoints(run_dir / "checkpoints")[-1].name == "step_000003"
    assert max(step for step, _ in losses(run_dir)) <= 3
    assert train_here(run_dir) == 0
    assert_same_as(reference, run_dir)


@pytest.mark.slow
def test_time_limit_checkpoints_exits_75_and_resumes(tmp_path, reference, capsys):
    """run.time_limit_s: past it, the run checkpoints after the current step and exits 75 like a preemption
    (a scheduler's hard timeout would otherwise kill it and lose the steps since the last checkpoint)."""
    assert train_here(tmp_path, "--run.time_limit_s=1e-6") == errors.EXIT_PREEMPTED  # over at once: step 1
    err = capsys.readouterr().err
    assert "preempted by the time limit (run.time_limit_s = 1e-06 s of wall time) after step 1" in err
    assert checkpoint.verify_checkpoint(tmp_path / "checkpoints" / "step_000001") is None  # not a periodic save
    assert train_here(tmp_path, "--run.time_limit_s=0") == 0  # a safe change on resume
    assert_same_as(reference, tmp_path)


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


@pytest.mark.slow
def test_sigint_in_process_checkpoints_and_resumes(tmp_path, reference, monkeypatch, capsys):
    """Modal preempts with SIGINT: same behaviour, here through nanopt.main.run in this very process."""
    monkeypatch.setenv("NANOPT_TEST_HOOK", "pause:5")
    marker = tmp_path / ".test_paused.rank0"

    def interrupt_when_paused() -> None:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_paused, daemon=True).start()
    assert train_here(tmp_path) == errors.EXIT_PREEMPTED
    assert "preempted by SIGINT after step 5" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers are restored
    monkeypatch.delenv("NANOPT_TEST_HOOK")
    assert train_here(tmp_path) == 0
    assert_same_as(reference, tmp_path)


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


@pytest.mark.slow
def test_two_process_torchrun_restart_resumes_identically(tmp_path, reference):
    """Rank 1 is SIGKILLed in step 5; torchrun --max-restarts restarts both ranks, which resume from step 4.

    The uninterrupted reference ran on one process: the loader gives every step the same sequences at any
    world size, and halving a two-rank gradient sum is exact, so the weights must match it byte for byte.
    """
    proc = torchrun(2, [*ARGS, f"--run.dir={tmp_path}"], extra=["--standalone", "--max-restarts=1"],
                    env={"NANOPT_TEST_HOOK": "kill-in-step:5:1"})
    log = f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}"  # seen to flake once: keep the evidence
    assert proc.returncode == 0, log
    assert "test hook kill-in-step:5: SIGKILL" in proc.stderr, log
    assert "resuming from" in proc.stdout and "step_000004" in proc.stdout, log
    assert final_weights(tmp_path) == final_weights(reference), log
    assert losses(tmp_path) == losses(reference), f"{losses(tmp_path)} != {losses(reference)}\n{log}"


@pytest.mark.slow
def test_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, reference):
    """torchrun workers hear a signal at different moments: here only rank 1 gets SIGTERM, while paused
    after step 3. The all-reduced flag makes rank 0 stop after the same step; both save one checkpoint."""
    run_dir = tmp_path / "run"
    out = open(tmp_path / "out.txt", "w+")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "nanopt.main",
           *ARGS, f"--run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOPT_TEST_HOOK": "pause:3:1"}
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    marker = run_dir / ".test_paused.rank1"
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "rank 1 never reached step 3"
    os.kill(int(marker.read_text()), signal.SIGTERM)  # rank 1 only; torchrun and rank 0 hear nothing
    proc.wait(timeout=60)
    out.seek(0)
    log = out.read()
    assert "preempted by SIGTERM after step 3" in log  # rank 1
    assert "preempted by a signal to another rank after step 3" in log  # rank 0, same step
    # torchrun's report: both workers said "preempted, resumable". Seen once (1 in ~10): a worker aborted (SIGABRT)
    # after both had logged the preemption; the tail shows where, next time.
    assert "exitcode  : 75" in log, log[-4000:]
    assert complete_checkpoints(run_dir / "checkpoints")[-1].name == "step_000003"
    rngs = torch.load(run_dir / "checkpoints" / "step_000003" / "rng.pt", weights_only=True)["ranks"]
    assert len(rngs) == 2  # every rank's RNG state was saved
    assert train_here(run_dir) == 0  # resumed on one process
    assert final_weights(run_dir) == final_weights(reference)


def test_diverged_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    # Logging only every 100 steps: the NaN must still be caught before the next checkpoint save.
    rc = run([*ARGS, f"--run.dir={tmp_path}", "--train.lr=1e30", "--checkpoint.every=1", "--log.every=100",
              "--train.warmup_steps=0"])
    err = capsys.readouterr().err
    assert rc == errors.EXIT_DIVERGED == 3, err
    assert "NaN/inf" in err and "train.lr" in err and "Traceback" not in err
    kept = complete_checkpoints(tmp_path / "checkpoints")
    for ckpt in kept:  # every checkpoint on disk holds finite weights
        assert all(torch.isfinite(t).all() for t in load_file(ckpt / "model.safetensors").values()), ckpt
    assert (f"{kept[-1]}" in err) if kept else ("No checkpoint was written" in err)


@pytest.mark.slow
def test_a_diverged_run_closes_the_profiler_and_the_mirror_like_a_finished_one(tmp_path, capsys):
    """TrainingError leaves through the same with/finally as a finished run: the profiler is stopped and its
    trace written, and the mirror's queued copies are waited for."""
    run_dir, mirror = tmp_path / "run", tmp_path / "mirror"
    rc = run([*ARGS, f"--run.dir={run_dir}", "--train.lr=1e30", "--checkpoint.every=1", "--log.every=100",
              "--train.warmup_steps=0", f"--checkpoint.mirror={mirror}", "--profile.enabled=true",
              "--profile.wait=0", "--profile.warmup=0", "--profile.active=6"])
    err = capsys.readouterr().err
    assert rc == errors.EXIT_DIVERGED, err
    assert not profiling._active  # not left recording in this process
    assert list((run_dir / "tb" / "plugins" / "profile").rglob("*.pt.trace.json")), "no trace written"
    kept = [p.name for p in complete_checkpoints(run_dir / "checkpoints")]
    assert kept == sorted(p.name for p in mirror.glob("step_*") if (p / "COMPLETE").exists())


def test_save_manifest_lists_every_file_with_its_size_and_crc32(tmp_path):
    """The COMPLETE manifest is summed by worker threads while the next file is written: it must still
    describe exactly the bytes on disk, and no temp directory or thread may outlive the save."""
    import zlib

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    final = checkpoint.save(tmp_path, 4, model, opt, {"config": {}}, keep=2)
    files = json.loads((final / "COMPLETE").read_text())["files"]
    assert sorted(files) == ["model.safetensors", "optimizer.pt", "rng.pt", "state.json"]
    for name, entry in files.items():
        raw = (final / name).read_bytes()
        assert entry == {"bytes": len(raw), "crc32": zlib.crc32(raw)}, name
    assert checkpoint.verify_checkpoint(final) is None and not list(tmp_path.glob(".tmp_*"))
    assert not [t for t in threading.enumerate() if t.name.startswith("nanopt-ckpt")]


@pytest.mark.slow
def test_corrupt_checkpoint_is_skipped_for_the_previous_one(tmp_path, reference, capsys):
    proc = train_process(tmp_path, "kill-after-save:6")  # checkpoints 2, 4, 6, then SIGKILL (its lock left behind)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    newest = tmp_path / "checkpoints" / "step_000006" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in the weights
    newest.write_bytes(bytes(data))
    capsys.readouterr()
    assert train_here(tmp_path) == 0
    out = capsys.readouterr().out  # nanopt logs to stdout
    assert "skipping checkpoint step_000006" in out and "crc32" in out and "resuming from" in out
    assert_same_as(reference, tmp_path)  # resumed from step 4 and redid steps 5-8


@pytest.mark.slow
def test_no_usable_checkpoint_is_refused_every_time_until_start_over(tmp_path, capsys):
    assert train_here(tmp_path, "--train.max_steps=2") == 0
    (tmp_path / "checkpoints" / "step_000002" / "optimizer.pt").write_bytes(b"garbage")
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    for _ in range(2):  # the same paragraph every time: nothing is set aside, nothing restarts
        assert train_here(tmp_path, "--train.max_steps=3") == 2
        err = capsys.readouterr().err
        assert "no usable checkpoint" in err and "optimizer.pt" in err and "start_over" in err
        assert "Traceback" not in err
        assert (tmp_path / "metrics.jsonl").read_bytes() == metrics
        assert (tmp_path / "checkpoints" / "step_000002").is_dir()
    assert train_here(tmp_path, "--train.max_steps=3", "--checkpoint.start_over=true") == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] in (0, 1) and steps[-1] == 3 and steps == sorted(steps)  # one run from step 0, not appended


@pytest.mark.slow
def test_changed_config_is_refused_unless_safe_or_allowed(tmp_path, capsys):
    assert train_here(tmp_path, "--train.max_steps=2") == 0
    assert train_here(tmp_path, "--train.max_steps=2", "--model.dim=32", "--train.lr=0.001") == 2
    err = capsys.readouterr().err
    assert "model.dim: 64 in the checkpoint, 32 now" in err and "train.lr" in err
    assert "checkpoint.allow_changes" in err
    # The validation windows are part of the run: another eval.seed would measure different tokens.
    assert train_here(tmp_path, "--train.max_steps=2", "--eval.seed=7") == 2
    assert "eval.seed: 0 in the checkpoint, 7 now" in capsys.readouterr().err
    # Known-safe keys (length, cadence, logging) resume without complaint.
    assert train_here(tmp_path, "--train.max_steps=3", "--checkpoint.every=3", "--log.every=2",
                      "--eval.every=3") == 0
    assert complete_checkpoints(tmp_path / "checkpoints")[-1].name == "step_000003"
    # An explicitly allowed change is accepted.
    assert train_here(tmp_path, "--train.max_steps=4", "--train.lr=0.001", "--checkpoint.allow_changes=train.lr") == 0


def test_shards_that_differ_from_the_checkpoint_are_refused(tmp_path, corpus_dir, capsys):
    from nanopt.shards import open_shard, write_shard

    shards = tmp_path / "shards"
    for name in ("train_000000.bin", "val_000000.bin"):
        write_shard(shards / name, open_shard(corpus_dir / name)[:20000], 257)
    run_dir = tmp_path / "run"
    assert train_here(run_dir, "--train.max_steps=2", f"--data.source={shards}") == 0
    write_shard(shards / "train_000000.bin", open_shard(corpus_dir / "train_000000.bin")[5:20005], 257)
    assert train_here(run_dir, "--train.max_steps=4", f"--data.source={shards}") == 2
    err = capsys.readouterr().err
    assert "training shards do not match" in err and "train_000000.bin" in err


def test_resume_false_never_overwrites(tmp_path, capsys):
    assert train_here(tmp_path / "fresh", "--train.max_steps=2", "--checkpoint.resume=false") == 0
    assert train_here(tmp_path / "fresh", "--train.max_steps=2", "--checkpoint.resume=false") == 2
    assert "not empty" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["memory", "local"])
def test_mirror_copy_is_used_when_the_local_directory_is_gone(tmp_path, reference, scheme, capsys):
    import fsspec

    url = f"memory://nanopt-test-{tmp_path.name}" if scheme == "memory" else f"file://{tmp_path / 'mirror'}"
    run_dir = tmp_path / "run"
    assert train_here(run_dir, f"--checkpoint.mirror={url}") == 0
    fs, root = fsspec.core.url_to_fs(url)
    assert fs.cat(f"{root}/latest").decode().strip() == "step_000008"
    remote = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert remote == ["latest", "step_000004", "step_000006", "step_000008"]  # keep=3, like the local directory
    assert fs.cat(f"{root}/step_000008/model.safetensors") == final_weights(reference)
    shutil.rmtree(run_dir)  # the machine is gone; the mirror is not ...
    fs.rm(f"{root}/step_000008/COMPLETE")  # ... and the machine vanished before the last upload finished
    capsys.readouterr()
    assert train_here(run_dir, f"--checkpoint.mirror={url}") == 0
    assert "fetched step_000006 from the mirror" in capsys.readouterr().out
    assert final_weights(run_dir) == final_weights(reference)
    assert [s for s, _ in losses(run_dir)] == [7, 8]  # the log of steps 1-6 stayed on the lost machine
    assert dict(losses(run_dir)) == {s: v for s, v in losses(reference) if s > 6}
    assert not math.isnan(losses(run_dir)[-1][1])


def test_every_rng_round_trips_through_a_weights_only_checkpoint(tmp_path):
    """Nothing in today's step draws random numbers, so the weights cannot show a lost RNG: check it here."""
    import random

    import numpy as np

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    torch.save({"ranks": [runtime.host_rng_state()]}, tmp_path / "rng.pt")
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    runtime.set_host_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["ranks"][0])
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected


def test_a_gpu_rank_saves_and_restores_only_its_own_generator(monkeypatch):
    """CPU twin of the CUDA RNG round trip: torch.cuda's state calls are replaced by recorders, so what is
    checked is which generator is read and written (the real ones need a GPU); a CPU checkpoint has none."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.tensor([device.index], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append((int(state), device)))
    rank3 = runtime.CudaBackend(torch.device("cuda", 3))
    state = rank3.rng_state()
    assert list(state) == ["cuda"]  # one state, this rank's: not every GPU the node shows
    rank3.set_rng_state(state)
    rank3.set_rng_state({})  # a CPU checkpoint
    assert calls == [(3, torch.device("cuda", 3))]
    runtime.CpuBackend(torch.device("cpu")).set_rng_state(state)  # a GPU checkpoint resumed on CPU: ignored
    assert len(calls) == 1


def test_a_failed_mirror_copy_is_reported_once_however_often_close_is_called(tmp_path, caplog):
    """finish() waits for the mirror before the summary and the run's cleanup closes again: one warning."""
    ckpt = checkpoint.Checkpointer.__new__(checkpoint.Checkpointer)  # only close()'s collaborators are needed
    ckpt.rt = runtime.Runtime("cpu", torch.device("cpu"), 0, 0, 1, 1, "fp32")
    ckpt.mirror = checkpoint.Mirror(str(tmp_path / "mirror"), 1)
    ckpt.mirror.failures.append("step_000001: no space left on device")
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        ckpt.close()
        ckpt.close()
    assert [r.getMessage() for r in caplog.records].count(
        f"checkpoint mirror {tmp_path / 'mirror'}: 1 copy(ies) failed: step_000001: no space left on device") == 1
