"""Bad input anywhere a user types or points -> one paragraph naming the problem, exit code 2, no traceback: in-process
through nanopt.main.run / nanopt.cli.run, and as real processes where only a process shows what reaches the terminal."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, one_paragraph, run_module, small_overrides

from nanopt import cli
from nanopt.data.shards import HEADER, HEADER_BYTES, MAGIC, VERSION, open_shard, write_shard
from nanopt.main import run

ARGS = small_overrides(**{"train.precision": "fp32", "train.max_steps": 2, "log.tensorboard": "false"})


def _says(err: str, words, start: str = "nanopt: error: ", said: str | None = None) -> None:
    assert one_paragraph(err).startswith(start), err
    for word in words:
        assert word in (err if said is None else said), f"{word!r} missing from: {err if said is None else said}"


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in root.rglob("*")}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> dict[str, Path]:
    """Shard directories (and paths for run.dir), each with exactly one thing wrong."""
    root = tmp_path_factory.mktemp("bad")
    train, val = open_shard(corpus_dir / "train_000000.bin")[:20000], open_shard(corpus_dir / "val_000000.bin")[:5000]
    lying = np.asarray(train).astype(np.uint16) * 100  # a checksum that holds, a header that understates the vocab
    header = HEADER.pack(MAGIC, VERSION, 2, lying.size, 257, zlib.crc32(lying.tobytes()))

    def flip(p: Path) -> None:  # one token changed behind the checksum's back
        raw = bytearray(p.read_bytes())
        raw[HEADER_BYTES + 10] ^= 0x01
        p.write_bytes(bytes(raw))

    breaks = {"good": lambda p: None, "flipped": flip,
              "truncated": lambda p: p.write_bytes(p.read_bytes()[:-7]), "no_train": Path.unlink,
              "not_a_shard": lambda p: p.write_bytes(b"this is a text file, not tokens\n" * 10),
              "big_vocab": lambda p: write_shard(p, np.asarray(train), 50000),
              "tiny": lambda p: write_shard(p, train[:10], 257),
              "past_vocab": lambda p: p.write_bytes(header.ljust(HEADER_BYTES, b"\0") + lying.tobytes())}
    for name, damage in breaks.items():  # the train shard of a good shard directory, broken
        write_shard(root / name / "val_000000.bin", val, 257)
        damage(write_shard(root / name / "train_000000.bin", train, 257))
    (root / "a_file").write_text("not a directory")
    (root / "nonempty_run").mkdir()
    (root / "nonempty_run" / "notes.txt").write_text("someone's earlier run")
    return {"root": root, **{name: root / name for name in [*breaks, "a_file", "nonempty_run"]}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run for every test here: checkpoints at steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    assert run([*ARGS, "--checkpoint.every=1", "--checkpoint.keep=2", f"--run.dir={run_dir}"]) == 0
    return run_dir


# Bad input that reaches the data, the run directory or the runtime (the config's own rules: tests/test_config.py).
# (case id, argv with "{name}" for a path of `files`, words the message must contain)
CASES = [
    ("data_missing", ["--data.source={root}/no_such_dir"], ["no_such_dir", "nanopt prepare"]),
    ("shard_checksum", ["--data.source={flipped}"], ["train_000000.bin", "checksum"]),
    ("shard_truncated", ["--data.source={truncated}"], ["train_000000.bin", "truncated"]),
    ("shard_magic", ["--data.source={not_a_shard}"], ["train_000000.bin", "not a nanopt token shard"]),
    ("shard_none", ["--data.source={no_train}"], ["train_*.bin", "nanopt prepare"]),
    ("shard_vocab", ["--data.source={big_vocab}"], ["50000", "model.vocab_size"]),
    ("shard_too_short", ["--data.source={tiny}"], ["train.seq_len", "fewer than"]),
    ("shard_token_past_vocab", ["--data.source={past_vocab}"],  # was an IndexError in the embedding
     ["train_000000.bin", "holds token id", "vocabulary of 257"]),
    ("run_dir_is_file", ["--run.dir={a_file}"], ["a_file", "is a file", "run.dir"]),
    ("resume_false_nonempty", ["--run.dir={nonempty_run}", "--checkpoint.resume=false"],
     ["nonempty_run", "not empty", "run.dir"]),
    ("mirror_protocol", ["--checkpoint.mirror=nosuchfs://bucket/run"], ["checkpoint.mirror", "nosuchfs"]),
    ("no_cuda", ["--runtime.device=cuda"], ["runtime.device", "cpu"]),
    ("max_steps_text", ["--train.max_steps=abc"], ["train.max_steps"]),
    ("batches_past_int64", [f"--eval.batches={2**64}"], ["eval.batches"]),
]


@pytest.mark.parametrize("case, argv, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_a_paragraph_naming_it(case, argv, words, files, tmp_path, capsys):
    if case == "no_cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU, so --runtime.device=cuda is valid here")
    extra = [a.format(**files) for a in argv]
    run_dir = [] if any(a.startswith("--run.dir") for a in extra) else [f"--run.dir={tmp_path / 'run'}"]
    assert run([*ARGS, *extra, *run_dir]) == 2  # the case's own flags come last, so they win
    _says(capsys.readouterr().err, words)


@pytest.mark.slow
def test_a_real_process_prints_one_paragraph_and_no_traceback(tmp_path):
    proc = run_module(["nanopt.main", "--train.max_steps=-1", f"--run.dir={tmp_path}"])
    assert proc.returncode == 2 and one_paragraph(proc.stderr), proc.stderr
    assert proc.stderr.strip() == "nanopt: error: `train.max_steps` must be positive, got -1.", proc.stderr


def test_debug_flag_shows_the_traceback_and_keeps_exit_2(monkeypatch, capsys):
    """Before, --debug re-raised, and the uncaught error exited 1: a script could not tell bad input from a crash."""
    monkeypatch.delenv("NANOPT_DEBUG", raising=False)
    for call in (lambda: run(["--debug", "--model.dim=wide"]),  # python -m nanopt.main
                 lambda: cli.run(["--debug", "train", "--model.dim=wide"]),
                 lambda: cli.run(["runs", "--debug", "/nonexistent/runs"])):  # an error the dispatcher catches
        assert call() == 2
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and "nanopt.errors.ConfigError" in err
        assert err.strip().splitlines()[-1].startswith(("nanopt: error: ", "nanopt runs: error: "))
    monkeypatch.setenv("NANOPT_DEBUG", "1")
    assert run(["--model.dim=wide"]) == 2 and "Traceback" in capsys.readouterr().err
    monkeypatch.delenv("NANOPT_DEBUG")
    assert run(["--model.dim=wide"]) == 2  # = cli.run(["train", ...]); an unknown command: tests/test_cli.py
    err = capsys.readouterr().err
    assert "model.dim" in err and "Traceback" not in err


# ---------------------------------------------------------------- a checkpoint whose manifest was rewritten with it
def _state(**changes):
    """state.json with these entries replaced (a function of the entry, or its new value)."""
    def damage(ckpt: Path) -> None:
        state = json.loads((ckpt / "state.json").read_text())
        state.update({k: v(state[k]) if callable(v) else v for k, v in changes.items()})
        (ckpt / "state.json").write_text(json.dumps(state))
    return damage


def _shrink_moments(ckpt: Path) -> None:
    """The checkpoint's dcp/ written again with every AdamW first moment cut to 3 numbers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt / "dcp", ckpt / "whole.pt")
    state = torch.load(ckpt / "whole.pt", weights_only=False)
    (ckpt / "whole.pt").unlink()
    for entry in state["optimizer"]["state"].values():
        entry["exp_avg"] = entry["exp_avg"].flatten()[:3]
    shutil.rmtree(ckpt / "dcp")
    dcp.save(state, checkpoint_id=str(ckpt / "dcp"))


def _hello(name: str):
    return lambda c: (c / name).write_bytes(b"hello")


# (case id, what to do to the newest checkpoint `c`, which is then resealed, words the message must contain)
SEALED_DAMAGE = [
    ("weights_not_safetensors", _hello("model.safetensors"), ["model.safetensors"]),
    ("dcp_metadata_not_pickle", _hello("dcp/.metadata"), ["dcp/.metadata"]),
    ("dcp_shard_cut", lambda c: (p := c / "dcp" / "__0_0.distcp").write_bytes(p.read_bytes()[:-100]),
     ["dcp/__0_0.distcp"]),
    ("rng_not_pickle", _hello("rng.pt"), ["rng.pt"]),
    ("rng_no_ranks", lambda c: torch.save({"x": 1}, c / "rng.pt"), ["rng.pt", "ranks"]),
    ("loader_wrong_type", _state(loader=lambda old: {**old, "sample": "x"}), ["`loader`"]),
    ("loader_empty", _state(loader={}), ["`loader`"]),
    ("run_state_wrong_type", _state(run_state={"step": "x"}), ["`run_state`"]),
    ("data_not_a_list", _state(data=5), ["`data`"]),
    ("speedrun_wrong_type", _state(speedrun={"hit": "x"}), ["`speedrun`"]),
]
SEALED_DAMAGE = [(case, damage, ["{ckpt}", *words, "earlier checkpoint"]) for case, damage, words in SEALED_DAMAGE] + [
    # torch loads moments of another shape as they are; the fused/foreach step then crashed the process (SIGSEGV)
    ("moments_of_another_shape", _shrink_moments, ["{ckpt}", "optimizer state does not fit", "exp_avg"]),
    # A file where a checkpoint directory goes. Before: skipped as no checkpoint, the run trained, and saving step 3
    # ended in a NotADirectoryError traceback from rmtree. A directory where a file goes: refused at the first save.
    *((name, lambda c, name=name: (c.parent / name).write_text("the user's notes"), [f"{{checkpoints}}/{name} is a "])
      for name in ("step_000003", ".tmp_step_000003")),
    ("latest", lambda c: ((c.parent / "latest").unlink(), (c.parent / "latest").mkdir()),
     ["{checkpoints}/latest is a "]),
]


def _damaged_copy(trained: Path, tmp_path: Path, damage) -> tuple[Path, Path]:
    """A copy of the trained run whose newest checkpoint `damage` changed, COMPLETE rewritten for the files as they
    now are: damage the checksums cannot see."""
    shutil.copytree(trained, tmp_path / "run")
    damage(ckpt := tmp_path / "run" / "checkpoints" / "step_000002")
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    for name in manifest["files"]:
        raw = (ckpt / name).read_bytes()
        manifest["files"][name] = {"bytes": len(raw), "crc32": zlib.crc32(raw)}
    (ckpt / "COMPLETE").write_text(json.dumps(manifest))
    return tmp_path / "run", ckpt


@pytest.mark.parametrize("case, damage, words", SEALED_DAMAGE, ids=[c[0] for c in SEALED_DAMAGE])
def test_a_resume_from_a_checkpoint_damaged_behind_its_manifest_is_refused_naming_the_file(
        case, damage, words, trained, tmp_path, capsys):
    """Before, each of these escaped as a traceback (exit 1) from torch.load, safetensors or a component's
    load_state_dict; the run directory must stay byte-identical."""
    run_dir, ckpt = _damaged_copy(trained, tmp_path, damage)
    before = _snapshot(run_dir)
    assert run([*ARGS, "--checkpoint.every=2", "--train.max_steps=3", f"--run.dir={run_dir}"]) == 2
    _says(capsys.readouterr().err, [word.format(ckpt=ckpt, checkpoints=ckpt.parent) for word in words])
    assert _snapshot(run_dir) == before


@pytest.mark.parametrize("command, extra", [("eval", ["--batches", "1"]), ("export", ["--out", "{tmp}/hf"]),
                                            ("sample", ["-n", "1", "--max-new-tokens", "2"])])
def test_weights_that_are_no_safetensors_file_behind_their_manifest_are_one_paragraph(command, extra, trained, tmp_path,
                                                                                       capsys):
    run_dir, ckpt = _damaged_copy(trained, tmp_path, _hello("model.safetensors"))
    assert cli.run([command, str(run_dir), *(a.format(tmp=tmp_path) for a in extra)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{ckpt / 'model.safetensors'} is not a safetensors file" in err, err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("text", ["my: own\nsettings: [1, 2]\n", "database:\n  host: db.local\n", "run:\n  seed: [\n"])
def test_a_config_yaml_that_is_no_run_config_is_never_replaced(text, tmp_path, capsys):
    """Before, a directory given as run.dir that held the user's own config.yaml (or a damaged one) had it
    silently replaced by the run's config."""
    (mine := tmp_path / "mine").mkdir()
    (mine / "config.yaml").write_text(text)
    assert run([*ARGS, f"--run.dir={mine}"]) == 2
    _says(capsys.readouterr().err, [f"{mine / 'config.yaml'}", "move it aside"], start="")
    assert [p.name for p in mine.iterdir()] == ["config.yaml"] and (mine / "config.yaml").read_text() == text


@pytest.mark.parametrize("command, flags, words", [
    ("sample", ["--temperature", "nan"], ["--temperature", "got nan"]),  # was torch.multinomial's RuntimeError
    ("sample", ["--temperature", "inf"], ["--temperature", "got inf"]),
    ("sample", ["--seed", str(2**70)], ["--seed", "[0, 2^32)"]),  # was an OverflowError from manual_seed
    ("sample", ["--prompt", "caf\udcff"], ["--prompt", "no UTF-8 text"]),  # a command-line byte that does not decode
    # Before, each of these was silently ignored: a loss evaluation took no --limit, task scoring no --split.
    ("eval", ["--limit", "5"], ["--limit applies only with --tasks or --core"]),
    ("eval", ["--json"], ["--json applies only with --tasks or --core"]),
    ("eval", ["--interval", "5"], ["--interval applies only with --watch"]),
    ("eval", ["--tasks", "nanopt_mc", "--batches", "3"], ["--batches sets the val/test loss evaluation"]),
    ("eval", ["--core", "bundle", "--split", "test"], ["--split sets the val/test loss evaluation"]),
])
def test_a_sample_or_eval_flag_out_of_range_or_ignored_is_one_paragraph(command, flags, words, trained, capsys):
    before = _snapshot(trained)
    short = ["-n", "1", "--max-new-tokens", "2"] if command == "sample" else []
    assert cli.run([command, str(trained), *short, *flags]) == 2
    _says(capsys.readouterr().err, words, start=f"nanopt {command}: error: ")
    assert _snapshot(trained) == before


# ---------------------------------------------------------------- the filesystem, at the boundary
def _export_with_a_directory_at(name: str):
    """An export whose `name` is a directory: `export --force` over it must refuse before removing anything."""
    def setup(f: dict[str, Path], run_dir: Path, tmp: Path) -> list[str]:
        assert cli.run(["export", str(run_dir), "--out", str(tmp / "hf")]) == 0
        (tmp / "hf" / name).unlink()
        (tmp / "hf" / name).mkdir()
        return ["export", str(run_dir), "--out", str(tmp / "hf"), "--force"]
    return setup


def _train_on(f: dict[str, Path], tmp: Path, fifo: str = "", run_dir: Path | None = None) -> list[str]:
    """`nanopt train` on a copy of a good shard directory, with a FIFO at `fifo` (a name in it) when given."""
    shutil.copytree(f["good"], data := tmp / "shards")
    if fifo:
        (data / fifo).unlink(missing_ok=True)
        os.mkfifo(data / fifo)
    return ["train", *ARGS, f"--data.source={data}", f"--run.dir={run_dir or tmp / 'run'}"]


def _fifo_at_lock(f: dict[str, Path], run_dir: Path, tmp: Path) -> list[str]:
    shutil.copytree(run_dir, tmp / "run")
    os.mkfifo(tmp / "run" / "lock.json")
    return _train_on(f, tmp, run_dir=tmp / "run")


# (case id, setup(files, the trained run, tmp) -> argv, where it runs, exit status, words its output must
# hold). Where: "here" is cli.run in this process under an alarm (a FIFO read blocked for ever); a real process under
# a timeout, SIGTERM then having to end whatever blocks, for a boundary only a process has: the dispatcher's
# paragraph as the one line on the terminal, and stdout on a full disk ("/dev/full").
FILESYSTEM = [
    ("shard_checksum_in_a_process", lambda f, r, t: ["train", *ARGS, f"--data.source={f['flipped']}",
                                                     f"--run.dir={t / 'run'}"], "process", 2, ["checksum"]),
    ("average_out_dangling_link", lambda f, r, t: (t / "out").symlink_to(t / "nowhere") or
     ["average", str(r), "--last", "2", "--out", str(t / "out")], "here", 2, ["out is a symbolic link", "nowhere"]),
    ("average_out_below_a_file", lambda f, r, t: (t / "file").write_text("mine") and
     ["average", str(r), "--last", "2", "--out", str(t / "file" / "out")], "here", 2, ["file is a file", "below it"]),
    ("export_force_directory_at_config_json", _export_with_a_directory_at("config.json"), "here", 2,
     ["config.json is a directory"]),
    ("export_force_directory_at_weights", _export_with_a_directory_at("model.safetensors"), "here", 2,
     ["model.safetensors is a directory"]),
    ("runs_into_dev_full", lambda f, r, t: ["runs", str(r.parent)], "/dev/full", 1, ["stdout", "No space left"]),
    ("eval_into_dev_full", lambda f, r, t: ["eval", str(r), "--batches", "1"], "/dev/full", 1,
     ["stdout", "No space left"]),
    ("train_into_dev_full", lambda f, r, t: _train_on(f, t), "/dev/full", 0, ["console lines cannot be written"]),
    ("fifo_at_lock_json", _fifo_at_lock, "here", 2, ["lock.json is not a regular file but a named pipe"]),
    *((f"fifo_at_{name.strip('.').replace('.', '_')}", lambda f, r, t, name=name: _train_on(f, t, name), "here", 2,
       [f"{name} is not a regular file but a named pipe"]) for name in ("train_000000.bin", "manifest.json")),
    # Caches: refused unread like any file, then rebuilt (a damaged cache never fails a start).
    ("fifo_at_verified_json", lambda f, r, t: _train_on(f, t, ".verified.json"), "here", 0,
     [".verified.json is not a regular file but a named pipe", "verified again"]),
]


def _here(case: str, argv: list[str], capsys) -> tuple[int, str, str]:
    """cli.run under an alarm whose pytest.fail is a BaseException: no handler of nanopt's catches it."""
    capsys.readouterr()  # what a setup's own commands printed
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"{case}: blocked for 120 s"))
    signal.alarm(120)
    try:
        code = cli.run(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    return code, err, out


def _process(case: str, argv: list[str], stdout: Path) -> tuple[int, str, str]:
    with open(stdout, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "nanopt.cli", *argv], stdout=out, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                pytest.fail(f"{case}: blocked, and SIGTERM did not end it")
            pytest.fail(f"{case}: blocked until SIGTERM ended it")
    return proc.returncode, err, "" if str(stdout) == "/dev/full" else stdout.read_text()


@pytest.mark.slow  # a few real processes; the rule's quick rows: tests/test_io.py, tests/test_cli.py
@pytest.mark.parametrize("case, setup, where, code, words", FILESYSTEM, ids=[c[0] for c in FILESYSTEM])
def test_a_path_that_is_not_what_nanopt_expects_is_one_paragraph_and_never_blocks(case, setup, where, code, words,
                                                                                   files, trained, tmp_path, capsys):
    """Before: tracebacks (an --out through a dangling link or below a file, stdout on a full disk), an export that
    removed the old config.json and then failed, one "--- Logging error ---" block per console line, and a read of a
    FIFO that blocked for ever, which SIGTERM did not end."""
    argv = setup(files, trained, tmp_path)
    before = _snapshot(tmp_path)
    rc, err, out = (_here(case, argv, capsys) if where == "here" else
                    _process(case, argv, Path(where) if where != "process" else tmp_path / "stdout"))
    assert rc == code, err
    assert "Logging error" not in err
    _says(err, words, start="", said=err + out if code == 0 else err)  # a cache's warning is a console line
    if code:
        after = _snapshot(tmp_path)
        assert {name: after.get(name) for name in before} == before  # nothing there was removed or changed
