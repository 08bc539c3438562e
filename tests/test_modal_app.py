"""modal_app.py, offline: Modal's servers are never contacted and no token is needed. Nothing here runs on Modal
itself: the training function's body runs locally, a temporary directory standing in for the Volume, and launches
real torchrun on CPU."""
from __future__ import annotations

import ast
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from conftest import REPO, SMALL

import modal_app  # modal is in the dev extra: a missing one fails these tests, it does not skip them
from nanopt.config import load_config, parse_overrides, to_yaml
from nanopt.errors import ConfigError
from nanopt.main import run

# .local() warns that the function "is executing locally and will not have access to the mounted Volume".
pytestmark = pytest.mark.filterwarnings("ignore:.*executing locally:UserWarning")
TINY = str(REPO / "configs" / "tiny.yaml")
THREAD_KEYS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "TORCHINDUCTOR_COMPILE_THREADS")


def offline(tmp_path: Path, *args: str, **env: str) -> str:
    """`python ARGS` in a fresh process, offline: no token anywhere, and a server address nothing listens on, so any
    network attempt would fail. Its stdout; it must exit 0."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    clean.update(MODAL_CONFIG_PATH=str(tmp_path / "no-modal.toml"), MODAL_SERVER_URL="http://127.0.0.1:9",
                 HOME=str(tmp_path), PYTHONPATH=str(REPO), **env)
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=clean, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def config_file(tmp_path: Path, *overrides: str) -> Path:
    """The tiny config with SMALL and `overrides`, as a file."""
    path = tmp_path / "small.yaml"
    path.write_text(to_yaml(load_config(TINY, parse_overrides([*SMALL, *overrides]))))
    return path


@pytest.fixture
def vol(monkeypatch, tmp_path) -> SimpleNamespace:
    """tmp_path/vol as the Volume's mount (`dir`) and a mock as the Volume (`volume`: it counts commits)."""
    fake = SimpleNamespace(dir=tmp_path / "vol", volume=mock.MagicMock(name="volume"))
    monkeypatch.setattr(modal_app, "volume", fake.volume)
    monkeypatch.setattr(modal_app, "VOLUME_PATH", str(fake.dir))
    return fake


@pytest.fixture
def launched(vol, monkeypatch) -> mock.MagicMock:
    """run_forwarding_signals replaced by a mock that succeeds, with no thread settings in the environment."""
    for key in THREAD_KEYS:
        monkeypatch.delenv(key, raising=False)
    fake = mock.MagicMock(name="run_forwarding_signals", return_value=(0, None))
    monkeypatch.setattr(modal_app, "run_forwarding_signals", fake)
    return fake


# ---------------------------------------------------------------- import and CLI, in fresh processes
SPY = """
import warnings
from unittest import mock
import modal
from modal.exception import DeprecationError, InternalAPIWarning
spy = {n: mock.patch.object(modal.Image, n, autospec=True, side_effect=getattr(modal.Image, n)).start()
       for n in ("pip_install", "apt_install")}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import modal_app
bad = (DeprecationWarning, PendingDeprecationWarning, FutureWarning, DeprecationError, InternalAPIWarning)
info = modal_app.train_multinode.info() if hasattr(modal_app, "train_multinode") else None
print(repr({"warnings": [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, bad)],
            "app": modal_app.app.name, "pip": [(c.args[1:], c.kwargs) for c in spy["pip_install"].call_args_list],
            "apt": [p for c in spy["apt_install"].call_args_list for p in c.args[1:]],
            "cluster": info and (info.cluster_info.size, info.cluster_info.rdma, info.gpus, info.max_retries)}))
"""
WHEEL = "https://example.invalid/flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl"


def import_offline(tmp_path: Path, **env: str) -> dict[str, Any]:
    """Import modal_app offline (with `env`), spying on modal.Image's pip_install and apt_install: the deprecation-like
    warnings it raised, the app's name, each pip_install's (packages, keywords), the apt packages, and
    train_multinode's (cluster size, rdma, gpus, max_retries) or None where it is not defined."""
    out = offline(tmp_path, "-c", SPY, **env)
    return ast.literal_eval(out.strip().splitlines()[-1])  # our own repr of strings, tuples, lists, dicts


def test_import_needs_no_token_or_network_and_installs_torch_from_pypi(tmp_path):
    """No deprecation warning, no cluster unless asked for (then one, and a flash-attn wheel as a layer), and torch
    in its own pinned layer from PyPI with no index_url (it would replace PyPI for the whole install, and PyTorch's
    cu130 index lacks cuda-bindings>=13.0.3). Without libibverbs and the mlx5 provider NCCL across nodes uses TCP."""
    imported = import_offline(tmp_path)
    assert not imported["warnings"], imported["warnings"]
    assert imported["app"] == "nanopt"
    assert imported["cluster"] is None  # only defined when multi-node is asked for
    calls = imported["pip"]
    assert [list(packages) for packages, _ in calls] == modal_app.pip_layers()
    assert calls[0][0] == ("torch==2.11.0",)  # its own layer, pinned
    assert all(kw == {} for _, kw in calls), calls  # no index_url, extra_index_url, find_links or pip options
    assert {"libibverbs1", "ibverbs-providers"} <= set(imported["apt"])
    imported = import_offline(tmp_path, NANOPT_MODAL_NODES="2", NANOPT_MODAL_FLASH_ATTN_WHEEL=WHEEL)
    assert imported["cluster"] == (2, True, [("H100", 8)], 10)
    calls = imported["pip"]
    assert [list(packages) for packages, _ in calls] == modal_app.pip_layers(WHEEL)
    assert calls[0] == (("torch==2.11.0",), {}) and calls[-1] == ((WHEEL,), {})


@pytest.mark.slow
@pytest.mark.parametrize("target, flags", [
    ("modal_app.py", ("--config", "--gpus", "--gpu-type", "--run-name", "--prepare")),
    # `::sweep` must not be a second local entrypoint: `modal run modal_app.py --config ...` would then be ambiguous
    ("modal_app.py::sweep", ("--config", "--sets", "--seeds", "--name", "--gpus", "--gpu-type")),
])
def test_modal_run_help_works_offline_and_shows_the_flags(tmp_path, target, flags):
    out = offline(tmp_path, "-m", "modal", "run", target, "--help")
    for flag in flags:
        assert flag in out


# ---------------------------------------------------------------- function specs and the image
def test_function_specs():
    info = modal_app.train.info()
    assert info.gpus == [("H100", 8)] and info.timeout == 24 * 60 * 60 and info.max_retries == 10
    assert list(info.volumes) == [modal_app.VOLUME_PATH]
    assert any("huggingface" in s for s in info.secrets)
    assert info.cluster_info is None and not hasattr(modal_app, "train_multinode")  # multi-node only when asked
    # Host resources for 8 ranks: 4 cores each; 12 GiB each plus 16 GiB for rank 0's host copy of a checkpoint.
    assert (info.cpu, info.memory_mib) == (32.0, (16 + 8 * 12) * 1024)
    other = modal_app.train.with_options(gpu="A100-80GB:4").info()
    assert other.gpus == [("A100-80GB", 4)] and other.max_retries == 10  # the rest of the spec is kept
    evaluate, prepare, driver, board, bench = (f.info() for f in (
        modal_app.evaluate, modal_app.prepare_data, modal_app.prepare_then_train, modal_app.tensorboard_app,
        modal_app.bench))
    assert evaluate.gpus and evaluate.gpus[0][0] == modal_app.EVAL_GPU and evaluate.gpus[0][1] == 1
    assert prepare.gpus == [] and prepare.cpu == modal_app.PREPARE_CPUS
    # --prepare's driver holds no GPU while prepare runs, and waits as long as prepare may take.
    assert driver.gpus == [] and driver.timeout == prepare.timeout == 24 * 60 * 60
    assert board.web_info is not None
    assert bench.gpus == [("H100!", 1)]  # "!": its timings are H100 timings, never an H200's
    # Reserved host: cores for its runs' compile workers, memory for a 1B checkpoint's host copy.
    assert (bench.cpu, bench.memory_mib) == (modal_app.BENCH_CPUS, 64 * 1024) and modal_app.BENCH_CPUS >= 8
    assert 64 * 1024 > modal_app.train_resources(1)["memory"]
    for spec in (info, evaluate, prepare, board, bench):  # bench: the Volume keeps gpu_check's files
        assert spec.volumes[modal_app.VOLUME_PATH].name == "nanopt"


def test_the_image_is_the_stack_gpu_check_measured_with_every_dependency_of_the_package():
    """Python, torch and its CUDA build as bench/gpu_check.py recorded them for the 51.3% MFU run; torchao for
    train.fp8; no flash-attn unless a wheel is given (gpu_check never measured it: `auto` picks SDPA)."""
    env = json.loads((REPO / "bench" / "results" / "gpu_check_h100_shipped.json").read_text())["env"]
    assert env["torch"] == f"{modal_app.TORCH_VERSION}+cu130"  # PyPI's torch 2.11.0 wheel is this CUDA 13.0 build
    assert env["python"].startswith(modal_app.PYTHON_VERSION + ".")
    assert modal_app.TORCH_PACKAGE == f"torch=={modal_app.TORCH_VERSION}"
    assert f"torchao=={modal_app.TORCHAO_VERSION}" in modal_app.PIP_PACKAGES
    assert "lm-eval>=0.4.13" in modal_app.PIP_PACKAGES  # --quick's harness section runs, not skipped
    assert "gcc" in modal_app.APT_PACKAGES  # Triton's launchers, under torch.compile
    assert modal_app.FLASH_ATTN_WHEEL == "" and not any("flash" in p for p in modal_app.PIP_PACKAGES)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    installed = {re.split("[=<>]", p)[0].strip().lower() for p in [modal_app.TORCH_PACKAGE, *modal_app.PIP_PACKAGES]}
    for requirement in project["dependencies"] + extras["data"] + extras["profile"]:
        name = re.split("[=<>]", requirement)[0].strip().lower()
        assert name in installed, f"{name} (pyproject) is not installed in the Modal image"


# ---------------------------------------------------------------- commands
def test_torchrun_eval_prepare_and_bench_commands():
    readme = (REPO / "docs" / "modal.md").read_text()  # what the Modal page says
    config = f"{modal_app.VOLUME_PATH}/runs/<name>/{modal_app.RUN_CONFIG_NAME}"
    single = modal_app.torchrun_command(config, "<n>")
    assert single == ["torchrun", "--standalone", "--nproc-per-node=<n>", "-m", "nanopt.main", "--config", config]
    assert " ".join(single) in readme
    assert " ".join(modal_app.torchrun_command(config, "<n>", "<nodes>", "<rank>", "<container 0>")) in readme
    assert modal_app.torchrun_command("c.yaml", 8) == \
        ["torchrun", "--standalone", "--nproc-per-node=8", "-m", "nanopt.main", "--config", "c.yaml"]
    assert modal_app.eval_command("runs/1b", "val")[1:] == ["-m", "nanopt.cli", "eval", "runs/1b", "--split", "val"]
    assert modal_app.prepare_command("c.yaml")[1:] == ["-m", "nanopt.cli", "prepare", "--config", "c.yaml"]
    assert modal_app.prepare_command("c.yaml", 32)[-1] == "--prepare.workers=32"
    # gpu_check's results go under bench/ on the Volume.
    assert modal_app.bench_command("gpu_check", "--quick", "/vol/bench/gpu_check-T")[1:] == \
        [str(REPO / "bench" / "gpu_check.py"), "--quick", "--out", "/vol/bench/gpu_check-T"]
    assert modal_app.bench_command("vs_hf", "--repeats 7")[1:] == [str(REPO / "bench" / "vs_hf.py"), "--repeats", "7"]
    assert modal_app.bench_out_dir("gpu_check", "--quick", "20250101T000000Z") == "bench/gpu_check-20250101T000000Z"
    # Your own --out wins (either spelling); a bench without --out gets none.
    assert modal_app.bench_out_dir("gpu_check", "--quick --out runs/mine", "T") == ""
    assert modal_app.bench_out_dir("gpu_check", "--out=/vol/mine", "T") == ""
    assert modal_app.bench_out_dir("vs_hf", "--repeats 7", "T") == ""


def test_each_rank_gets_its_share_of_cores_unless_the_environment_says_otherwise(vol, launched, monkeypatch):
    """The training function's torchrun gets CPU_PER_GPU threads per rank (run_forwarding_signals is replaced)."""
    config_yaml, cfg = modal_app.check_config(TINY, 2, "threads")
    assert modal_app.train.local(config_yaml, cfg.run.name, 2)["exit_code"] == 0
    cmd, cwd, env = launched.call_args.args
    assert cmd[:3] == ["torchrun", "--standalone", "--nproc-per-node=2"] and cwd == str(vol.dir)
    cores = str(int(modal_app.CPU_PER_GPU))
    assert tuple(env[k] for k in THREAD_KEYS) == (cores, "PASSIVE", cores)
    assert modal_app.rank_thread_env(4) == {"OMP_NUM_THREADS": "4", "OMP_WAIT_POLICY": "PASSIVE",
                                            "TORCHINDUCTOR_COMPILE_THREADS": "4"}
    assert "TORCHINDUCTOR_COMPILE_THREADS" not in modal_app.launch_env()  # eval and prepare: left alone
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # e.g. set in the image or a Secret: it wins
    env = modal_app.launch_env(4)
    assert tuple(env[k] for k in THREAD_KEYS) == ("4", "ACTIVE", "4")
    assert str(REPO) in env["PYTHONPATH"].split(os.pathsep)


@pytest.mark.parametrize("overrides, world, nodes, launched_as", [
    (["--runtime.parallel=fsdp"], 16, 2, ("hsdp", 8)),  # across nodes: a shard group per node, the nodes replicas
    (["--runtime.parallel=fsdp"], 8, 1, ("fsdp", None)),  # one node: fsdp as asked
    (["--runtime.parallel=fsdp"], 2, 2, ("fsdp", None)),  # one GPU per node: only fsdp shards at all
    (["--runtime.parallel=hsdp"], 16, 2, ("hsdp", None)),  # hsdp as asked; null = GPUs per node, checked as 8
    (["--runtime.parallel=hsdp", "--runtime.shard_group_size=4"], 16, 2, ("hsdp", 4)),
    ([], 16, 2, ("ddp", None)),
])
def test_fsdp_across_nodes_runs_as_hsdp_with_a_shard_group_per_node(tmp_path, capsys, overrides, world, nodes,
                                                                     launched_as):
    path = str(config_file(tmp_path, "--train.global_batch_tokens=2048", *overrides))  # splits over 16 ranks
    config_yaml, cfg = modal_app.check_config(path, world, "p", nodes)
    assert (cfg.runtime.parallel, cfg.runtime.shard_group_size) == launched_as
    assert f"parallel: {launched_as[0]}" in config_yaml  # what the Volume's config, so every node, runs
    said = "modal_app: runtime.parallel fsdp on 2 nodes runs as hsdp: each node's 8 GPUs shard the model"
    assert (said in capsys.readouterr().out) == (launched_as == ("hsdp", 8) and "fsdp" in overrides[0])


def test_hsdp_whose_groups_do_not_tile_the_world_is_refused_before_paying(tmp_path):
    path = config_file(tmp_path, "--train.global_batch_tokens=2048", "--runtime.parallel=hsdp",
                       "--runtime.shard_group_size=5")
    with pytest.raises(ConfigError) as e:
        modal_app.check_config(str(path), 16, "p", 2)
    assert "`runtime.shard_group_size` is 5, which does not divide the world of 16 ranks" in str(e.value)


def test_bench_runs_the_quick_gpu_check_into_the_volume_and_commits_it_even_when_it_fails(vol, launched, capsys):
    """`modal run modal_app.py::bench --args "--quick"`: gpu_check, its files under bench/ on the Volume, committed,
    and the command that fetches them printed; run from the Volume root with one rank's threads. A failed check's
    partial files are the ones worth reading: committed whether it exits 1 or the launch raises."""
    assert modal_app.bench.local(args="--quick") == 0  # gpu_check is the default
    assert vol.volume.commit.call_count == 1
    cmd, cwd, env = launched.call_args.args
    assert cmd[1:3] == [str(REPO / "bench" / "gpu_check.py"), "--quick"] and cwd == str(vol.dir)
    assert cmd[3] == "--out" and Path(cmd[4]).parent == vol.dir / "bench"
    assert Path(cmd[4]).name.startswith("gpu_check-") and Path(cmd[4]).name.endswith("Z")  # a UTC time stamp
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == str(int(modal_app.BENCH_CPUS))
    assert f"modal volume get nanopt bench/{Path(cmd[4]).name}" in capsys.readouterr().out
    # Your own --out is kept and nothing is added.
    assert modal_app.bench.local(name="gpu_check", args="--quick --out runs/mine") == 0
    assert launched.call_args.args[0][2:] == ["--quick", "--out", "runs/mine"]
    launched.return_value = (1, None)
    assert modal_app.bench.local("gpu_check", "--quick") == 1  # the bench's exit code is passed on
    assert vol.volume.commit.call_count == 3
    launched.side_effect = RuntimeError("lost the GPU")
    with pytest.raises(RuntimeError, match="lost the GPU"):
        modal_app.bench.local("gpu_check", "--quick")
    assert vol.volume.commit.call_count == 4


@pytest.mark.slow
def test_bench_function_runs_a_real_bench(vol, capfd):
    with pytest.raises(ValueError, match="vs_hf, ladder"):
        modal_app.bench_command("ddp")  # a CPU-only bench is refused, naming the ones that make sense
    # .local() runs the real bench script (here on CPU, at a toy shape) and passes its exit code on.
    args = ("--dim 32 --layers 1 --heads 2 --kv-heads 1 --ffn 64 --vocab 64 --seq 16 --batch 2 --repeats 1 "
            "--profile-rounds 1 --precisions fp32 --no-compile")
    vol.dir.mkdir()
    assert modal_app.bench.local("vs_hf", args) == 0
    out = capfd.readouterr().out
    assert "RATIO fp32: nanopt/HF" in out and "CEILING fp32" in out


# ---------------------------------------------------------------- outcomes
def test_finish_retries_preemptions_and_progress_but_not_what_would_repeat():
    finish, Retry = modal_app.finish, modal_app.RetryAttempt
    assert finish("training", "r", 0, None)["exit_code"] == 0
    # Bad input and divergence: reported, never retried. torchrun says 1 for any failed worker; the workers'
    # own codes decide, and ranks that torchrun stopped after another rank's bad input record 75.
    assert "Not retried" in finish("training", "r", 2, None)["error"]
    assert finish("training", "r", 1, None, (2, 75), 2, progressed=True)["exit_code"] == 2
    assert "non-finite" in finish("training", "r", 1, None, (3, 3), 2)["error"]
    # Preempted (every worker stopped resumably, e.g. at run.time_limit_s, or the container got a signal).
    with pytest.raises(Retry, match="resumably") as preempted:
        finish("training", "r", 1, None, (75, 75), 2)
    assert preempted.value.exit_code == 75
    with pytest.raises(Retry, match="interrupted") as signalled:
        finish("training", "r", 0, signal.SIGINT)  # the attempt must not count as done
    assert signalled.value.exit_code == 75
    # A crash: one rank died without recording a code, the other was stopped by torchrun (75). Without a
    # newer checkpoint a retry would repeat it (an OOM at step 0 would run 11 times on 8 GPUs): reported.
    crashed = finish("training", "r", 1, None, (75,), 2, progressed=False)
    assert crashed["exit_code"] == 1 and "Not retried" in crashed["error"]
    assert finish("training", "r", -9, None, (), 2)["exit_code"] == 1  # killed by a signal: still an exit status
    with pytest.raises(Retry, match="newer checkpoint") as progressed:
        finish("training", "r", 1, None, (75,), 2, progressed=True)
    assert progressed.value.exit_code == 1
    # Modal pickles the last attempt's exception to the entrypoint, which exits with its code.
    back = pickle.loads(pickle.dumps(modal_app.RetryAttempt("preempted", 75)))
    assert isinstance(back, modal_app.RetryAttempt) and (str(back), back.exit_code) == ("preempted", 75)


def test_time_limit_is_the_timeout_less_the_margin_unless_the_config_sets_a_smaller_one():
    day, margin = 24 * 60 * 60, modal_app.TIME_LIMIT_MARGIN_S
    assert 60 <= margin <= 30 * 60  # enough for the final checkpoint and the commit; cheap against 24 h
    assert modal_app.time_limit_args(0, day, 5) == [f"--run.time_limit_s={day - margin - 5}"]
    assert modal_app.time_limit_args(3600, day, 5) == []  # the user's own, shorter limit stands
    assert modal_app.time_limit_args(2 * day, day, 5) == [f"--run.time_limit_s={day - margin - 5}"]
    assert modal_app.time_limit_args(0, 60, 0) == ["--run.time_limit_s=60"]  # never 0 (= no limit)


def test_sigint_is_forwarded_to_the_launched_process(tmp_path):
    ready, got = tmp_path / "ready", tmp_path / "got"
    child = (
        "import signal, sys, time, pathlib\n"
        f"def handler(signum, frame):\n    pathlib.Path({str(got)!r}).write_text(str(signum)); sys.exit(0)\n"
        "signal.signal(signal.SIGINT, handler)\n"
        f"pathlib.Path({str(ready)!r}).write_text('1')\n"
        "time.sleep(60)\nsys.exit(1)\n"
    )

    def interrupt_when_ready() -> None:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # what Modal does to the container on preemption

    before = signal.getsignal(signal.SIGINT)
    threading.Thread(target=interrupt_when_ready, daemon=True).start()
    code, forwarded = modal_app.run_forwarding_signals([sys.executable, "-c", child], cwd=str(tmp_path))
    assert (code, forwarded) == (0, signal.SIGINT)
    assert got.read_text() == str(int(signal.SIGINT))
    assert signal.getsignal(signal.SIGINT) is before  # our handler is removed again


# ---------------------------------------------------------------- the function body, locally
def run_train_local(volume_dir: Path, config_path: Path, run_name: str, volume: Any = None, ranks: int = 2,
                    **overrides: object) -> dict:
    """train.local() on `ranks` CPU ranks with `volume_dir` as the Volume (`volume` its stand-in, a new mock if
    None); overrides are `section.key: value`."""
    with mock.patch.object(modal_app, "volume", volume or mock.MagicMock()), \
            mock.patch.object(modal_app, "VOLUME_PATH", str(volume_dir)):
        _, cfg = modal_app.check_config(str(config_path), ranks, run_name)  # where the run directory goes
        cfg_yaml = to_yaml(load_config(config_path, parse_overrides(
            [f"--run.name={run_name}", f"--run.dir={cfg.run.dir}", *(f"--{k}={v}" for k, v in overrides.items())])))
        return modal_app.train.local(cfg_yaml, run_name, ranks)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> SimpleNamespace:
    """train.local(), real torchrun (2 CPU ranks) on the tiny config + SMALL, twice on one run. The first attempt is
    preempted while its ranks are paused after step 3 (`first`: what it raised or returned, `launched`: its
    processes, `checkpoints`: the complete ones it left); the second (`result`, `volume`) resumes and finishes it."""
    tmp = tmp_path_factory.mktemp("modal")
    t = SimpleNamespace(volume_dir=tmp / "vol", run_dir=tmp / "vol" / "runs" / "modal-smoke", launched=[],
                        volume=mock.MagicMock(name="volume"))
    real_popen, this_thread = subprocess.Popen, threading.get_ident()

    def popen(*args: object, **kwargs: object) -> subprocess.Popen:
        proc = real_popen(*args, **kwargs)
        if threading.get_ident() == this_thread:  # process-wide: tests/xla_jobs.py's threads start runs too
            t.launched.append(proc)
        return proc

    def interrupt_when_paused() -> None:
        markers = [t.run_dir / f".test_paused.rank{r}" for r in (0, 1)]
        deadline = time.monotonic() + 120
        while not all(m.exists() for m in markers) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(t.launched[0].pid, signal.SIGINT)  # torchrun runs in its own session: this is its group

    with pytest.MonkeyPatch.context() as env:
        env.setenv("NANOPT_TEST_HOOK", "pause:3")
        env.setenv("OMP_NUM_THREADS", "1")
        threading.Thread(target=interrupt_when_paused, daemon=True).start()
        with mock.patch.object(subprocess, "Popen", popen):
            try:
                t.first = run_train_local(t.volume_dir, config_file(tmp), "modal-smoke")
            except Exception as e:  # RetryAttempt, as it should; anything else is the sigint test's failure
                t.first = e
        t.checkpoints = sorted(p.name for p in (t.run_dir / "checkpoints").glob("step_*") if (p / "COMPLETE").exists())
        env.delenv("NANOPT_TEST_HOOK")
        t.result = run_train_local(t.volume_dir, config_file(tmp), "modal-smoke", t.volume)
    return t


@pytest.mark.slow
def test_training_function_resumes_a_preempted_attempt_to_the_uninterrupted_runs_weights(trained, tmp_path):
    """Real torchrun (2 CPU ranks) under the training function, SIGINT to its process group while the ranks are
    paused after step 3: the attempt raises RetryAttempt (Modal retries it), step 3's checkpoint is complete, and the
    next attempt resumes and ends with the uninterrupted run's weights and losses. That run is one process, trained
    here: two ddp ranks average their gradients as exactly as one process accumulates them (e2e/test_resume.py)."""
    attempt = trained.first
    assert isinstance(attempt, modal_app.RetryAttempt), attempt
    assert attempt.exit_code == 75 and "resumably" in str(attempt)
    assert len(trained.launched) == 1 and trained.launched[0].poll() is not None
    assert trained.checkpoints == ["step_000003"]
    run_dir = trained.run_dir
    assert trained.result == {"run_dir": str(run_dir), "exit_code": 0}
    assert (run_dir / modal_app.RUN_CONFIG_NAME).exists()
    assert load_config(run_dir / modal_app.RUN_CONFIG_NAME).run.dir == "runs/modal-smoke"
    assert max(line["step"] for line in records(run_dir)) == 6
    assert (run_dir / "checkpoints" / "step_000006" / "COMPLETE").exists()
    assert any((run_dir / "tb").iterdir())
    # The trainer was told to stop before Modal's 24 h timeout, leaving the margin for the last checkpoint.
    limit = load_config(run_dir / "config.yaml").run.time_limit_s
    assert 24 * 60 * 60 - modal_app.TIME_LIMIT_MARGIN_S - 60 < limit <= 24 * 60 * 60 - modal_app.TIME_LIMIT_MARGIN_S
    assert trained.volume.commit.call_count >= 2  # after writing the config, and after torchrun exited
    reference = tmp_path / "reference"
    assert run(["--config", str(config_file(tmp_path)), f"--run.dir={reference}"]) == 0
    final = Path("checkpoints") / "step_000006" / "model.safetensors"
    assert (trained.run_dir / final).read_bytes() == (reference / final).read_bytes()
    losses = [[(r["step"], r["loss"]) for r in records(d) if "loss" in r] for d in (trained.run_dir, reference)]
    assert losses[0] == losses[1]


TENSORBOARD = """
import json, sys, time, modal_app
from unittest import mock
from werkzeug.test import Client
modal_app.volume = mock.MagicMock()
client = Client(modal_app.tensorboard_wsgi(sys.argv[1]))
assert client.get('/').status_code == 200 and modal_app.volume.reload.call_count == 1
plugins = json.loads(client.get('/data/plugins_listing').data)
for _ in range(100):
    runs = json.loads(client.get('/data/runs').data)
    if runs: break
    time.sleep(0.1)
print(json.dumps({'plugins': sorted(plugins), 'runs': runs}))
"""


@pytest.mark.slow
def test_tensorboard_serves_the_runs_with_the_profiler_plugin(trained, tmp_path):
    seen = json.loads(offline(tmp_path, "-c", TENSORBOARD, str(trained.volume_dir / "runs")).strip().splitlines()[-1])
    assert "scalars" in seen["plugins"] and "pytorch_profiler" in seen["plugins"]
    assert seen["runs"] == ["modal-smoke/tb"]


@pytest.mark.slow
def test_bad_data_under_torchrun_is_reported_not_retried(vol, capfd):
    """Real torchrun (one CPU rank: a worker's code is what decides) on a config whose shards do not exist: torchrun
    exits 1, the worker records 2, and the function returns the error instead of raising (which would make Modal
    retry)."""
    (vol.dir / "empty").mkdir(parents=True)
    config_yaml, cfg = modal_app.check_config(str(config_file(vol.dir.parent)), 1, "no-data")
    config_yaml = config_yaml.replace("source: embedded", "source: empty")
    assert "source: empty" in config_yaml
    result = modal_app.train.local(config_yaml, cfg.run.name, 1)
    assert result["exit_code"] == 2 and "Not retried" in result["error"], result
    assert "train_*.bin" in capfd.readouterr().err  # nanopt's own one-paragraph error reached the log


@pytest.mark.slow
def test_a_crash_without_progress_is_reported_and_one_after_progress_is_retried(tmp_path, monkeypatch):
    """The rank SIGKILLs itself in step 3 (NANOPT_TEST_HOOK), like a CUDA OOM or an NCCL abort: torchrun exits 1
    and no worker records a code (one rank: with two, every rank dies alike). With no checkpoint saved in the
    attempt, retrying would repeat the crash: the result says so and `modal run` exits 1. With checkpoint.every=2
    it saved step 2 first: retried."""
    monkeypatch.setenv("NANOPT_TEST_HOOK", "kill-in-step:3")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    volume_dir = tmp_path / "vol"
    result = run_train_local(volume_dir, config_file(tmp_path), "crash", ranks=1)
    assert result["exit_code"] == 1 and "without saving a newer checkpoint" in result["error"], result
    with pytest.raises(modal_app.RetryAttempt, match="newer checkpoint"):
        run_train_local(volume_dir, config_file(tmp_path), "crash", ranks=1, **{"checkpoint.every": 2})
    assert (volume_dir / "runs" / "crash" / "checkpoints" / "step_000002" / "COMPLETE").exists()


# ---------------------------------------------------------------- the local entrypoint
@pytest.fixture
def remote_calls(monkeypatch):
    """Replace every Modal function the entrypoint could call; nothing may reach Modal. Training succeeds
    unless a test says otherwise."""
    names = ("train", "prepare_data", "prepare_then_train", "tensorboard_app", "wait_for_call")
    fakes = {name: mock.MagicMock(name=name) for name in names}
    for name, fake in fakes.items():
        monkeypatch.setattr(modal_app, name, fake)
    fakes["train"].with_options.return_value.remote.return_value = {"run_dir": "/vol/runs/t1", "exit_code": 0}
    return fakes


@pytest.mark.parametrize("bad, gpus, words", [("train:\n  max_stepz: 5\n", 8, "max_stepz"),
                                              (None, 3, "global_batch_tokens")])  # a batch 3 GPUs do not divide
def test_entrypoint_rejects_bad_input_before_any_remote_call(remote_calls, tmp_path, capsys, bad, gpus, words):
    (tmp_path / "bad.yaml").write_text(bad or "")
    with pytest.raises(SystemExit) as exit_info:
        modal_app.main(config=str(tmp_path / "bad.yaml") if bad else TINY, gpus=gpus)
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err
    for fake in remote_calls.values():
        assert not fake.mock_calls


def test_entrypoint_sends_the_validated_config_to_the_training_function(remote_calls, capsys):
    modal_app.main(config=TINY, gpus=2, gpu_type="A100", run_name="t1")
    train = remote_calls["train"]
    assert train.with_options.call_args.kwargs["gpu"] == "A100:2"
    assert train.with_options.call_args.kwargs["cpu"] == 8.0  # host resources follow the GPU count
    config_yaml, name, gpus = train.with_options.return_value.remote.call_args.args
    assert (name, gpus) == ("t1", 2)
    assert "dir: runs/t1" in config_yaml
    assert not remote_calls["prepare_data"].mock_calls and not remote_calls["prepare_then_train"].mock_calls
    out = capsys.readouterr().out
    assert "runs/t1" in out and "tensorboard" in out and "done:" in out


def test_entrypoint_prepare_hands_the_whole_sequence_to_modal(remote_calls):
    """--prepare: one remote call prepares and then starts training, so a --detach run whose laptop leaves
    during prepare still trains; the entrypoint only waits for the training call it started."""
    remote_calls["prepare_then_train"].remote.return_value = {"call_id": "fc-123"}
    remote_calls["wait_for_call"].return_value = {"run_dir": "/vol/runs/t1", "exit_code": 0}
    modal_app.main(config=TINY, gpus=2, gpu_type="A100", run_name="t1", prepare=True)
    config_yaml, name, gpus, gpu_spec, wandb, nodes = remote_calls["prepare_then_train"].remote.call_args.args
    assert (name, gpus, gpu_spec, wandb, nodes) == ("t1", 2, "A100:2", False, 1) and "dir: runs/t1" in config_yaml
    remote_calls["wait_for_call"].assert_called_once_with("fc-123")
    assert not remote_calls["prepare_data"].mock_calls  # never from here: the laptop may be gone
    assert not remote_calls["train"].with_options.return_value.remote.mock_calls


def test_prepare_then_train_prepares_on_cpu_then_spawns_training_on_the_gpus(monkeypatch):
    remote_calls = {name: mock.MagicMock(name=name) for name in ("train", "prepare_data")}
    for name, fake in remote_calls.items():
        monkeypatch.setattr(modal_app, name, fake)
    prepare, spawn = remote_calls["prepare_data"].remote, remote_calls["train"].with_options.return_value.spawn
    order = mock.Mock()
    order.attach_mock(prepare, "prepare")
    order.attach_mock(spawn, "spawn")
    prepare.return_value, spawn.return_value.object_id = 0, "fc-9"
    assert modal_app.prepare_then_train.local("YAML", "t1", 2, "H100:2") == {"call_id": "fc-9"}
    assert [c[0] for c in order.mock_calls] == ["prepare", "spawn"]
    assert order.mock_calls[1].args == ("YAML", "t1", 2)
    assert remote_calls["train"].with_options.call_args.kwargs["gpu"] == "H100:2"
    # prepare failed: no GPUs are started, and the entrypoint gets prepare's exit code.
    prepare.return_value = 2
    spawn.reset_mock()
    result = modal_app.prepare_then_train.local("YAML", "t1", 2, "H100:2")
    assert result["exit_code"] == 2 and "not started" in result["error"]
    assert not spawn.mock_calls


@pytest.mark.parametrize("outcome, code, words", [
    # `modal run` must not exit 0 when training refused its input (2) or diverged (3), ...
    (modal_app.finish("training", "t1", 1, None, (2, 75), 2), 2, "rejected its config"),
    (modal_app.finish("training", "t1", 1, None, (3, 75), 2), 3, "non-finite loss"),
    # ... and exits with the code of the last attempt Modal allowed, or 1 for anything else Modal raises.
    (modal_app.RetryAttempt("training stopped resumably (exit code 75)", 75), 75, "stopped resumably"),
    (ConnectionError("lost the connection"), 1, "lost the connection"),
])
def test_entrypoint_exits_with_the_status_of_training_that_failed(remote_calls, capsys, outcome, code, words):
    remote = remote_calls["train"].with_options.return_value.remote
    if isinstance(outcome, Exception):
        remote.side_effect = outcome
    else:
        remote.return_value = outcome
    with pytest.raises(SystemExit) as exit_info:
        modal_app.main(config=TINY, gpus=2, run_name="t1")
    assert exit_info.value.code == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and err[0].startswith("modal_app: error:")


# ---------------------------------------------------------------- sweeps
def test_sweep_spawns_one_container_per_grid_point_and_skips_finished_ones(vol, remote_calls, capsys):
    """`modal run modal_app.py::sweep`: nanopt sweep's grid, each point its own training call on the Volume
    under runs/NAME/POINT; a point whose summary.json shows max_steps is not paid for again; a failed point is
    reported, the others finish, and the driver raises so that `modal run` exits 1."""
    max_steps = load_config(TINY).train.max_steps
    for point, steps in (("optim.name=muon,seed=1337", max_steps), ("optim.name=adamw,seed=1338", max_steps - 1)):
        (vol.dir / "runs" / "s" / point).mkdir(parents=True)  # the second stopped early: run again (resumes)
        (vol.dir / "runs" / "s" / point / "summary.json").write_text(json.dumps({"steps": steps}))
    train = remote_calls["train"]
    spawned = train.with_options.return_value.spawn
    spawned.return_value.get.side_effect = [{"exit_code": 0}, {"exit_code": 3, "error": "diverged"},
                                            {"exit_code": 0}]
    with pytest.raises(modal_app.SweepError, match="1 of 4 runs failed: s/optim.name=adamw,seed=1338"):
        modal_app.sweep.local(config="configs/tiny.yaml", sets="optim.name=adamw,muon", seeds=2, name="s", gpus=1,
                              gpu_type="A10G")
    assert train.with_options.call_args.kwargs["gpu"] == "A10G:1"
    names = [c.args[1] for c in spawned.call_args_list]
    assert names == ["s/optim.name=adamw,seed=1337", "s/optim.name=adamw,seed=1338", "s/optim.name=muon,seed=1338"]
    yaml_text = spawned.call_args_list[2].args[0]
    assert "dir: runs/s/optim.name=muon,seed=1338" in yaml_text and "seed: 1338" in yaml_text
    out = capsys.readouterr().out
    assert "muon,seed=1337: finished before, skipped" in out and "failed: diverged" in out
    assert "3 of 4 runs finished" in out


@pytest.mark.parametrize("kwargs, words", [
    (dict(config="configs/tiny.yaml", sets="optim.nmae=adamw,muon"), "optim.nmae"),
    (dict(config="/home/me/my.yaml", sets="optim.name=adamw,muon"), "configs/ directory"),
    (dict(config="configs/tiny.yaml"), "nothing to sweep")])
def test_sweep_rejects_a_bad_grid_before_any_container_starts(vol, remote_calls, kwargs, words):
    with pytest.raises(modal_app.SweepError, match=words):
        modal_app.sweep.local(**kwargs)
    for fake in remote_calls.values():
        assert not fake.mock_calls
