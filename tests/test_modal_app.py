"""modal_app.py, offline: Modal's servers are never contacted and no token is needed.

Nothing here runs on Modal itself. The training function's body runs locally with a temporary directory
standing in for the Volume and launches real torchrun on CPU.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from unittest import mock

import pytest

from conftest import REPO, SMALL

pytest.importorskip("modal")

import modal_app  # noqa: E402
from nanopt.config import load_config, parse_overrides, to_yaml  # noqa: E402


def offline_env(tmp_path: Path) -> dict[str, str]:
    """No token anywhere, and a server address nothing listens on: any network attempt would fail."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    env.update(MODAL_CONFIG_PATH=str(tmp_path / "no-modal.toml"), MODAL_SERVER_URL="http://127.0.0.1:9",
               HOME=str(tmp_path), PYTHONPATH=str(REPO))
    return env


class FakeVolume:
    """Stands in for the modal.Volume inside a container: counts commits and reloads."""

    def __init__(self) -> None:
        self.commits = 0
        self.reloads = 0

    def commit(self) -> None:
        self.commits += 1

    def reload(self) -> None:
        self.reloads += 1


def small_config(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(to_yaml(load_config(REPO / "configs" / "tiny.yaml", parse_overrides(SMALL))))
    return path


# ---------------------------------------------------------------- import and CLI, in fresh processes


def test_import_needs_no_token_or_network_and_warns_nothing_deprecated(tmp_path):
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import modal_app\n"
        "from modal.exception import DeprecationError, InternalAPIWarning\n"
        "bad = (DeprecationWarning, PendingDeprecationWarning, FutureWarning, DeprecationError, InternalAPIWarning)\n"
        "found = [f'{w.category.__name__}: {w.message}' for w in caught if issubclass(w.category, bad)]\n"
        "assert not found, found\n"
        "print('imported', modal_app.app.name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=offline_env(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "imported nanopt" in out.stdout


def test_modal_run_help_works_offline_and_shows_config(tmp_path):
    out = subprocess.run([sys.executable, "-m", "modal", "run", "modal_app.py", "--help"], capture_output=True,
                         text=True, cwd=REPO, env=offline_env(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--config", "--gpus", "--gpu-type", "--run-name", "--prepare"):
        assert flag in out.stdout


# ---------------------------------------------------------------- function specs


def test_training_function_spec():
    info = modal_app.train.info()
    assert info.gpus == [("H100", 8)]
    assert info.timeout == 24 * 60 * 60
    assert info.max_retries == 10
    assert list(info.volumes) == [modal_app.VOLUME_PATH]
    assert info.volumes[modal_app.VOLUME_PATH].name == "nanopt"
    assert any("huggingface" in s for s in info.secrets)
    assert info.cluster_info is None
    assert not hasattr(modal_app, "train_multinode")  # only defined when multi-node is asked for


def test_gpu_type_and_count_are_overridable():
    info = modal_app.train.with_options(gpu="A100-80GB:4").info()
    assert info.gpus == [("A100-80GB", 4)]
    assert info.max_retries == 10  # the rest of the spec is kept


def test_other_functions_spec():
    evaluate, prepare = modal_app.evaluate.info(), modal_app.prepare_data.info()
    assert evaluate.gpus and evaluate.gpus[0][0] == modal_app.EVAL_GPU and evaluate.gpus[0][1] == 1
    assert prepare.gpus == [] and prepare.cpu == modal_app.PREPARE_CPUS
    for info in (evaluate, prepare, modal_app.tensorboard_app.info()):
        assert info.volumes[modal_app.VOLUME_PATH].name == "nanopt"
    assert modal_app.tensorboard_app.info().web_info is not None


def test_bench_function_runs_a_real_bench(capfd):
    assert modal_app.bench.info().gpus == [(modal_app.BENCH_GPU, 1)]
    with pytest.raises(ValueError, match="vs_hf, ladder"):
        modal_app.bench_command("ddp")  # a CPU-only bench is refused, naming the ones that make sense
    # .local() runs the real bench script (here on CPU, at a toy shape) and passes its exit code on.
    args = ("--dim 32 --layers 1 --heads 2 --kv-heads 1 --ffn 64 --vocab 64 --seq 16 --batch 2 --repeats 1 "
            "--profile-rounds 1 --precisions fp32 --no-compile")
    assert modal_app.bench.local("vs_hf", args) == 0
    out = capfd.readouterr().out
    assert "RATIO fp32: nanopt/HF" in out and "CEILING fp32" in out


def test_multinode_is_a_cluster_when_asked_for(tmp_path):
    code = ("import modal_app\n"
            "info = modal_app.train_multinode.info()\n"
            "print(info.cluster_info.size, info.cluster_info.rdma, info.gpus, info.max_retries)\n")
    env = {**offline_env(tmp_path), "NANOPT_MODAL_NODES": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "True", "[('H100',", "8)]", "10"]


def test_image_installs_every_runtime_dependency_of_the_package():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["data"] + \
        project["optional-dependencies"]["profile"]
    names = {p.split("=")[0].split(">")[0].split("<")[0].strip().lower() for p in modal_app.PIP_PACKAGES}
    for requirement in wanted:
        name = requirement.split("=")[0].split(">")[0].split("<")[0].strip().lower()
        assert name in names, f"{name} (pyproject) is not installed in the Modal image"


# ---------------------------------------------------------------- commands


def test_flash_attn_comes_from_the_wheel_built_for_the_images_torch_and_python():
    wheel = modal_app.FLASH_ATTN_WHEEL
    assert wheel.endswith(".whl") and f"/v{modal_app.FLASH_ATTN_VERSION}/" in wheel
    assert "torch2.8cxx11abiTRUE" in wheel and "cp311-cp311" in wheel  # TORCH_VERSION 2.8.0, Python 3.11
    assert (modal_app.TORCH_VERSION, modal_app.PYTHON_VERSION) == ("2.8.0", "3.11")  # bump both together
    assert f"'{wheel}'" in modal_app.FLASH_ATTN_INSTALL and "attention uses sdpa" in modal_app.FLASH_ATTN_INSTALL


def test_torchrun_command_is_what_the_readme_says():
    readme = (REPO / "README.md").read_text()
    config = f"{modal_app.VOLUME_PATH}/runs/<name>/{modal_app.RUN_CONFIG_NAME}"
    single = modal_app.torchrun_command(config, "<n>")
    assert single == ["torchrun", "--standalone", "--nproc-per-node=<n>", "-m", "nanopt.main", "--config", config]
    assert " ".join(single) in readme
    multi = modal_app.torchrun_command(config, "<n>", "<nodes>", "<rank>", "<container 0>")
    assert " ".join(multi) in readme
    assert modal_app.torchrun_command("c.yaml", 8) == \
        ["torchrun", "--standalone", "--nproc-per-node=8", "-m", "nanopt.main", "--config", "c.yaml"]


def test_eval_and_prepare_commands_call_the_nanopt_cli():
    assert modal_app.eval_command("runs/1b", "val")[1:] == ["-m", "nanopt.cli", "eval", "runs/1b", "--split", "val"]
    assert modal_app.prepare_command("c.yaml")[1:] == ["-m", "nanopt.cli", "prepare", "--config", "c.yaml"]
    assert modal_app.prepare_command("c.yaml", 32)[-1] == "--prepare.workers=32"


def test_finish_retries_crashes_and_interruptions_but_not_config_errors():
    assert modal_app.finish("training", "r", 0, None)["exit_code"] == 0
    assert "error" in modal_app.finish("training", "r", 2, None)  # retrying cannot fix a bad config
    with pytest.raises(RuntimeError, match="code 1"):
        modal_app.finish("training", "r", 1, None)
    # torchrun says 1 for any failed worker; the workers' own codes decide. Ranks that torchrun stopped
    # after another rank's bad input record 75, and the bad input still wins.
    assert modal_app.finish("training", "r", 1, None, (2, 75))["exit_code"] == 2
    assert "non-finite" in modal_app.finish("training", "r", 1, None, (3, 3))["error"]
    with pytest.raises(RuntimeError, match="code 1"):
        modal_app.finish("training", "r", 1, None, (75, 75))  # preempted without a forwarded signal: retry
    with pytest.raises(RuntimeError, match="interrupted"):
        modal_app.finish("training", "r", 0, signal.SIGINT)  # preempted: the attempt must not count as done


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


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """train.local(): real torchrun (2 CPU ranks) on the tiny config + SMALL, a tmp dir as the Volume."""
    tmp = tmp_path_factory.mktemp("modal")
    fake = FakeVolume()
    with mock.patch.object(modal_app, "volume", fake), \
            mock.patch.object(modal_app, "VOLUME_PATH", str(tmp / "vol")):
        config_yaml, cfg = modal_app.check_config(str(small_config(tmp)), 2, "modal-smoke")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # .local() warns that the Volume is not mounted; that is the point
            result = modal_app.train.local(config_yaml, cfg.run.name, 2)
    return tmp / "vol", result, fake


def test_bad_data_under_torchrun_is_reported_not_retried(tmp_path, capfd):
    """Real torchrun (2 CPU ranks) on a config whose shards do not exist: torchrun exits 1, the workers
    record 2, and the function returns the error instead of raising (which would make Modal retry)."""
    fake = FakeVolume()
    with mock.patch.object(modal_app, "volume", fake), \
            mock.patch.object(modal_app, "VOLUME_PATH", str(tmp_path / "vol")):
        (tmp_path / "vol" / "empty").mkdir(parents=True)
        config_yaml, cfg = modal_app.check_config(str(small_config(tmp_path)), 2, "no-data")
        config_yaml = config_yaml.replace("source: embedded", "source: empty")
        assert "source: empty" in config_yaml
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = modal_app.train.local(config_yaml, cfg.run.name, 2)
    assert result["exit_code"] == 2 and "Not retried" in result["error"], result
    assert "train_*.bin" in capfd.readouterr().err  # nanopt's own one-paragraph error reached the log


def test_training_function_launches_torchrun_and_writes_the_run_directory(trained):
    volume_dir, result, fake = trained
    run_dir = volume_dir / "runs" / "modal-smoke"
    assert result == {"run_dir": str(run_dir), "exit_code": 0}
    assert (run_dir / modal_app.RUN_CONFIG_NAME).exists()
    assert load_config(run_dir / modal_app.RUN_CONFIG_NAME).run.dir == "runs/modal-smoke"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(line["step"] for line in lines) == 6
    assert (run_dir / "checkpoints" / "step_000006" / "COMPLETE").exists()
    assert any((run_dir / "tb").iterdir())
    assert fake.commits >= 2  # after writing the config, and after torchrun exited


def test_tensorboard_serves_the_runs_with_the_profiler_plugin(trained, tmp_path):
    volume_dir, _, _ = trained
    code = (
        "import json, time, modal_app\n"
        "from werkzeug.test import Client\n"
        "class FakeVolume:\n    reloads = 0\n    def reload(self): self.reloads += 1\n"
        "modal_app.volume = FakeVolume()\n"
        f"client = Client(modal_app.tensorboard_wsgi({str(volume_dir / 'runs')!r}))\n"
        "assert client.get('/').status_code == 200 and modal_app.volume.reloads == 1\n"
        "plugins = json.loads(client.get('/data/plugins_listing').data)\n"
        "for _ in range(100):\n"
        "    runs = json.loads(client.get('/data/runs').data)\n"
        "    if runs: break\n"
        "    time.sleep(0.1)\n"
        "print(json.dumps({'plugins': sorted(plugins), 'runs': runs}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=offline_env(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert "scalars" in seen["plugins"] and "pytorch_profiler" in seen["plugins"]
    assert seen["runs"] == ["modal-smoke/tb"]


# ---------------------------------------------------------------- the local entrypoint


@pytest.fixture
def remote_calls(monkeypatch):
    """Replace every Modal function the entrypoint could call; nothing may reach Modal."""
    fakes = {name: mock.MagicMock(name=name) for name in ("train", "prepare_data", "tensorboard_app")}
    for name, fake in fakes.items():
        monkeypatch.setattr(modal_app, name, fake)
    return fakes


def test_entrypoint_rejects_a_bad_config_before_any_remote_call(remote_calls, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_stepz: 5\n")
    with pytest.raises(SystemExit) as exit_info:
        modal_app.main(config=str(bad))
    assert exit_info.value.code == 2
    assert "max_stepz" in capsys.readouterr().err
    for fake in remote_calls.values():
        assert not fake.mock_calls


def test_entrypoint_rejects_a_batch_that_does_not_divide_over_the_gpus(remote_calls, capsys):
    with pytest.raises(SystemExit) as exit_info:
        modal_app.main(config=str(REPO / "configs" / "tiny.yaml"), gpus=3)
    assert exit_info.value.code == 2
    assert "global_batch_tokens" in capsys.readouterr().err
    assert not remote_calls["train"].mock_calls and not remote_calls["prepare_data"].mock_calls


def test_entrypoint_sends_the_validated_config_to_the_training_function(remote_calls, capsys):
    modal_app.main(config=str(REPO / "configs" / "tiny.yaml"), gpus=2, gpu_type="A100", run_name="t1",
                   prepare=True)
    train = remote_calls["train"]
    assert train.with_options.call_args.kwargs["gpu"] == "A100:2"
    config_yaml, name, gpus = train.with_options.return_value.remote.call_args.args
    assert (name, gpus) == ("t1", 2)
    assert "dir: runs/t1" in config_yaml
    remote_calls["prepare_data"].remote.assert_called_once_with(config_yaml, "t1")
    out = capsys.readouterr().out
    assert "runs/t1" in out and "tensorboard" in out
