"""THE checkpoint format (nanopt/training/checkpoint.py): a save's COMPLETE manifest lists every file with its size and crc32,
any damage falls back to the previous checkpoint (newest first, reading no older one), a checkpoint's config is
validated before anything is built, a save never writes through a link and a full disk is DiskFull naming the file,
and a failed mirror copy is reported once."""
from __future__ import annotations

import errno
import json
import logging
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from conftest import CPU, SHORT_ARGS, fork_ranks
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from nanopt import loading, rundirs
from nanopt.config import load_config, parse_overrides
from nanopt.distributed import parallel, runtime
from nanopt.errors import ConfigError, DiskFull
from nanopt.recipe.model import build_model
from nanopt.recipe.optim import build_optimizer
from nanopt.training import checkpoint

real_crc32 = checkpoint.crc32_of


def _checkpointer(run_dir: Path, *args: str, rt: runtime.Runtime = CPU) -> checkpoint.Checkpointer:
    """The training loop's checkpointer of a SHORT_ARGS run in `run_dir` (default: the one rank, no process group)."""
    return checkpoint.Checkpointer(load_config(None, parse_overrides([*SHORT_ARGS, f"--run.dir={run_dir}", *args])),
                                   rt, [])


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The SHORT_ARGS model (AdamW) and its optimizer after one step (moments to save)."""
    cfg = load_config(None, parse_overrides(SHORT_ARGS))
    model = build_model(cfg.model, "cpu")
    opt = build_optimizer(model, cfg.train, CPU, cfg.optim)
    x = torch.randint(0, model.cfg.vocab_size, (2, 8))
    model(x, x).backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A run directory whose checkpointer saved steps 2 and 4 (the embedding moved by 1 between them), and the
    model as saved at 4; a test that changes it takes a copy (copied)."""
    model, opt = _trained()
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    _checkpointer(run_dir).save(2, model, opt, {})
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    _checkpointer(run_dir).save(4, model, opt, {})
    return run_dir, model


def copied(saved: tuple[Path, torch.nn.Module], tmp_path: Path, complete: bytes | None = b"") -> Path:
    """The saved run copied, step 4's COMPLETE replaced by `complete` (None: made a directory; b"": kept)."""
    run_dir = shutil.copytree(saved[0], tmp_path / "run")
    if complete != b"":
        (marker := run_dir / rundirs.CHECKPOINTS_DIR / "step_000004" / rundirs.COMPLETE_FILE).unlink()
        marker.mkdir() if complete is None else marker.write_bytes(complete)
    return run_dir


def _reseal(ckpt: Path) -> None:
    """COMPLETE rewritten for the files as they now are: damage the checksums cannot see."""
    manifest = json.loads((ckpt / rundirs.COMPLETE_FILE).read_text())
    for name in manifest["files"]:
        raw = (ckpt / name).read_bytes()
        manifest["files"][name] = {"bytes": len(raw), "crc32": zlib.crc32(raw)}
    (ckpt / rundirs.COMPLETE_FILE).write_text(json.dumps(manifest))


# ---------------------------------------------------------------- checkpoints fall back
@pytest.mark.parametrize("marker, why", [
    (b"\xff\xfe not utf-8", "its COMPLETE manifest is not UTF-8 text"),
    (None, "is a directory, where nanopt expects a file"),  # refused unread (io)
    (b"[1, 2]", "is an array [1, 2], not a JSON object"),
    (b'{"files": {}}', "manifest's `files.model.safetensors` is missing"),
    (b"ok", "is not JSON"),  # the pre-manifest marker no longer passes
    (b'{"files": {"model.safetensors": {"bytes": "1", "crc32": 0}}}', "`files.rng.pt` is missing"),
    ("renamed", "says step 2"),  # a whole manifest, but step 2's checkpoint under step 6's name
])
def test_any_damage_to_complete_falls_back_to_the_previous_checkpoint(tmp_path, saved, marker, why):
    damaged, good = ("step_000006", "step_000004") if marker == "renamed" else ("step_000004", "step_000002")
    run_dir = copied(saved, tmp_path, b"" if marker == "renamed" else marker)
    root = run_dir / rundirs.CHECKPOINTS_DIR
    if marker == "renamed":
        (root / "step_000002").rename(root / "step_000006")
    assert why in checkpoint.verify_checkpoint(root / damaged)
    assert checkpoint.verify_checkpoint(root / good) is None
    assert checkpoint.find_checkpoint(run_dir) == root / good  # eval, sample and export read this


def test_the_newest_complete_checkpoint_is_found_newest_first_reading_no_older_one(tmp_path, saved, monkeypatch):
    """newest_checkpoint (resume, eval, sample, export, Modal): the first that verifies, newest first, naming each
    newer one skipped; an older one is never read (verifying reads every byte), so its damage goes unseen."""
    run_dir = copied(saved, tmp_path, b"[1, 2]")  # step 4's manifest damaged, step 2 whole
    root = run_dir / rundirs.CHECKPOINTS_DIR
    read = []
    monkeypatch.setattr(checkpoint, "crc32_of", lambda path: read.append(path) or real_crc32(path))
    found, skipped = checkpoint.newest_checkpoint(run_dir)
    assert found == root / "step_000002" and skipped == ["step_000004: its COMPLETE manifest is an array [1, 2], "
                                                         "not a JSON object with a `files` map"]
    assert checkpoint.newest_checkpoint(run_dir, newer_than=2) == (None, skipped)  # Modal: progress since step 2?
    complete = rundirs.COMPLETE_FILE
    (root / "step_000004" / complete).write_bytes((saved[0] / "checkpoints" / "step_000004" / complete).read_bytes())
    (root / "step_000002" / rundirs.MODEL_FILE).write_bytes(b"damaged")  # older: never read
    read.clear()
    assert checkpoint.newest_checkpoint(root) == (root / "step_000004", [])
    assert read and all("step_000004" in Path(p).parts for p in read)
    assert checkpoint.newest_checkpoint(root, newer_than=4) == (None, [])


def test_a_checkpoint_config_is_validated_before_anything_is_built(tmp_path, saved):
    ckpt = copied(saved, tmp_path) / rundirs.CHECKPOINTS_DIR / "step_000004"
    state = json.loads((ckpt / "state.json").read_text())
    state["config"]["model"]["dim"] = 10**9  # would size a huge model
    state["config"]["model"]["n_heads"] = "four"
    (ckpt / "state.json").write_text(json.dumps(state))
    _reseal(ckpt)
    with pytest.raises(ConfigError, match=r"state\.json.*model\.n_heads"):
        loading.load(ckpt)


# ---------------------------------------------------------------- the manifest and DCP's files
def test_the_manifest_lists_every_file_a_torn_shard_falls_back_and_readers_load_whole_weights(saved, tmp_path):
    """The COMPLETE manifest describes exactly the bytes on disk, the DCP files included, and no temp directory
    outlives the save: the dcp/ shards a resume loads, the whole weights for readers (eval, sample, export). A
    truncated shard makes the checkpoint incomplete and the reader takes the previous one, naming the file; a
    manifest entry that climbs out of dcp/ is no checkpoint file."""
    run_dir, model = copied(saved, tmp_path), saved[1]
    root = run_dir / rundirs.CHECKPOINTS_DIR
    final = root / "step_000004"
    files = json.loads((final / rundirs.COMPLETE_FILE).read_text())["files"]
    assert sorted(files) == ["dcp/.metadata", "dcp/__0_0.distcp", "model.safetensors", "rng.pt", "state.json"]
    for name, entry in files.items():
        raw = (final / name).read_bytes()
        assert entry == {"bytes": len(raw), "crc32": zlib.crc32(raw)}, name
    assert checkpoint.verify_checkpoint(final) is None and not list(root.glob(".tmp_*"))
    loaded = loading.load(run_dir)
    assert loaded.step == 4 and torch.equal(loaded.model.embed.weight, model.embed.weight)
    shard = final / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    found, skipped = checkpoint.newest_checkpoint(root)
    assert found.name == "step_000002" and "dcp/__0_0.distcp has" in skipped[0], skipped
    assert torch.allclose(loading.load(run_dir).model.embed.weight, model.embed.weight - 1.0, atol=1e-6)
    files["dcp/../rng.pt"] = files["rng.pt"]
    (final / rundirs.COMPLETE_FILE).write_text(json.dumps({"step": 4, "files": files}))
    assert "not a map of checkpoint files" in checkpoint.verify_checkpoint(final)


def test_the_optimizer_state_dcp_gives_is_keyed_as_torch_saves_it():
    """What a resume hands optim's checked load (checkpoint._indexed of DCP's name-keyed state) is what
    optimizer.state_dict() gives: the same positions, groups and tensors (a tied embedding once)."""
    model, optimizer = _trained()
    ours, torchs = checkpoint._indexed(get_optimizer_state_dict(model, optimizer)), optimizer.state_dict()
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in torchs["param_groups"]]
    assert ours["param_groups"] == torchs["param_groups"]
    assert ours["state"].keys() == torchs["state"].keys()
    for i, state in torchs["state"].items():
        for k, v in state.items():
            assert torch.equal(ours["state"][i][k], v), (i, k)


@pytest.mark.parametrize("damage, named", [
    (lambda c: (c / "dcp" / ".metadata").write_bytes(b"hello"), "dcp/.metadata"),  # was an UnpicklingError
    (lambda c: (c / "dcp" / "__0_0.distcp").write_bytes((c / "dcp" / "__0_0.distcp").read_bytes()[:-100]),
     "dcp/__0_0.distcp"),  # a cut shard: was a message naming no file that advised a config change
])
def test_dcp_files_damaged_behind_their_manifest_are_one_paragraph_naming_the_file(saved, tmp_path, damage, named):
    """A resume refuses them naming the file and the way out (an earlier checkpoint); without the rewritten manifest
    it takes the previous checkpoint itself. Readers never read dcp/: eval, sample and export still load."""
    run_dir = copied(saved, tmp_path)
    ckpt = run_dir / rundirs.CHECKPOINTS_DIR / "step_000004"
    manifest = (ckpt / rundirs.COMPLETE_FILE).read_bytes()
    damage(ckpt)
    _reseal(ckpt)
    fresh, fresh_opt = _trained()
    with pytest.raises(ConfigError) as e:
        _checkpointer(run_dir).restore(fresh, fresh_opt, {})
    assert f"checkpoint {ckpt}'s {named} cannot be restored" in str(e.value) and "earlier checkpoint" in str(e.value)
    assert "allow_changes" not in str(e.value)
    assert loading.load(run_dir).step == 4
    (ckpt / rundirs.COMPLETE_FILE).write_bytes(manifest)
    assert _checkpointer(run_dir).restore(fresh, fresh_opt, {})["step"] == 2


# ---------------------------------------------------------------- every rank its share
def _rank(rank: int, world: int, store: str) -> runtime.Runtime:
    """This forked process as gloo rank `rank` of `world`."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    return runtime.Runtime("cpu", torch.device("cpu"), rank, rank, world, world, "fp32")


def _failing_fsync(real, code: int, why: str, fails: bool = True):
    """fsync raising OSError(code, why) at a DCP shard file where `fails`, else the real one."""
    return lambda path: (_ for _ in ()).throw(OSError(code, why, str(path))) \
        if fails and Path(path).suffix == ".distcp" else real(path)


def _seal_worker(rank: int, world: int, store: str, root: str) -> None:
    """A 2-rank fsdp model: Checkpointer.save (every rank writes its DCP shards and fsyncs and sums its own),
    recording which files this rank read back; then a save where rank 1's fsync fails."""
    rt = _rank(rank, world, store)
    ckpt = _checkpointer(Path(root), "--runtime.parallel=fsdp", rt=rt)
    model = build_model(ckpt.cfg.model, "cpu")
    parallel.shard(model, ckpt.cfg, rt)
    opt = torch.optim.AdamW(model.parameters())
    read: list[str] = []
    checkpoint.crc32_of = lambda path: read.append(Path(path).name) or real_crc32(path)
    ckpt.save(2, model, opt, {})
    (Path(root) / f"read{rank}.json").write_text(json.dumps(read))
    checkpoint.fsync = _failing_fsync(checkpoint.fsync, errno.EIO, "I/O error", fails=rank == 1)
    try:
        ckpt.save(4, model, opt, {})
    except OSError as e:
        (Path(root) / f"error{rank}.txt").write_text(str(e))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_each_rank_reads_back_only_its_own_shards_and_a_rank_failing_to_seal_fails_every_rank(tmp_path):
    """A checkpoint of 2 forked fsdp ranks: rank 1 sums its own DCP file and rank 0 its own and the metadata,
    never rank 1's (at 8B that would be the whole checkpoint read again by one rank); COMPLETE lists all of them
    and the checkpoint verifies. When rank 1 cannot fsync its shard, both ranks raise that error (no rank waits
    for the failed one) and no step_000004 appears."""
    import torch.distributed.fsdp  # noqa: F401 (here, not in each fork: seconds of import)

    root = tmp_path / "run"
    root.mkdir()
    fork_ranks(_seal_worker, 2, (2, str(tmp_path / "store"), str(root)), timeout=120)
    read = {rank: sorted(name for name in json.loads((root / f"read{rank}.json").read_text())
                         if name.endswith(".distcp") or name == ".metadata") for rank in (0, 1)}
    assert read[0] == [".metadata", "__0_0.distcp"] and read[1] == ["__1_0.distcp"], read
    final = root / "checkpoints" / "step_000002"
    files = json.loads((final / rundirs.COMPLETE_FILE).read_text())["files"]
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(files)
    assert checkpoint.verify_checkpoint(final) is None
    for rank in (0, 1):
        assert "__1_0.distcp" in (root / f"error{rank}.txt").read_text(), rank
    assert not (root / "checkpoints" / "step_000004").exists()


def _synthetic(root: Path, step: int, sharded: bool = True, first: tuple[str, ...] = ()) -> Path:
    """checkpoints/step_NNNNNN with random bytes under a 2-rank checkpoint's names (DCP files) or a weights-only one's
    and a true COMPLETE, listing `first` first: verifying reads sizes and crc32s, never the contents."""
    ckpt = root / f"step_{step:06d}"
    sizes = {"dcp/.metadata": 300, "dcp/__0_0.distcp": 40_000, "dcp/__1_0.distcp": 40_000,
             "model.safetensors": 20_000} if sharded else {"model.safetensors": 40_000, "ema.safetensors": 30_000}
    (ckpt / "dcp" if sharded else ckpt).mkdir(parents=True)
    for name, size in sizes.items():
        (ckpt / name).write_bytes(torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes())
    (ckpt / "rng.pt").write_bytes(b"rng" * 500)
    (ckpt / "state.json").write_text(json.dumps({"step": step}))
    listed = [*first, *[n for n in [*sizes, "rng.pt", "state.json"] if n not in first]]
    files = {n: {"bytes": (ckpt / n).stat().st_size, "crc32": zlib.crc32((ckpt / n).read_bytes())} for n in listed}
    (ckpt / "COMPLETE").write_text(json.dumps({"step": step, "files": files}))
    return ckpt


def _damage(path: Path, truncate: bool = False) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:-10] if truncate else raw[:5] + bytes([raw[5] ^ 1]) + raw[6:])


def _resume_scenarios(runs: Path) -> None:
    """Run directories, each a resume case: whole, damaged in one way or two, none usable, only on the mirror."""
    for name in ("whole", "torn", "two_torn", "missing", "manifest", "renamed", "unusable", "fresh", "mirror"):
        (runs / name / "checkpoints").mkdir(parents=True)
    for name in ("whole", "torn", "missing", "manifest", "renamed"):
        _synthetic(runs / name / "checkpoints", 2)
        _synthetic(runs / name / "checkpoints", 4)
    (runs / "whole" / "checkpoints" / ".tmp_step_000006").mkdir()  # an interrupted save: rank 0 removes it
    _damage(runs / "torn" / "checkpoints" / "step_000004" / "dcp" / "__1_0.distcp")
    _synthetic(runs / "two_torn" / "checkpoints", 2)
    two = _synthetic(runs / "two_torn" / "checkpoints", 4, first=("dcp/__1_0.distcp",))  # rank 1's listed first
    _damage(two / "dcp" / "__0_0.distcp")
    _damage(two / "dcp" / "__1_0.distcp", truncate=True)
    (runs / "missing" / "checkpoints" / "step_000004" / "rng.pt").unlink()
    (runs / "manifest" / "checkpoints" / "step_000004" / "COMPLETE").write_text("[1, 2]")
    (runs / "renamed" / "checkpoints" / "step_000002").rename(runs / "renamed" / "checkpoints" / "step_000006")
    _damage(_synthetic(runs / "unusable" / "checkpoints", 4) / "state.json")
    _synthetic(runs / "mirror" / "remote", 4, sharded=False)


def _choose_worker(rank: int, world: int, store: str, runs: str) -> None:
    """One gloo rank resuming each scenario run: the checkpoint Checkpointer.restore would load on this rank (or
    the refusal), the files this rank summed and the warnings it logged."""
    rt = _rank(rank, world, store)
    read, warned, out = [], [], {}
    checkpoint.crc32_of = lambda path: read.append(str(path)) or real_crc32(path)
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("nanopt").addHandler(handler)
    for run in sorted(Path(runs).iterdir()):
        ckpt = _checkpointer(run, *([f"--checkpoint.mirror={run / 'remote'}"] if run.name == "mirror" else []), rt=rt)
        read.clear()
        warned.clear()
        try:
            chosen = ckpt._agree()
        except ConfigError as e:
            chosen = f"refused: {e}"
        out[run.name] = {"chosen": chosen, "read": [str(Path(p).relative_to(run)) for p in read], "warned": warned[:]}
    (Path(runs).parent / f"chosen{rank}.json").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


def test_ranks_verify_their_own_share_of_a_checkpoint_on_resume_and_choose_what_one_rank_would(tmp_path):
    """Resume on 2 forked ranks: each candidate's files are summed once, split between the ranks (rank N takes
    `__N_0.distcp`), rank 0 alone removes, downloads and warns, and both resume from the checkpoint one rank's
    newest_checkpoint picks, skipping the same ones for the same reasons: a torn `__1_0.distcp` (read by rank 1
    alone), the first of two damaged files in manifest order, a missing file, a bad manifest, a state.json of
    another step; a refusal is every rank's; the mirror's copy is verified by both."""
    runs = tmp_path / "runs"
    _resume_scenarios(runs)
    expected = {run.name: checkpoint.newest_checkpoint(run) for run in runs.iterdir()}
    fork_ranks(_choose_worker, 2, (2, str(tmp_path / "store"), str(runs)), timeout=120)
    got = [json.loads((tmp_path / f"chosen{rank}.json").read_text()) for rank in (0, 1)]
    for name, (found, skipped) in expected.items():
        if name in ("unusable", "mirror"):
            continue
        assert got[0][name]["chosen"] == got[1][name]["chosen"] == (found.name if found else None), name
        assert [w for w in got[0][name]["warned"] if w.startswith("skipping")] == \
            [f"skipping checkpoint {line}" for line in skipped], name
        assert got[1][name]["warned"] == [], name
        reads = [set(got[rank][name]["read"]) for rank in (0, 1)]
        assert not reads[0] & reads[1] and len(got[0][name]["read"]) == len(reads[0]), name  # each file once
    whole = [set(got[rank]["whole"]["read"]) for rank in (0, 1)]
    assert whole[0] | whole[1] == {f"checkpoints/step_000004/{n}" for n in json.loads(
        (runs / "whole" / "checkpoints" / "step_000004" / "COMPLETE").read_text())["files"]}
    assert "checkpoints/step_000004/dcp/__0_0.distcp" in whole[0] and whole[1], whole  # both ranks read
    assert "checkpoints/step_000004/dcp/__1_0.distcp" in whole[1], whole
    assert not (runs / "whole" / "checkpoints" / ".tmp_step_000006").exists()
    torn = got[0]["torn"]
    assert torn["chosen"] == "step_000002" and "step_000004: dcp/__1_0.distcp fails its crc32" in torn["warned"][0]
    assert not [p for p in torn["read"] if p.endswith("__1_0.distcp")]  # rank 1's share, read by rank 1 alone
    assert "dcp/__1_0.distcp has 39990 bytes" in got[0]["two_torn"]["warned"][0]  # rank 0 found __0_0's, listed later
    refused = [got[rank]["unusable"]["chosen"] for rank in (0, 1)]
    assert refused[0].startswith("refused: the run directory") and expected["unusable"][1][0] in refused[0]
    assert refused[1].startswith("refused: rank 0 could not resume") and expected["unusable"][1][0] in refused[1]
    assert got[0]["mirror"]["chosen"] == got[1]["mirror"]["chosen"] == "step_000004"
    fetched = got[1]["mirror"]["read"]
    assert fetched and all(p.startswith("checkpoints/.tmp_step_000004/") for p in fetched), fetched
    assert checkpoint.verify_checkpoint(runs / "mirror" / "checkpoints" / "step_000004") is None


def test_a_failed_mirror_copy_is_reported_once_however_often_close_is_called(tmp_path, caplog):
    """finish() waits for the mirror before the summary and the run's cleanup closes again: one warning."""
    ckpt = _checkpointer(tmp_path / "run", f"--checkpoint.mirror={tmp_path / 'mirror'}")
    ckpt.mirror.failures.append("step_000001: no space left on device")
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        ckpt.close()
        ckpt.close()
    assert [r.getMessage() for r in caplog.records].count(
        f"checkpoint mirror {tmp_path / 'mirror'}: 1 copy(ies) failed: step_000001: no space left on device") == 1


# ---------------------------------------------------------------- links and a full disk
def test_a_checkpoint_save_removes_links_in_its_way_never_what_they_point_to(tmp_path):
    """Before: a link at .tmp_step_NNNNNN made rmtree raise (a traceback) and one at step_NNNNNN the same."""
    mine = tmp_path / "outside"
    mine.mkdir()
    (mine / "precious").write_text("the user's")
    root = tmp_path / "run" / rundirs.CHECKPOINTS_DIR
    root.mkdir(parents=True)
    (root / ".tmp_step_000002").symlink_to(mine)
    (root / "step_000002").symlink_to(mine)
    final = checkpoint.save(root, 2, checkpoint.model_state(_trained()[0]), {}, keep=3)
    assert not final.is_symlink() and checkpoint.verify_checkpoint(final) is None
    assert [p.name for p in mine.iterdir()] == ["precious"] and (mine / "precious").read_text() == "the user's"


def _full_torch_save(obj, f, *args, **kwargs):
    """torch.save on a full disk: its own writer's bare RuntimeError ("unexpected pos"); through a file object, the
    same with the OSError as its context."""
    if isinstance(f, (str, Path)):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")




@pytest.mark.parametrize("where", ["rng.pt", "dcp/__0_0.distcp"])
def test_a_full_disk_in_a_save_is_disk_full_naming_the_file_and_leaves_no_temp_directory(tmp_path, monkeypatch,
                                                                                         where):
    """A full disk in torch.save (of a weights-only save; written through a file object, so the OSError is seen) or
    first at a shard's fsync: DiskFull (exit 1) naming the file, the temp directory removed (its space back) and the
    previous checkpoint as it was."""
    model, opt = _trained()
    root, ckpt = tmp_path / rundirs.CHECKPOINTS_DIR, _checkpointer(tmp_path)
    if where == "rng.pt":
        save, full = lambda step: checkpoint.save(root, step, checkpoint.model_state(model), {}, keep=3), \
            (checkpoint.torch, "save", _full_torch_save)
    else:
        save, full = lambda step: ckpt.save(step, model, opt, {}), \
            (checkpoint, "fsync", _failing_fsync(checkpoint.fsync, errno.ENOSPC, "No space left on device"))
    save(2)
    monkeypatch.setattr(*full)
    with pytest.raises(DiskFull) as e:
        save(4)
    monkeypatch.undo()
    assert f"writing {root / '.tmp_step_000004' / where}" in str(e.value)
    assert sorted(p.name for p in root.iterdir()) == [rundirs.LATEST_FILE, "step_000002"]
    assert checkpoint.verify_checkpoint(root / "step_000002") is None
