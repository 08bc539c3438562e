"""`nanopt average` (nanopt/lab/averaging.py): the mean of a run's checkpoints, summed in fp32 and saved in each
tensor's dtype, is a checkpoint that eval and sample load like any other; every bad input is one paragraph, exit 2, and
nothing written."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import small_overrides
from safetensors.torch import load_file, save_file

from nanopt import cli, loading, rundirs
from nanopt.config import load_config, parse_overrides
from nanopt.lab import averaging
from nanopt.main import run
from nanopt.recipe.model import build_model
from nanopt.training import checkpoint

ARGS = small_overrides(**{"train.precision": "fp32", "train.max_steps": 6, "checkpoint.every": 2,
                          "log.tensorboard": "false"})


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with checkpoints at steps 2, 4, 6."""
    assert run([*ARGS, f"--run.dir={(out := tmp_path_factory.mktemp('average') / 'run')}"]) == 0
    return out


def _step(run_dir: Path, step: int) -> Path:
    return run_dir / rundirs.CHECKPOINTS_DIR / f"step_{step:06d}"


def test_the_average_is_the_mean_and_loads_evaluates_and_samples_like_any_checkpoint(trained, tmp_path, capsys):
    out = tmp_path / "avg"
    assert cli.run(["average", str(trained), "--steps", "2,6,4", "--out", str(out)]) == 0
    assert "averaged 3 checkpoints" in capsys.readouterr().out
    ckpt = _step(out, 6)  # named for the newest step averaged
    assert checkpoint.verify_checkpoint(ckpt) is None and not (ckpt / rundirs.DCP_DIR).exists()
    sources = [load_file(str(_step(trained, s) / rundirs.MODEL_FILE)) for s in (2, 4, 6)]
    loaded = loading.load(out)
    averaged_name = f"average of steps 2,4,6 of {trained.resolve()}"
    assert loaded.step == 6 and loaded.weights == averaged_name
    state = loaded.model.state_dict()
    for name in sources[0]:
        torch.testing.assert_close(state[name], sum(s[name] for s in sources) / 3, rtol=0, atol=1e-6)
    averaged = checkpoint.read_state(ckpt)["averaged_from"]
    assert [c["step"] for c in averaged["checkpoints"]] == [2, 4, 6]
    assert averaged["checkpoints"][0]["weights_crc32"] == checkpoint.weights_crc32(_step(trained, 2))
    assert cli.run(["eval", str(out)]) == 0
    record = json.loads((out / rundirs.EVALS_FILE).read_text())
    assert record["step"] == 6 and record["weights"] == averaged_name and record["val_loss"] > 0
    assert cli.run(["sample", str(out), "-n", "1", "--max-new-tokens", "4"]) == 0
    assert "1 samples from" in capsys.readouterr().out


def test_the_sum_is_fp32_and_each_tensor_keeps_its_dtype(tmp_path):
    """In bf16, 1 + 2^-8 rounds to 1, so a bf16 running sum of [1, 2^-8 x 2, ...] would lose the small terms."""
    for i, value in enumerate([1.0, 2**-8, 2**-8, 2**-8]):
        (tmp_path / f"c{i}").mkdir()
        save_file({"w": torch.full((2,), value, dtype=torch.bfloat16), "s": torch.full((1,), value)},
                  str(tmp_path / f"c{i}" / rundirs.MODEL_FILE))
    mean = averaging.mean_weights([tmp_path / f"c{i}" for i in range(4)])
    assert mean["w"].dtype == torch.bfloat16 and mean["s"].dtype == torch.float32
    expected = (1 + 3 * 2**-8) / 4
    assert mean["s"].item() == pytest.approx(expected)
    assert mean["w"][0].item() == torch.tensor(expected).to(torch.bfloat16).item()


def _foreign(ckpt: Path) -> None:
    """A wider model's checkpoint as step 8 (weights only): its name and its state agree, only the model differs."""
    cfg = load_config(None, parse_overrides([*ARGS, "--model.dim=32"]))
    checkpoint.save(ckpt.parent, 8, checkpoint.model_state(build_model(cfg.model, "cpu")), {"config": cfg.to_dict()},
                    keep=4)


def _one_tensor_less(ckpt: Path) -> None:
    weights = load_file(str(ckpt / rundirs.MODEL_FILE))
    weights.pop(sorted(weights)[0])
    save_file(weights, str(ckpt / rundirs.MODEL_FILE), metadata={"format": "pt"})


def _variant(trained: Path, root: Path, step: int, change, reseal: bool = True) -> str:
    """A copy of the run whose checkpoint of `step` is `change`d, then resealed: COMPLETE rewritten to match."""
    change(ckpt := _step(shutil.copytree(trained, root / "variant"), step))
    if reseal:
        files = {p.relative_to(ckpt).as_posix(): {"bytes": p.stat().st_size, "crc32": checkpoint.crc32_of(p)}
                 for p in ckpt.rglob("*") if p.is_file() and p.name != rundirs.COMPLETE_FILE}
        (ckpt / rundirs.COMPLETE_FILE).write_text(json.dumps({"step": checkpoint.step_of(ckpt), "files": files}))
    return str(root / "variant")


def _nonempty_out(root: Path) -> Path:
    (root / "taken").mkdir()
    (root / "taken" / "notes.txt").write_text("someone's files")
    return root / "taken"


def _no_safetensors(ckpt: Path) -> None:
    (ckpt / rundirs.MODEL_FILE).write_bytes(b"hello")


# (case id, argv builder (the trained run, scratch root) -> argv after `average`, words the message must contain)
CASES = [
    ("last_one", lambda r, t: [str(r), "--last", "1"], ["--last 1", "2 or more", "--last 3"]),
    ("last_too_many", lambda r, t: [str(r), "--last", "4"], ["3 checkpoint(s)", "steps 2, 4, 6"]),
    ("missing_step", lambda r, t: [str(r), "--steps", "2,5"], ["step 5", "it has steps 2, 4, 6"]),
    ("one_step", lambda r, t: [str(r), "--steps", "4"], ["--steps '4'", "two or more distinct"]),
    ("repeated_step", lambda r, t: [str(r), "--steps", "4,4"], ["two or more distinct"]),
    ("not_a_run", lambda r, t: [str(t), "--last", "2"], ["holds no checkpoints"]),
    ("out_not_empty", lambda r, t: [str(r), "--last", "2", "--out", str(_nonempty_out(t))],
     ["taken", "not empty", "never overwrites"]),
    ("other_config", lambda r, t: [_variant(r, t, 8, _foreign), "--last", "2"],
     ["different configs", "model.dim: 64 vs 32", "step_000008"]),
    ("other_tensors", lambda r, t: [_variant(r, t, 6, _one_tensor_less), "--steps", "4,6"],
     ["hold different tensors", "1 differ"]),
    ("first_no_safetensors", lambda r, t: [_variant(r, t, 4, _no_safetensors), "--steps", "4,6"],
     ["step_000004/model.safetensors is not a safetensors file"]),
    ("second_no_safetensors", lambda r, t: [_variant(r, t, 6, _no_safetensors), "--steps", "4,6"],
     ["step_000006/model.safetensors is not a safetensors file"]),
    ("incomplete", lambda r, t: [_variant(r, t, 6, lambda c: (c / rundirs.COMPLETE_FILE).unlink(), False),
                                 "--last", "2"], ["step_000006 cannot be averaged", "COMPLETE"]),
]


@pytest.mark.parametrize("case, argv, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_paragraph_exit_2_and_nothing_written(case, argv, words, trained, tmp_path, capsys):
    args = argv(trained, tmp_path)
    out = [] if "--out" in args else ["--out", str(tmp_path / "out")]
    assert cli.run(["average", *args, *out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanopt average: error: ") and err.strip().count("\n") == 0, err
    for word in words:
        assert word in err, f"{word!r} missing from: {err}"
    assert not (tmp_path / "out").exists()
    if case == "out_not_empty":
        assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]


OUTPUTS = {  # each command that writes an output directory or file: argv after `nanopt`, given the --out path
    "train": lambda run, out: ["train", *ARGS, f"--run.dir={out}"],
    "average": lambda run, out: ["average", str(run), "--last", "2", "--out", str(out)],
    "export": lambda run, out: ["export", str(run), "--out", str(out)],
    "plot": lambda run, out: ["plot", str(run), "-o", str(out / "curves.png")],
    "make-tasks": lambda run, out: ["eval", "--make-tasks", str(out)],
    "sweep": lambda run, out: ["sweep", "--set", "optim.name=adamw,muon", "--dir", str(out)],
}


@pytest.mark.parametrize("where", ["step_000004", "step_000010", ".tmp_step_000010", "step_000004/below", "link"])
@pytest.mark.parametrize("command", sorted(OUTPUTS))
def test_no_command_writes_inside_a_runs_checkpoints(command, where, trained, capsys):
    """A run replaces, prunes or removes its checkpoints/step_NNNNNN and .tmp_ directories as its own: an average
    (or export, plot, tasks, sweep) written there would be lost, and read by the run as a checkpoint."""
    ckpts = trained / rundirs.CHECKPOINTS_DIR
    if where == "link":  # a link elsewhere to one of the run's checkpoints
        where = ckpts.parent.parent / f"link-{command}"
        where.symlink_to(ckpts / "step_000004")
    before = sorted(str(p.relative_to(ckpts)) for p in ckpts.rglob("*"))
    assert cli.run(OUTPUTS[command](trained, ckpts / where)) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and f"checkpoint of the run {trained.resolve()}" in err, err
    assert sorted(str(p.relative_to(ckpts)) for p in ckpts.rglob("*")) == before
