"""THE checkpoint format (nanopt/checkpoint.py): a save's COMPLETE manifest lists every file with its size and crc32,
any damage falls back to the previous checkpoint (newest first, reading no older one), a checkpoint's config is
validated before anything is built, a save never writes through a link and a full disk is DiskFull naming the file,
and a failed mirror copy is reported once."""
from __future__ import annotations

import errno
import json
import logging
import threading
import zlib
from pathlib import Path

import pytest
import torch

from conftest import SHORT_ARGS, fork_ranks
from nanopt import checkpoint, loading, parallel, rundirs, runtime
from nanopt.config import load_config, parse_overrides
from nanopt.errors import ConfigError, DiskFull
from nanopt.model import build_model

real_crc32 = checkpoint.crc32_of

# ---------------------------------------------------------------- checkpoints fall back


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpts")
    cfg = load_config(None, parse_overrides(SHORT_ARGS))
    model = build_model(cfg.model, "cpu")
    opt = torch.optim.AdamW(model.parameters())
    for step in (2, 4):
        checkpoint.save(root, step, checkpoint.model_state(model), opt.state_dict(), {"config": cfg.to_dict()}, keep=3)
    return root


def damaged_copy(tmp_path: Path, source: Path, marker: bytes | None) -> Path:
    """The two checkpoints copied, step 4's COMPLETE replaced by `marker` (None: made a directory)."""
    root = tmp_path / "checkpoints"
    for ckpt in source.iterdir():
        if ckpt.is_dir():
            (root / ckpt.name).mkdir(parents=True)
            for f in ckpt.iterdir():
                (root / ckpt.name / f.name).write_bytes(f.read_bytes())
    complete = root / "step_000004" / rundirs.COMPLETE_FILE
    complete.unlink()
    if marker is None:
        complete.mkdir()
    else:
        complete.write_bytes(marker)
    return root


@pytest.mark.parametrize("marker, why", [
    (b"\xff\xfe not utf-8", "cannot be read"),
    (None, "no COMPLETE marker"),  # a directory where the marker should be
    (b"[1, 2]", "not a JSON object"),
    (b'{"files": {}}', "does not list model.safetensors"),
    (b"ok", "cannot be read"),  # the pre-manifest marker no longer passes
    (b'{"files": {"model.safetensors": {"bytes": "1", "crc32": 0}}}', "does not list rng.pt"),
])
def test_any_damage_to_complete_falls_back_to_the_previous_checkpoint(tmp_path, two_checkpoints, marker, why):
    root = damaged_copy(tmp_path, two_checkpoints, marker)
    assert why in checkpoint.verify_checkpoint(root / "step_000004")
    assert checkpoint.verify_checkpoint(root / "step_000002") is None
    assert checkpoint.find_checkpoint(tmp_path) == root / "step_000002"  # eval, sample and export read this


def test_the_newest_complete_checkpoint_is_found_newest_first_reading_no_older_one(tmp_path, two_checkpoints,
                                                                                     monkeypatch):
    """newest_checkpoint (resume, eval, sample, export, Modal): the first that verifies, newest first, naming each
    newer one skipped; an older one is never read (verifying reads every byte), so its damage goes unseen."""
    root = damaged_copy(tmp_path, two_checkpoints, b"[1, 2]")  # step 4's manifest damaged, step 2 whole
    read = []
    monkeypatch.setattr(checkpoint, "crc32_of", lambda path: read.append(path) or real_crc32(path))
    found, skipped = checkpoint.newest_checkpoint(tmp_path)
    assert found == root / "step_000002" and skipped == ["step_000004: its COMPLETE manifest is not a JSON object "
                                                         "with a `files` map"]
    assert checkpoint.newest_checkpoint(tmp_path, newer_than=2) == (None, skipped)  # Modal: progress since step 2?
    complete = rundirs.COMPLETE_FILE
    (root / "step_000004" / complete).write_bytes((two_checkpoints / "step_000004" / complete).read_bytes())
    (root / "step_000002" / rundirs.MODEL_FILE).write_bytes(b"damaged")  # older: never read
    read.clear()
    assert checkpoint.newest_checkpoint(root) == (root / "step_000004", [])
    assert read and all(p.parent.name == "step_000004" for p in read)
    assert checkpoint.newest_checkpoint(root, newer_than=4) == (None, [])


def test_a_manifest_that_lists_every_file_but_a_wrong_state_step_is_incomplete(tmp_path, two_checkpoints):
    root = damaged_copy(tmp_path, two_checkpoints, (two_checkpoints / "step_000004" / "COMPLETE").read_bytes())
    (root / "step_000002").rename(root / "step_000006")  # a checkpoint under another step's name
    assert "says step 2" in checkpoint.verify_checkpoint(root / "step_000006")
    assert checkpoint.find_checkpoint(tmp_path) == root / "step_000004"


def test_a_checkpoint_config_is_validated_before_anything_is_built(tmp_path, two_checkpoints):
    root = damaged_copy(tmp_path, two_checkpoints, (two_checkpoints / "step_000004" / "COMPLETE").read_bytes())
    ckpt = root / "step_000004"
    state = json.loads((ckpt / "state.json").read_text())
    state["config"]["model"]["dim"] = 10**9  # would size a huge model
    state["config"]["model"]["n_heads"] = "four"
    (ckpt / "state.json").write_text(json.dumps(state))
    raw = (ckpt / "state.json").read_bytes()
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    manifest["files"]["state.json"] = {"bytes": len(raw), "crc32": zlib.crc32(raw)}
    (ckpt / "COMPLETE").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"state\.json.*model\.n_heads"):
        loading.load(ckpt)


# ---------------------------------------------------------------- the manifest and the mirror


def test_save_manifest_lists_every_file_with_its_size_and_crc32(tmp_path):
    """The COMPLETE manifest is summed by worker threads while the next file is written: it must still
    describe exactly the bytes on disk, and no temp directory or thread may outlive the save."""
    import zlib

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    final = checkpoint.save(tmp_path, 4, checkpoint.model_state(model), opt.state_dict(), {"config": {}}, keep=2)
    files = json.loads((final / "COMPLETE").read_text())["files"]
    assert sorted(files) == ["model.safetensors", "optimizer.pt", "rng.pt", "state.json"]
    for name, entry in files.items():
        raw = (final / name).read_bytes()
        assert entry == {"bytes": len(raw), "crc32": zlib.crc32(raw)}, name
    assert checkpoint.verify_checkpoint(final) is None and not list(tmp_path.glob(".tmp_*"))
    assert not [t for t in threading.enumerate() if t.name.startswith("nanopt-ckpt")]


def _sharded_save(root: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, cfg) -> Path:
    """What Checkpointer.save does under checkpoint.sharded, as the one rank of no process group: the shards into
    the temp directory's dcp/, then rank 0's save() lists them in COMPLETE."""
    parallel.save_sharded(checkpoint.temp_dir(root, step) / rundirs.DCP_DIR, model, opt)
    return checkpoint.save(root, step, None, None, {"config": cfg.to_dict()}, keep=3)


def test_a_sharded_checkpoint_is_listed_verified_loaded_whole_and_falls_back_when_a_shard_is_torn(tmp_path):
    """checkpoint.sharded's DCP files count only as COMPLETE lists them: a truncated shard makes the checkpoint
    incomplete, and the reader takes the previous one, naming the file (the same rule as model.safetensors). A
    sharded checkpoint loads whole in one process with no process group (eval, sample, export), and a manifest
    entry that climbs out of dcp/ is no checkpoint file."""
    cfg = load_config(None, parse_overrides(SHORT_ARGS))
    model = build_model(cfg.model, "cpu")
    opt = torch.optim.AdamW(model.parameters())
    root = tmp_path / "run" / rundirs.CHECKPOINTS_DIR
    _sharded_save(root, 2, model, opt, cfg)
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    final = _sharded_save(root, 4, model, opt, cfg)
    files = json.loads((final / rundirs.COMPLETE_FILE).read_text())["files"]
    assert sorted(files) == ["dcp/.metadata", "dcp/__0_0.distcp", "rng.pt", "state.json"]
    assert not (final / rundirs.MODEL_FILE).exists() and checkpoint.verify_checkpoint(final) is None
    loaded = loading.load(tmp_path / "run")
    assert loaded.step == 4 and torch.equal(loaded.model.embed.weight, model.embed.weight)
    shard = final / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    found, skipped = checkpoint.newest_checkpoint(root)
    assert found.name == "step_000002" and "dcp/__0_0.distcp has" in skipped[0], skipped
    assert torch.allclose(loading.load(tmp_path / "run").model.embed.weight, model.embed.weight - 1.0, atol=1e-6)
    files["dcp/../rng.pt"] = files["rng.pt"]
    (final / rundirs.COMPLETE_FILE).write_text(json.dumps({"step": 4, "files": files}))
    assert "no checkpoint file" in checkpoint.verify_checkpoint(final)


def _seal_worker(rank: int, world: int, store: str, root: str) -> None:
    """One gloo rank of a 2-rank fsdp model: Checkpointer.save's sharded path (every rank writes its shards and
    fsyncs and sums its own), recording which files this rank read back; then a save where rank 1's fsync fails."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rt = runtime.Runtime("cpu", torch.device("cpu"), rank, rank, world, world, "fp32")
    cfg = load_config(None, parse_overrides([*SHORT_ARGS, "--runtime.parallel=fsdp", "--checkpoint.sharded=true",
                                             f"--run.dir={root}"]))
    model = build_model(cfg.model, "cpu")
    parallel.shard(model, cfg, rt)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = checkpoint.Checkpointer.__new__(checkpoint.Checkpointer)  # only save()'s collaborators are needed
    ckpt.cfg, ckpt.rt, ckpt.root, ckpt.run_dir, ckpt.data, ckpt.mirror = cfg, rt, Path(root) / "checkpoints", \
        Path(root), {}, None
    ckpt.latest, ckpt.last_saved_step = None, None
    read: list[str] = []
    summed = checkpoint.crc32_of
    checkpoint.crc32_of = lambda path: read.append(Path(path).name) or summed(path)
    ckpt.save(2, model, opt, {})
    (Path(root) / f"read{rank}.json").write_text(json.dumps(read))
    real_fsync = checkpoint.fsync
    checkpoint.fsync = lambda path: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error", str(path))) \
        if rank == 1 and Path(path).suffix == ".distcp" else real_fsync(path)
    try:
        ckpt.save(4, model, opt, {})
    except OSError as e:
        (Path(root) / f"error{rank}.txt").write_text(str(e))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_each_rank_reads_back_only_its_own_shards_and_a_rank_failing_to_seal_fails_every_rank(tmp_path):
    """checkpoint.sharded on 2 forked fsdp ranks: rank 1 sums its own DCP file and rank 0 its own and the metadata,
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
    cfg = load_config(None, parse_overrides(SHORT_ARGS))
    model = build_model(cfg.model, "cpu")
    opt_state = torch.optim.AdamW(model.parameters()).state_dict()
    final = checkpoint.save(root, 2, checkpoint.model_state(model), opt_state, {}, keep=3)
    assert not final.is_symlink() and checkpoint.verify_checkpoint(final) is None
    assert [p.name for p in mine.iterdir()] == ["precious"] and (mine / "precious").read_text() == "the user's"


def test_a_full_disk_in_torch_save_is_disk_full_naming_the_file(tmp_path, monkeypatch):
    """torch.save's own writer reports ENOSPC as a bare RuntimeError ("unexpected pos"); written through a file
    object, the OSError is its context, and the save removes its temp directory."""
    cfg = load_config(None, parse_overrides(SHORT_ARGS))
    model = build_model(cfg.model, "cpu")
    opt = torch.optim.AdamW(model.parameters())
    root = tmp_path / rundirs.CHECKPOINTS_DIR
    checkpoint.save(root, 2, checkpoint.model_state(model), opt.state_dict(), {}, keep=3)
    real = torch.save

    def full(obj, f, *args, **kwargs):
        if isinstance(f, (str, Path)):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(DiskFull) as e:
        checkpoint.save(root, 4, checkpoint.model_state(model), opt.state_dict(), {}, keep=3)
    monkeypatch.setattr(checkpoint.torch, "save", real)
    assert f"writing {root / '.tmp_step_000004' / rundirs.OPTIMIZER_FILE}" in str(e.value)
    assert sorted(p.name for p in root.iterdir()) == [rundirs.LATEST_FILE, "step_000002"]
    assert checkpoint.verify_checkpoint(root / "step_000002") is None

