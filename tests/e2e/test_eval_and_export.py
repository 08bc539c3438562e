"""Evaluation and export of trained runs: `nanopt eval` is deterministic and two ranks equal one, the speedrun clock
(a val loss or bpb target, the speedrun recipe), train.init_from=hf:DIR, and `nanopt export`: a round trip, or a
refusal (another model's files, a link, a full disk, a checkpoint directory, the opt-in model options)."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch
import yaml
from conftest import (ALL_ON, CPU, REPO, hf_logits, hf_tokenizer, one_paragraph, options_model, small_overrides,
                      transformers_model)
from safetensors import SafetensorError

from nanopt import hf, load_model
from nanopt.cli import run as cli
from nanopt.commands import export as export_command
from nanopt.config import ModelConfig, configs_dir
from nanopt.data import shards
from nanopt.errors import ConfigError
from nanopt.evals.checkpoint_eval import Evaluator, evaluate_checkpoint
from nanopt.hf import check_export_target, export_model
from nanopt.main import run
from nanopt.recipe.model import build_model
from nanopt.training import checkpoint, loader as data
from nanopt.training.checkpoint import newest_checkpoint
from nanopt.training.validation import evaluate

torch.set_num_threads(1)


def records(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def train(run_dir: Path, **changes) -> int:
    """A real training run, in this process (a subprocess would pay torch's import again)."""
    return run(small_overrides(**{"run.dir": run_dir, **changes}))


def cli_code(capsys, *args: object) -> tuple[int, str]:
    """`nanopt ARGS...` in this process: (exit status, stderr)."""
    capsys.readouterr()
    code = cli(list(map(str, args)))
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus_dir) -> Path:
    """8 steps with an easy target (reached, not stopping) and periodic validation."""
    run_dir = tmp_path_factory.mktemp("runs") / "easy"
    assert train(run_dir, **{"train.max_steps": 8, "eval.every": 4, "train.target_val_loss": 5.0}) == 0
    return run_dir


@pytest.mark.slow
def test_eval_checkpoint_is_deterministic_and_appends_to_its_own_file(trained_run, monkeypatch):
    before = (trained_run / "metrics.jsonl").read_bytes()
    assert cli(["eval", str(trained_run)]) == 0
    # The same checkpoint again, named another way: evaluated and printed, but its record is already there. And
    # verifying reads every byte: find_checkpoint's choice is not verified again by load().
    verified, real = [], checkpoint.verify_checkpoint
    monkeypatch.setattr(checkpoint, "verify_checkpoint",
                        lambda ckpt, *a: verified.append(Path(ckpt).name) or real(ckpt, *a))
    again = evaluate_checkpoint(trained_run / "checkpoints", Evaluator())
    assert again["step"] == 8 and verified == ["step_000008"]
    assert (trained_run / "metrics.jsonl").read_bytes() == before  # the trainer's log is left alone
    out_of_band = [r for r in records(trained_run, "evals.jsonl") if r.get("source") == "nanopt eval"]
    assert len(out_of_band) == 1 and out_of_band[0]["step"] == 8
    assert out_of_band[0]["val_loss"] == again["val_loss"] and out_of_band[0]["val_bpb"] == again["val_bpb"]
    # Same checkpoint, same fixed batches, same precision: the number the run logged at its last step.
    summary = summary_of(trained_run)
    assert out_of_band[0]["val_loss"] == pytest.approx(summary["final_val_loss"], abs=1e-6)
    assert cli(["eval", str(trained_run), "--split", "test"]) == 0
    assert records(trained_run, "evals.jsonl")[-1]["test_loss"] == pytest.approx(summary["test_loss"], abs=1e-6)


@pytest.fixture(scope="module", autouse=True)
def two_rank_eval(request) -> Iterator[SimpleNamespace]:
    """When test_two_rank_eval_equals_one_rank_eval is selected, `nanopt eval --batches 4` under torchrun (2 ranks,
    `proc`) of a copy of trained_run (`dir`), started before this file's first test so that it runs beside them."""
    if not any(item.name == "test_two_rank_eval_equals_one_rank_eval" for item in request.session.items):
        return (yield None)
    run_dir = shutil.copytree(request.getfixturevalue("trained_run"), request.getfixturevalue("tmp_path_factory")
                              .mktemp("copy") / "easy")
    with subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                           "nanopt.cli", "eval", str(run_dir), "--batches", "4"], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,  # a few lines: no pipe fills up
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}) as proc:
        yield SimpleNamespace(dir=run_dir, proc=proc)
        proc.kill()  # a no-op once it has exited


# ---------------------------------------------------------------- the speedrun clock
def test_a_target_reached_without_stop_at_target_is_recorded(trained_run):
    summary = summary_of(trained_run)
    assert summary["steps"] == 8  # reached but not asked to stop
    assert summary["target_reached"] and summary["step_to_target"] in (4, 8)
    assert 0 < summary["train_seconds_to_target"] <= summary["train_seconds"]
    assert "test_bpb" in summary


@pytest.mark.parametrize("metric, target", [("val_loss", 4.5), ("val_bpb", 6.5)])
def test_a_target_stops_the_run_where_it_is_reached(tmp_path, capsys, metric, target):
    """train.target_val_bpb races to bits per byte (the same target for any tokenizer), target_val_loss to loss."""
    run_dir = tmp_path / "stop"
    assert train(run_dir, **{"train.max_steps": 60, "eval.every": 2, f"train.target_{metric}": target,
                             "train.stop_at_target": "true"}) == 0
    summary, lines = summary_of(run_dir), records(run_dir)
    hit = next(r for r in lines if r.get(metric) is not None and r[metric] <= target)
    assert summary["target_reached"] and summary["step_to_target"] == hit["step"] == summary["steps"] < 60
    assert summary["tokens_to_target"] == summary["steps"] * 256 == summary["tokens_seen"]
    assert summary["train_seconds_to_target"] == summary["train_seconds"] > 0
    assert max(r["step"] for r in lines if "loss" in r) == summary["steps"]  # no step after the target
    assert all(r[metric] > target for r in lines if r.get(metric) is not None and r["step"] < hit["step"])
    capsys.readouterr()
    assert cli(["runs", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["run", "target", "to"]
    row = next(line for line in table if line.startswith("stop "))
    if metric == "val_bpb":
        assert summary["target_val_bpb"] == 6.5 and "target_val_loss" not in summary and "6.500 bpb" in row
    else:
        assert f"{summary['train_seconds_to_target']:.1f}" in row and f"{summary['final_val_loss']:.4f}" in row


def test_a_target_not_reached_is_said_at_the_end_and_in_the_summary(tmp_path, capsys):
    """Before, a run that could not reach its target (docs/speedrun.md's clock example) ran to max_steps and
    ended exactly like one that did."""
    unreachable = {"train.max_steps": 2, "eval.every": 1, "train.target_val_loss": 0.5, "train.stop_at_target": "true"}
    assert train(tmp_path, **unreachable) == 0
    summary = summary_of(tmp_path)
    assert summary["target_reached"] is False and summary["steps"] == 2 and not summary["stopped_at_target"]
    assert summary["best_val_loss"] == summary["final_val_loss"] and summary["best_val_bpb"] == summary["final_val_bpb"]
    out = capsys.readouterr().out
    assert (f"target val loss 0.5000 not reached in 2 steps (best val loss {summary['best_val_loss']:.4f}, val bpb "
            f"{summary['best_val_bpb']:.4f})") in out
    assert train(tmp_path, **unreachable) == 0
    assert "nothing to train" in (out := capsys.readouterr().out) and "target not reached" in out


@pytest.mark.slow
def test_the_speedrun_config_races_to_a_bpb_target_with_its_recipe(tmp_path, corpus_dir):
    """configs/speedrun-cpu.yaml (Muon, QK-norm, softcap, untied) on a prepared directory: the val bpb falls below an
    easy target well before max_steps, and the run stops there."""
    run_dir = tmp_path / "speedrun"
    assert run(["--config", str(configs_dir() / "speedrun-cpu.yaml"), f"--run.dir={run_dir}",
                f"--data.source={corpus_dir}", "--train.target_val_bpb=4.5", "--train.stop_at_target=true",
                "--eval.every=5", "--eval.batches=2", "--log.tensorboard=false", "--checkpoint.resume=false",
                "--eval.at_start=true"]) == 0  # the recipe skips the untrained weights' loss; this test checks it
    summary, config = summary_of(run_dir), yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["optim"]["name"] == "muon" and config["model"]["qk_norm"] and config["model"]["logit_softcap"] > 0
    assert summary["target_reached"] and summary["steps"] == summary["step_to_target"] < 100
    first = next(r["val_bpb"] for r in records(run_dir) if r.get("val_bpb") is not None)
    assert first > 7.5 and summary["final_val_bpb"] <= 4.5  # from ~8 bits per byte (uniform over 257) to the target


def test_init_from_hf_trains_from_those_weights(tmp_path, corpus_dir, capsys):
    directory = transformers_model(tmp_path / "hf", tied=True, vocab=257, rope_theta=10000.0)
    run_dir = tmp_path / "run"
    assert train(run_dir, **{"train.init_from": f"hf:{directory}", "train.max_steps": 1, "eval.every": 100,
                             "train.precision": "fp32"}) == 0
    step0 = next(r for r in records(run_dir) if r["step"] == 0 and "val_loss" in r)
    batches = data.eval_batches(data.TokenWindows(shards.split_paths(corpus_dir, "val"), 32), 4, 2, 0, 1, seed=0)
    expected, _ = evaluate(load_model(directory), batches, torch.tensor([1] * 256 + [0]), CPU)
    assert step0["val_loss"] == pytest.approx(expected, abs=1e-5)
    assert abs(expected - math.log(257)) > 0.01  # not what a fresh model would score
    capsys.readouterr()
    assert train(tmp_path / "bad", **{"model.dim": 32, "train.init_from": f"hf:{directory}"}) == 2
    err = capsys.readouterr().err
    assert "model.dim: 32 vs 64" in err and "--model.dim=64" in err


# ---------------------------------------------------------------- export: a complete model or a refusal
def test_export_cli_round_trip_of_a_trained_run(trained_run, tmp_path):
    assert cli(["export", str(trained_run), "--out", str(tmp_path / "hf")]) == 0
    idx = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = load_model(trained_run)(idx)
        assert (expected - hf_logits(tmp_path / "hf", idx)).abs().max().item() <= 1e-4
        assert torch.allclose(load_model(tmp_path / "hf")(idx), expected, atol=1e-6)  # nanopt reads its own export
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["bos_token_id"] == 256


def _other_model(directory: Path, tmp_path: Path) -> dict[str, bytes]:
    """Another model exported with a Hugging Face tokenizer, plus a user's own file: every file's bytes."""
    model = build_model(ModelConfig(vocab_size=300, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                    max_seq_len=16))
    export_model(model, directory, tokenizer=str(hf_tokenizer(tmp_path / "tok")))
    (directory / "NOTES.md").write_text("my notes on this model\n")
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def _links(tmp: Path) -> Path:
    """An --out whose model files are links: to the user's own weights, and to nothing."""
    (tmp / "victim.bin").write_bytes(b"the user's own weights")
    (tmp / "hf").mkdir()
    (tmp / "hf" / "model.safetensors").symlink_to(tmp / "victim.bin")
    (tmp / "hf" / "config.json").symlink_to(tmp / "dangling.json")
    return tmp / "hf"


def _snapshot(root: Path) -> dict[str, object]:
    """Every path below root (links not followed): a file's bytes, a link's target, a directory's None."""
    paths = [os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files]
    return {p: os.readlink(p) if os.path.islink(p) else Path(p).read_bytes() if os.path.isfile(p) else None
            for p in paths}


REFUSED = {  # what --out is -> (made by, flags, the start of its one paragraph, words in it, words not in it)
    "a file": (lambda t: t / "FILE", [], "{tmp}/FILE", ["--out"], []),
    "below a file": (lambda t: t / "FILE" / "sub", [], "{tmp}/FILE", ["--out"], []),
    "a dangling link": (lambda t: t / "gone", [], "{tmp}/gone", ["--out"], []),
    "model files that are links": (_links, [], "", ["is a symbolic link", "{tmp}/hf"], []),
    "model files that are links, --force": (_links, ["--force"], "", ["is a symbolic link", "{tmp}/hf"], []),
    "another model's files": (lambda t: _other_model(t / "hf", t) and t / "hf", [], "{tmp}/hf already holds another "
                              "model's files (", ["config.json", "model.safetensors", "tokenizer.json",
                                                  "tokenizer_config.json", "--force"], ["NOTES.md"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_out_that_cannot_take_the_export_is_exit_2_before_loading_and_nothing_changes(trained_run, tmp_path, capsys,
                                                                                         monkeypatch, case):
    made, flags, start, words, absent = REFUSED[case]
    (tmp_path / "FILE").write_text("a user's file\n")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    out, before = made(tmp_path), _snapshot(tmp_path)
    monkeypatch.setattr(export_command, "load", lambda *a, **k: pytest.fail("the checkpoint was loaded before --out"))
    code, err = cli_code(capsys, "export", trained_run, "--out", out, *flags)
    assert code == 2 and err.startswith("nanopt export: error: " + start.format(tmp=tmp_path))
    one_paragraph(err)
    assert all(w.format(tmp=tmp_path) in err for w in words) and not any(w in err for w in absent)
    assert _snapshot(tmp_path) == before  # refused: nothing written, removed, or written through a link


def test_export_with_force_replaces_another_models_whole_set(trained_run, tmp_path, capsys):
    out = tmp_path / "hf"
    before = _other_model(out, tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors", "config.json"} <= set(before)
    code, err = cli_code(capsys, "export", trained_run, "--out", out, "--force")
    assert code == 0, err
    # The byte-level run's export: its three files, nothing of the old model's tokenizer; the user's file kept.
    assert sorted(p.name for p in out.iterdir()) == ["NOTES.md", "config.json", "model.safetensors", "nanopt.json"]
    assert (out / "NOTES.md").read_bytes() == before["NOTES.md"]
    idx = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.allclose(load_model(out)(idx), load_model(trained_run)(idx), atol=1e-6)


@pytest.mark.parametrize("over", ["a new directory", "another model, --force"])
def test_a_full_disk_during_export_is_one_paragraph_exit_1_and_leaves_no_half_model(trained_run, tmp_path, capsys,
                                                                                    monkeypatch, over):
    out = tmp_path / "hf"
    before = _other_model(out, tmp_path) if over.startswith("another") else {}

    def save_file(tensors, filename, metadata=None):  # a full disk halfway through, as safetensors' writer says it
        Path(filename).write_bytes(b"\0" * 4096)
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                              'left on device" })')
    monkeypatch.setattr(hf, "save_file", save_file)
    code, err = cli_code(capsys, "export", trained_run, "--out", out, *(["--force"] if before else []))
    assert code == 1 and err.startswith("nanopt export: error: no space left on ")
    assert f"writing {out / 'model.safetensors'} (" in err and "GiB free; the weights need about " in err
    one_paragraph(err)
    # Exactly what was there: the old model whole, or nothing (no hidden folder, no partial weights).
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_export_refuses_a_checkpoint_directory_even_with_force(trained_run, tmp_path):
    ckpt, _ = newest_checkpoint(trained_run)
    with pytest.raises(ConfigError, match="a checkpoint of the run"):  # inside its run: the run would prune it
        check_export_target(ckpt, force=True)
    with pytest.raises(ConfigError, match="is a nanopt checkpoint directory"):
        check_export_target(shutil.copytree(ckpt, tmp_path / "copied"), force=True)


def test_cli_export_and_init_from_refuse_options_with_exit_2(tmp_path, corpus_dir, capsys):
    options = {f"model.{k}": str(v).lower() for k, v in ALL_ON.items()}
    assert train(tmp_path / "run", **{"train.max_steps": 2, "train.precision": "fp32", "log.tensorboard": "false",
                                      **options}) == 0
    code, err = cli_code(capsys, "export", tmp_path / "run", "--out", tmp_path / "hf")
    assert code == 2 and err.startswith("nanopt export: error: this model cannot be exported")
    one_paragraph(err)
    assert "model.value_embeddings=true" in err and "nanopt checkpoint directly" in err
    export_model(options_model(vocab_size=257, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128), tmp_path / "plain",
                 tokenizer="")
    assert train(tmp_path / "warm", **{"train.init_from": f"hf:{tmp_path / 'plain'}", "model.qk_norm": "true"}) == 2
    err = capsys.readouterr().err
    assert "model.qk_norm=true" in err and "--model.qk_norm=false" in err


# Last: its torchrun, started with this file, ran beside the tests above.
@pytest.mark.slow
def test_two_rank_eval_equals_one_rank_eval(two_rank_eval):
    (out, err), run_dir = two_rank_eval.proc.communicate(timeout=300), two_rank_eval.dir
    # Both ends of stderr: CI once saw rank 0 abort at exit ("terminate called without an active exception").
    assert two_rank_eval.proc.returncode == 0, out[-1000:] + err[:3000] + "\n...\n" + err[-2000:]
    two = records(run_dir, "evals.jsonl")[-1]
    one = evaluate_checkpoint(run_dir, Evaluator(batches=4))  # the same evaluation: not appended again
    assert (one["world_size"], two["world_size"]) == (1, 2) and records(run_dir, "evals.jsonl")[-1] == two
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-9)
    assert two["val_bpb"] == pytest.approx(one["val_bpb"], rel=1e-9)
    assert sum(r.get("world_size") == 2 for r in records(run_dir, "evals.jsonl")) == 1  # rank 0 alone appends
