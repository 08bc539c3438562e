"""THE checkpoint format (file names: rundirs.py): one save path whatever the parallelism and world size, one
verifier, the newest complete checkpoint, exact resume, copies to a mirror (any fsspec URL). `step_NNNNNN/` holds
dcp/ (what a resume loads: every rank's DCP shards of weights, optimizer state and average), model.safetensors and
ema.safetensors (the whole weights for readers; nanopt average's checkpoints have only these), rng.pt, state.json and
COMPLETE, written last: every file's size and crc32. Every rank writes into `.tmp_step_NNNNNN/`, then rank 0 renames
it; a full disk is DiskFull (exit 1). Readers take the newest checkpoint that verifies, naming each one skipped."""
from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial, reduce
from itertools import takewhile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from nanopt.config import Config, config_from_dict, resume_changes
from nanopt.data import shards
from nanopt.distributed import parallel
from nanopt.distributed.runtime import Runtime, host_rng_state
from nanopt.errors import ConfigError, DiskFull, ShardError
from nanopt.io import fsync, not_a_file, refuse_link, write_json, write_text, writing
from nanopt.recipe import optim
from nanopt.rundirs import (APPENDED_FILES, CHECKPOINTS_DIR, COMPLETE_FILE, CONFIG, CONFIG_FILE, DCP_DIR, DCP_METADATA,
                            EMA_FILE, LATEST_FILE, MODEL_FILE, RNG_FILE, STATE_FILE, STEP_DIR, SUMMARY_FILE, is_lease,
                            read_summary)
from nanopt.schema import Field, parse, problem, raw, read
from nanopt.training.ema import EMA
from nanopt.training.faults import fault_hook

if TYPE_CHECKING:  # what the checkpointer saves besides weights and optimizer: a JSON-able state_dict()
    from torch.distributed.checkpoint.stateful import Stateful

log = logging.getLogger("nanopt")
# The shapes of a checkpoint's own JSON files (schema's); a COMPLETE entry that could climb out is no checkpoint file.
SHARD_FILE = re.compile(rf"^{DCP_DIR}/(\.metadata|__\d+_\d+\.distcp)$")
ENTRY = Field(dict, what="an object with integer `bytes` and `crc32`",
              fields={k: Field(int, required=True, lo=0) for k in ("bytes", "crc32")})
MANIFEST = Field(dict, what="a JSON object with a `files` map", fields={"files": Field(
    dict, required=True, fields={name: Field(object, required=True) for name in (MODEL_FILE, RNG_FILE, STATE_FILE)},
    items=ENTRY, test=lambda files: all(n in (MODEL_FILE, RNG_FILE, STATE_FILE, EMA_FILE) or SHARD_FILE.match(n)
                                        for n in files),
    what=f"a map of checkpoint files ({MODEL_FILE}, {RNG_FILE}, {STATE_FILE}, {EMA_FILE}, {DCP_DIR}/'s shards)")})
STEP = Field(dict, what="a checkpoint state (a JSON object with an integer `step`)",
             fields={"step": Field(int, required=True, lo=0)})
# What readers and a resume read of state.json besides the step; each component's entry is its load_state_dict's.
STATE = Field(dict, what=STEP.what, fields={
    **STEP.fields, "data": Field(list, items=Field(dict)), "config": Field(dict),
    "ema": Field(dict, fields={"started": Field(bool)}), "averaged_from": Field(dict, fields={
        "run": Field(str, required=True), "weights": Field(str),
        "checkpoints": Field(list, required=True, items=Field(dict, fields={"step": Field(int, required=True)}))})})
EARLIER = "Resume from an earlier checkpoint (move this one aside), or start a new run (a new `run.dir`)."
# What reading a file whose bytes verified (behind a rewritten manifest) raises when this version did not write it.
DAMAGED_CONTENT = (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError, EOFError,
                   pickle.UnpicklingError, SafetensorError)


def model_state(model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The whole weights as contiguous CPU tensors, a tied parameter once (named_parameters() lists it once; XLA
    tensors have no data_ptr to compare). Every rank calls it (sharded tensors are gathered); keep=False gets {}."""
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    # Lazy, one tensor at a time; every rank takes part in each sharded tensor's gather, kept or not.
    wholes = ((name, parallel.whole(t.detach())) for name, t in model.state_dict().items() if name not in tied)
    return {name: whole.to("cpu").contiguous() for name, whole in wholes if keep}


def weights_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """A safetensors file's tensors as name -> (shape, dtype), from its header; ConfigError when it is none."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except SafetensorError as e:
        raise ConfigError(f"{path} is not a safetensors file ({e}); the checkpoint is damaged. Use an earlier "
                          f"checkpoint (its checkpoints/step_NNNNNN directory), or leave this one out.") from None


# ---------------------------------------------------------------- the resumable state: DCP, every rank its shards
def _indexed(by_name: dict[str, Any]) -> dict[str, Any]:
    """DCP's optimizer state (keyed by parameter name) keyed by position, as Optimizer.state_dict() numbers them."""
    position = {name: i for i, name in enumerate(n for g in by_name["param_groups"] for n in g["params"])}
    return {"state": {position[name]: s for name, s in by_name["state"].items()},
            "param_groups": [dict(g, params=[position[n] for n in g["params"]]) for g in by_name["param_groups"]]}


def _flat(prefix: str, tree: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of nested dicts under the names DCP flattens them to ("optimizer.state.embed.weight.exp_avg"):
    written out rather than taken from DCP's private _nested_dict module, which a torch release may move."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(f"{prefix}.{key}", value)
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


def _dcp(path: Path, state: dict[str, Any], save: bool) -> None:
    """dcp.save of `state` into `path`, or dcp.load into it in place (tensors the files lack are left as they are);
    one process needs no process group. DCP's failures are the OSError a rank met (a full disk), or a RuntimeError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # one process without a process group is a use, not an accident, here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            if save:
                dcp.save(state, checkpoint_id=str(path))
            else:
                dcp.load(state, checkpoint_id=str(path), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    except CheckpointException as e:
        first = next(iter(e.failures.values()), (None,))[0]
        if isinstance(first, OSError):  # a full disk on any rank is DiskFull on every rank (the caller's writing())
            raise first from None
        lines = str(e).strip().splitlines()
        raise RuntimeError(lines[-1][:500] if lines else e.__class__.__name__) from None


# ---------------------------------------------------------------- the format: verified, the newest complete one
def step_of(ckpt: Path | str) -> Optional[int]:
    """step_000042 -> 42; None for any other name."""
    return int(match.group(1)) if (match := STEP_DIR.match(Path(ckpt).name)) else None


def checkpoint_dirs(path: Path) -> list[Path]:
    """The step_NNNNNN directories of a run (or checkpoints/) directory, oldest first, whole or not."""
    root = Path(path) / CHECKPOINTS_DIR if (Path(path) / CHECKPOINTS_DIR).is_dir() else Path(path)
    found = [p for p in root.iterdir() if step_of(p) is not None and p.is_dir()] if root.is_dir() else []
    return sorted(found, key=step_of)


def crc32_of(path: Path) -> int:
    with open(path, "rb") as f:  # 16 MiB at a time
        return reduce(lambda crc, chunk: zlib.crc32(chunk, crc), iter(partial(f.read, 1 << 24), b""), 0)


def _own_file(path: Path, shape: Field, subject: str, missing: str = "") -> tuple[Any, Optional[str]]:
    """(the JSON file at `path`, None) when it is of `shape`, else (None, why; `missing` if absent): schema's reader."""
    try:
        data = raw(path)
    except ConfigError as e:  # a directory or a FIFO at the name (io), a link to nothing
        return None, str(e)
    if data is None:
        return None, missing or f"{subject} is missing"
    value, why = parse(data, subject)
    if (why := why or problem(value, shape, subject)) and not why.startswith(subject):
        why = f"{subject}'s {why}"  # a field's problem: "its COMPLETE manifest's `files.rng.pt` is missing"
    return (None, why) if why else (value, None)


def _manifest(ckpt: Path) -> tuple[Optional[str], dict[str, Any]]:
    """(why COMPLETE is not a usable manifest, its file entries)."""
    manifest, why = _own_file(Path(ckpt) / COMPLETE_FILE, MANIFEST, f"its {COMPLETE_FILE} manifest",
                              "it has no COMPLETE marker (its write was interrupted)")
    return why, manifest["files"] if manifest else {}


def read_state(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's state.json; ConfigError naming it when it is missing or not of STATE's shape."""
    if (state := read(Path(ckpt) / STATE_FILE, STATE, f"The checkpoint is damaged. {EARLIER}")) is None:
        raise ConfigError(f"{Path(ckpt) / STATE_FILE} is missing; the checkpoint is damaged. {EARLIER}")
    return state


def weights_crc32(ckpt: Path, name: str = MODEL_FILE) -> Optional[int]:
    """Which weights a checkpoint holds: `name`'s crc32 as COMPLETE lists it; None where it lists none."""
    return _manifest(Path(ckpt))[1].get(name, {}).get("crc32")  # no entries when COMPLETE is unusable


def _writer(name: str, world: int = 1 << 30) -> Optional[int]:
    """The rank below `world` that wrote DCP shard file `name` (`__RANK_N.distcp`); None for any other file."""
    match = re.search(r"(^|/)__(\d+)_\d+\.distcp$", name)
    return int(match.group(2)) if match and int(match.group(2)) < world else None


def verify_shares(files: dict[str, dict[str, int]], world: int) -> list[set[str]]:
    """Which of COMPLETE's files each of `world` ranks verifies: shard `__N_0.distcp` on rank N, the one that wrote
    it (at 8B one rank alone would read 96 GB); every other file, largest first, on the rank with the fewest bytes."""
    shares: list[set[str]] = [set() for _ in range(world)]
    load = [0] * world
    for name in sorted(files, key=lambda n: (_writer(n, world) is None, -files[n]["bytes"])):
        rank = load.index(min(load)) if (rank := _writer(name, world)) is None else rank
        shares[rank].add(name)
        load[rank] += files[name]["bytes"]
    return shares


def _share_problem(ckpt: Path, files: dict[str, dict[str, int]], rank: int, world: int) -> Optional[tuple[int, str]]:
    """Rank `rank`'s first problem in its share of `files`, as (its place in the manifest, why)."""
    mine = verify_shares(files, world)[rank]
    for i, name in ((i, name) for i, name in enumerate(files) if name in mine):
        path, expected = ckpt / name, files[name]
        try:
            if not path.is_file():
                return i, f"{name} is missing"
            if (size := path.stat().st_size) != expected["bytes"]:
                return i, f"{name} has {size} bytes, the manifest says {expected['bytes']}"
            if crc32_of(path) != expected["crc32"]:
                return i, f"{name} fails its crc32 checksum (the file is corrupt)"
        except OSError as e:
            return i, f"it cannot be read ({e})"
    return None


def verify_checkpoint(ckpt: Path, step: Optional[int] = None, rt: Optional[Runtime] = None) -> Optional[str]:
    """None when the checkpoint is whole, else why not (never raises): its name, COMPLETE, every listed file's size
    and crc32, then state.json's step. `step`: the step it must hold (default: its name's; a download's is temporary).
    `rt` (resume): rank 0 calls it while the other ranks _follow, each rank verifying its share."""
    ckpt = Path(ckpt)
    step = step_of(ckpt) if step is None else step
    if step is None or not ckpt.is_dir():
        return "it is not a step_NNNNNN directory"
    problem_, files = _manifest(ckpt)
    if problem_:
        return problem_
    gather = rt.gather_objects if rt else (lambda mine: [mine])
    gather((str(ckpt), files))  # what every rank verifies next
    if found := [p for p in gather(_share_problem(ckpt, files, rt.rank if rt else 0, rt.world_size if rt else 1)) if p]:
        return min(found)[1]
    state, why = _own_file(ckpt / STATE_FILE, STEP, f"its {STATE_FILE}")
    return why or (None if state["step"] == step else f"its {STATE_FILE} says step {state['step']}, its name step "
                                                      f"{step}")


def _follow(rt: Runtime) -> None:
    """Every rank but 0 while rank 0 chooses: verify this rank's share of each candidate, until rank 0 sends None."""
    while (candidate := rt.gather_objects(None)[0]) is not None:
        path, files = candidate
        rt.gather_objects(_share_problem(Path(path), files, rt.rank, rt.world_size))


def newest_checkpoint(path: Path, newer_than: int = -1,
                      verify: Optional[Callable[[Path], Optional[str]]] = None) -> tuple[Optional[Path], list[str]]:
    """The newest complete checkpoint of a run (or checkpoints/) directory above step `newer_than`, and "name: why"
    for each newer one skipped; no older one is read (verifying reads every byte). `verify`: a resume's."""
    verify = verify or verify_checkpoint  # looked up now: a test may replace verify_checkpoint
    skipped: list[str] = []
    for ckpt in takewhile(lambda c: step_of(c) > newer_than, reversed(checkpoint_dirs(path))):
        if (problem_ := verify(ckpt)) is None:
            return ckpt, skipped
        skipped.append(f"{ckpt.name}: {problem_}")
    return None, skipped


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run or checkpoints/ directory (its newest complete one, each skipped one
    named), or a checkpoint itself; ConfigError when none is."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a run directory (runs/<name>) or a checkpoint directory "
                          f"(runs/<name>/checkpoints/step_NNNNNN).")
    if step_of(path) is not None and path.is_dir():
        if problem_ := verify_checkpoint(path):
            raise ConfigError(f"checkpoint {path} cannot be used: {problem_}. Pick an earlier one in {path.parent}, "
                              f"or give the run directory to take its newest complete checkpoint.")
        return path
    ckpt, skipped = newest_checkpoint(path)
    for line in skipped:
        log.warning("skipping checkpoint %s", line)
    if ckpt is None:
        why = f" ({len(skipped)} damaged: {'; '.join(skipped)})" if skipped else ""
        raise ConfigError(f"{path} holds no complete checkpoint{why}; looked for checkpoints/step_NNNNNN/ with a "
                          f"COMPLETE manifest that verifies. Train the run first, or point at a checkpoint directory.")
    if skipped:
        log.warning("using %s, the newest complete checkpoint", ckpt)
    return ckpt


def checkpoint_config(ckpt: Path) -> Config:
    """The run config a checkpoint was trained with, checked like a YAML config before anything is built."""
    if "config" not in (state := read_state(ckpt)):
        raise ConfigError(f"{ckpt / STATE_FILE} has no `config` entry, so the model shape is unknown; it was not "
                          f"written by this version of nanopt.")
    return config_from_dict(state["config"], str(ckpt / STATE_FILE))


# ---------------------------------------------------------------- writing
def _sealed(path: Path) -> dict[str, int]:
    """A written file fsynced (a full disk can show first there), with its COMPLETE entry."""
    with writing(path):
        fsync(path)
    return {"bytes": path.stat().st_size, "crc32": crc32_of(path)}


def _remove(path: Path) -> None:
    """Remove a directory of ours, or a link in its place (never its target); at a file rmtree's error names it."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _torch_save(obj: Any, path: Path) -> None:
    # Through a file object: a full disk surfaces as the OSError (torch's writer raises a bare RuntimeError).
    with open(path, "xb") as f:
        torch.save(obj, f)


def _temp_dir(ckpt_root: Path, step: int) -> Path:
    """Where checkpoint `step` is written before its rename, made anew (rank 0, before any rank writes)."""
    with writing(tmp := ckpt_root / f".tmp_step_{step:06d}"):
        ckpt_root.mkdir(parents=True, exist_ok=True)
        _remove(tmp)
        tmp.mkdir()
    return tmp


def save(ckpt_root: Path, step: int, weights: dict[str, torch.Tensor], state: dict[str, Any], keep: int,
         rng: Optional[list[dict[str, Any]]] = None, averaged: Optional[dict[str, torch.Tensor]] = None,
         shards: Optional[dict[str, dict[str, int]]] = None) -> Path:
    """Rank 0: write checkpoints/step_NNNNNN atomically and prune to the newest `keep`. `weights`: model_state()'s;
    `shards`: save_resumable's dcp/ entries (None: weights only); `rng`: every rank's (default: this process's);
    `averaged`: EMA.full_weights(). A full disk is DiskFull."""
    final = ckpt_root / f"step_{step:06d}"
    tmp = _temp_dir(ckpt_root, step) if shards is None else ckpt_root / f".tmp_step_{step:06d}"  # save_resumable's
    files = dict(shards or {})

    def put(name: str, write: Callable[[Path], Any]) -> None:
        with writing(tmp / name):
            write(tmp / name)
        files[name] = _sealed(tmp / name)

    try:
        # One metadata entry only: safetensors writes a map, and its order is not stable across processes.
        put(MODEL_FILE, lambda p: save_file(weights, str(p), metadata={"format": "pt"}))
        fault_hook("kill-in-save", step)
        if averaged is not None:
            put(EMA_FILE, lambda p: save_file(averaged, str(p), metadata={"format": "pt"}))
        put(RNG_FILE, lambda p: _torch_save({"ranks": rng if rng is not None else [host_rng_state()]}, p))
        versions = {"torch": torch.__version__, "numpy": np.__version__}
        put(STATE_FILE, lambda p: write_json(p, {**state, "step": step, "versions": versions}))
        write_json(tmp / COMPLETE_FILE, {"step": step, "files": files}, indent=1)
        with writing(tmp):
            if shards:
                fsync(tmp / DCP_DIR)
            fsync(tmp)
    except DiskFull:
        shutil.rmtree(tmp, ignore_errors=True)  # its space back
        raise
    _remove(final)  # same step saved again (e.g. final save right after a periodic one)
    os.replace(tmp, final)
    fsync(ckpt_root)
    fault_hook("kill-after-save", step)
    write_text(ckpt_root / LATEST_FILE, final.name + "\n")
    # Only step_NNNNNN directories are ours to prune; the one just written (verified as it was sealed) is kept.
    for old in checkpoint_dirs(ckpt_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_resumable(ckpt_root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   state: dict[str, Any], keep: int, rt: Runtime, ema: Optional[EMA] = None) -> Path:
    """THE save; every rank calls it. Every rank writes its DCP shards of the weights, optimizer state and average
    (`ema`, once started), then fsyncs and sums the files it wrote from its own page cache (rank 0 alone would read
    configs/8b.yaml's 96 GB again); a rank's failure is every rank's. Rank 0 writes the rest (save(); `state`)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rngs = rt.gather_objects(rt.rng_state())
    started = ema is not None and ema.started
    tmp = rt.on_main(lambda: _temp_dir(ckpt_root, step), (ConfigError, OSError)) or ckpt_root / f".tmp_step_{step:06d}"
    weights, optimizer_state = get_state_dict(model, optimizer)
    try:
        with writing(tmp / DCP_DIR):  # DCP raises one rank's failure on every rank
            _dcp(tmp / DCP_DIR, {"model": weights, "optimizer": optimizer_state,
                                 **({"ema": ema.tensors()} if started else {})}, save=True)
        try:
            mine: tuple[dict[str, dict[str, int]], Optional[OSError]] = ({
                f"{DCP_DIR}/{p.name}": _sealed(p) for p in sorted((tmp / DCP_DIR).iterdir())
                if (_writer(p.name) or 0) == rt.rank}, None)
        except OSError as e:  # gathered, so that every rank raises it rather than waiting for the failed one
            mine = ({}, e)
        parts = rt.gather_objects(mine)  # also the barrier: every rank's shards are on disk after it
        if errors := [error for _, error in parts if error is not None]:
            raise errors[0]
    except DiskFull:
        if rt.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # its space back
        raise
    whole = model_state(model, keep=rt.is_main)
    averaged = ema.full_weights(keep=rt.is_main) if started else None
    if not rt.is_main:
        return ckpt_root / f"step_{step:06d}"
    return save(ckpt_root, step, whole, state, keep, rng=rngs, averaged=averaged,
                shards={name: entry for files, _ in parts for name, entry in files.items()})


# ---------------------------------------------------------------- copies to a mirror
class Mirror:
    """URL/step_NNNNNN/<files> as locally, COMPLETE uploaded last (object stores have no atomic rename), then
    URL/latest. Uploads read hard-linked snapshots, so pruning the local directory never races an upload."""

    def __init__(self, url: str, keep: int):
        try:
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise ConfigError(f"`checkpoint.mirror` is {url!r}, which fsspec cannot open ({e}). Use a local path or "
                              "file://, or install the filesystem's package (gcsfs for gs://, s3fs for "
                              "s3://).") from None
        self.url, self.keep, self.root = url, keep, self.root.rstrip("/")
        self.failures: list[str] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nanopt-mirror")

    def upload(self, ckpt: Path) -> None:
        """Queue a copy of `ckpt`; returns at once."""
        staging = ckpt.parent / ".mirror-staging" / ckpt.name
        shutil.rmtree(staging, ignore_errors=True)  # a snapshot left by a crash; copytree makes its parent
        try:
            shutil.copytree(ckpt, staging, copy_function=os.link)
        except (OSError, shutil.Error):  # a filesystem without hard links
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(ckpt, staging)
        self._pool.submit(self._copy, staging)

    def wait(self) -> None:
        """Block until every queued copy is done, then warn once about any that failed. No idle thread outlives it
        (it would slow the exit)."""
        self._pool.shutdown(wait=True)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nanopt-mirror")
        if self.failures:
            log.warning("checkpoint mirror %s: %d copy(ies) failed: %s", self.url, len(self.failures),
                        "; ".join(self.failures))
            self.failures.clear()

    def _copy(self, staging: Path) -> None:
        remote = f"{self.root}/{staging.name}"
        try:
            if self.fs.exists(remote):
                self.fs.rm(remote, recursive=True)
            names = (p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
            for name in sorted(names, key=lambda n: (n == COMPLETE_FILE, n)):  # COMPLETE last
                self.fs.makedirs(f"{remote}/{name}".rsplit("/", 1)[0], exist_ok=True)
                self.fs.put_file(str(staging / name), f"{remote}/{name}")
            self.fs.pipe_file(f"{self.root}/{LATEST_FILE}", (staging.name + "\n").encode())
            for name in self.names()[:-self.keep]:
                self.fs.rm(f"{self.root}/{name}", recursive=True)
            log.info("checkpoint mirror: %s copied to %s", staging.name, self.url)
        except Exception as e:  # a remote hiccup must not kill training; the local checkpoint is intact
            self.failures.append(f"{staging.name}: {e}")
            log.warning("checkpoint mirror: copying %s to %s failed: %s", staging.name, self.url, e)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def names(self) -> list[str]:
        """The complete remote checkpoints' names (step_NNNNNN with a COMPLETE marker), oldest first."""
        try:
            names = [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        complete = [n for n in names if step_of(n) is not None and self.fs.exists(f"{self.root}/{n}/{COMPLETE_FILE}")]
        return sorted(complete, key=step_of)

    def fetch(self, name: str, dest: Path) -> Path:
        """Download URL/<name>/** into the fresh directory `dest` (the caller verifies it and moves it into place)."""
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        self.fs.get(f"{self.root}/{name}/", f"{dest}/", recursive=True)  # the slashes: its contents into dest
        return dest


# ---------------------------------------------------------------- exact resume and the training loop's checkpointer
@contextmanager
def _reading(ckpt: Path, name: str) -> Iterator[None]:
    """Restoring from checkpoint file `name`: content this version cannot use is ConfigError naming the file."""
    try:
        yield
    except (ConfigError, ShardError):  # already one paragraph (both are ValueErrors)
        raise
    except DAMAGED_CONTENT as e:
        raise _damaged(ckpt, name, e) from e


def _damaged(ckpt: Path, name: str, e: Exception) -> ConfigError:
    return ConfigError(f"checkpoint {ckpt}'s {name} cannot be restored ({e.__class__.__name__}: {e}); it is damaged "
                       f"or was written by another nanopt version. {EARLIER}")


class Checkpointer:
    """What the training loop asks of checkpoints: restore, when to save, saving (all ranks), and on close waiting
    for the mirror. Besides weights, optimizer and RNGs it saves `states`, named Stateful components."""

    def __init__(self, cfg: Config, rt: Runtime, data_paths: list[Path]):
        self.cfg, self.rt, self.run_dir = cfg, rt, cfg.run_dir  # made and locked (lock.DirLock) before this
        self.root = self.run_dir / CHECKPOINTS_DIR
        self.data = shards.identity(data_paths)
        self.mirror = Mirror(cfg.checkpoint.mirror, cfg.checkpoint.keep) if cfg.checkpoint.mirror else None
        self.latest: Optional[Path] = None  # the newest good checkpoint of this run
        if rt.is_main and self.mirror is not None:  # fail now, in one paragraph, rather than at the first checkpoint
            try:
                self.mirror.fs.makedirs(self.mirror.root, exist_ok=True)
            except Exception as e:  # any fsspec backend error: permissions, credentials, network
                raise ConfigError(f"`checkpoint.mirror` {cfg.checkpoint.mirror!r} cannot be written ({e}); "
                                  f"check the URL and credentials, or unset it.") from None

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, states: dict[str, Stateful],
                ema: Optional[EMA] = None) -> Optional[dict[str, Any]]:
        """Load the newest usable checkpoint into model, optimizer, states, `ema` and RNGs: its state.json, or None."""
        if not self.cfg.checkpoint.resume:
            if self.rt.is_main and any(not is_lease(p.name) for p in self.run_dir.iterdir()):
                raise ConfigError(f"`checkpoint.resume` is false (start fresh) but the run directory {self.run_dir} is "
                                  "not empty, and nanopt never overwrites a run. Pick a new `run.dir` (or `run.name`), "
                                  "delete the directory, or drop `--checkpoint.resume=false` to continue the run from "
                                  "its newest checkpoint.")
            self.rt.barrier()  # every rank looks before rank 0 writes into the directory
            return None
        if (chosen := self._agree()) is None:  # nothing was checkpointed and no earlier training shows
            return None
        self.latest = ckpt = self.root / chosen
        saved = self._load(ckpt, model, optimizer, states, ema)
        if self.rt.is_main:
            log.info("resuming from %s (step %d)", ckpt, saved["step"])
        return saved

    def _agree(self) -> Optional[str]:
        """The checkpoint every rank resumes from, or None (fresh). Rank 0 chooses (and downloads) it, alone writing
        and logging, while every rank verifies its share of each candidate; rank 0's refusal is every rank's."""
        rt, chosen, error = self.rt, None, None
        if rt.is_main:
            try:
                for name in APPENDED_FILES:  # before anything is read or written; every rank learns it
                    refuse_link(self.run_dir / name)
                # config.yaml is rewritten by the run: one that is no run config (the user's own file) would be lost.
                read(self.run_dir / CONFIG_FILE, CONFIG, "Training here would replace it with this run's config: move "
                     "it aside (a damaged one of this run's may be deleted), or set `run.dir` to another directory.")
                found = self._choose()
                chosen = found.name if found else None
            except ConfigError as e:
                error = str(e)
            rt.gather_objects(None)  # the other ranks leave _follow
        else:
            _follow(rt)
        chosen, error = rt.gather_objects((chosen, error))[0]
        if error is not None:
            raise ConfigError(error if rt.is_main else f"rank 0 could not resume from {self.root}: {error}")
        return chosen

    def _choose(self) -> Optional[Path]:
        """Rank 0: the newest verified local checkpoint, else the mirror's, else None when the run never saved one;
        ConfigError when it did (`checkpoint.start_over`: None)."""
        ours = [p for p in self.root.iterdir() if p.name.startswith(".tmp_step_") or step_of(p) is not None] \
            if self.root.is_dir() else []
        # Refused now, not at the first save after training: a file where a checkpoint goes, a directory at `latest`.
        if strays := [p for p in ours if not p.is_dir() and not p.is_symlink()]:
            raise ConfigError(f"{strays[0]} is a file, where nanopt keeps a checkpoint directory; it was not written "
                              f"by nanopt and is not deleted. Move it out of {self.root} and run the command again.")
        if (latest := self.root / LATEST_FILE).is_dir() and not latest.is_symlink():
            raise not_a_file(latest, os.stat(latest).st_mode)
        for tmp in (p for p in ours if p.name.startswith(".tmp_step_")):
            log.warning("removing %s: a checkpoint write that was interrupted", tmp)  # ours: the lock is held
            _remove(tmp)
        found, problems = newest_checkpoint(self.root, verify=lambda c: verify_checkpoint(c, rt=self.rt))
        for line in problems:
            log.warning("skipping checkpoint %s", line)
        if found:
            if problems:
                log.warning("resuming from %s, the newest complete checkpoint; the damaged ones were left in place",
                            found.name)
            return found
        for name in reversed(self.mirror.names() if self.mirror else []):  # downloaded and verified into place
            try:
                problem_ = verify_checkpoint(self.mirror.fetch(name, tmp := self.root / f".tmp_{name}"), step_of(name),
                                             self.rt)
            except OSError as e:
                problem_ = str(e)
            if not problem_:
                os.replace(tmp, self.root / name)
                log.info("no usable local checkpoint: fetched %s from the mirror %s", name, self.mirror.url)
                return self.root / name
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("skipping mirror checkpoint %s in %s: %s", name, self.mirror.url, problem_)
            problems.append(f"mirror {name}: {problem_}")
        # What shows that this run saved a checkpoint, though none remains (not metrics: a session killed before its
        # first save is retried by re-running it).
        evidence = problems + [why for why, shows in (
            (f"{CHECKPOINTS_DIR}/{LATEST_FILE} names no checkpoint that is there", (self.root / LATEST_FILE).is_file()),
            (f"{SUMMARY_FILE} is there", read_summary(self.run_dir) is not None)) if shows]
        if not evidence:
            return None
        if self.cfg.checkpoint.start_over:
            log.warning("checkpoint.start_over: no usable checkpoint in %s (%s); training from step 0 and "
                        "starting metrics over", self.root, "; ".join(evidence))
            return None
        raise ConfigError(f"the run directory {self.run_dir} shows saved training but holds no usable checkpoint "
                          f"({'; '.join(evidence)}). Nothing was loaded or changed. If the checkpoints are still "
                          "arriving (a volume not yet synced, a copy in progress), wait and run the same command "
                          "again. To train this run from step 0 instead, add `--checkpoint.start_over=true` (its "
                          "metrics start over; damaged checkpoints are left in place and pruned as new ones are "
                          "saved), or set `run.dir` to a new directory.")

    def _load(self, ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              states: dict[str, Stateful], ema: Optional[EMA]) -> dict[str, Any]:
        trained = checkpoint_config(ckpt)  # checked like a YAML config before it is compared
        weights_header(ckpt / MODEL_FILE)  # not read to resume, but its readers' copy: damage there is damage
        saved = read_state(ckpt)
        fix = ("Resume with the checkpoint's values, start a new run (a new `run.dir`), or accept the change with "
               "`--checkpoint.allow_changes=KEY[,KEY...]` (the run will then differ from an uninterrupted one).")
        if not (ckpt / DCP_METADATA).is_file():
            raise ConfigError(f"checkpoint {ckpt} holds weights only (no {DCP_DIR}/ with the optimizer state): start a "
                              f"new run from its weights, or resume from a full checkpoint.")
        if changes := resume_changes(saved["config"], self.cfg):
            raise ConfigError(f"the config differs from the one checkpoint {ckpt} was trained with: "
                              f"{'; '.join(changes)}. {fix}")
        if (before := saved.get("data", self.data)) != self.data:
            changed = f"the checkpoint was trained on {len(before)} shard(s), the data has {len(self.data)}"
            if len(before) == len(self.data):
                a, b = next((a, b) for a, b in zip(before, self.data) if a != b)
                changed = f"shard {a.get('name')} differs: " + ", ".join(
                    f"{k} {a.get(k)} -> {b.get(k)}" for k in a if a.get(k) != b.get(k))
            raise ConfigError(f"the training shards do not match checkpoint {ckpt}: {changed}. Point `data.source` "
                              f"at the shards the run was trained on, or start a new run (a new `run.dir`).")
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict

        # The template DCP fills in place (get_state_dict initialises an empty optimizer state, changing no weight).
        state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))
        missing = self._read_shards(ckpt, state, fix)
        set_model_state_dict(model, state["model"])
        try:
            optim.load_state_dict(optimizer, _indexed(state["optimizer"]))
        except ValueError as e:  # e.g. an allowed optim.name change: adamw moments cannot seed Muon
            raise ConfigError(f"checkpoint {ckpt}'s optimizer state does not fit this run: {e}.") from None
        except DAMAGED_CONTENT as e:  # not an optimizer's state_dict at all
            raise _damaged(ckpt, DCP_DIR, e) from e
        if missing:
            raise ConfigError(f"checkpoint {ckpt}'s {DCP_DIR}/ does not fit this run's model and optimizer: it holds "
                              f"no {', '.join(missing[:3])}. {fix}")
        if ema is not None:
            self._load_ema(ckpt, saved, ema)
        for name, component in states.items():
            if name == "loader" and (packing := trained.data.packing) != self.cfg.data.packing:
                # An allowed data.packing change: the other loader's position means nothing to this one.
                log.warning("data.packing changed from %s to %s (checkpoint.allow_changes): the loader starts at "
                            "its first batch, not at the checkpoint's position", packing, self.cfg.data.packing)
                continue
            with _reading(ckpt, f"{STATE_FILE} `{name}` entry"):
                component.load_state_dict(saved[name])
        with _reading(ckpt, RNG_FILE):
            ranks = list(torch.load(ckpt / RNG_FILE, weights_only=True)["ranks"])
            if len(ranks) != self.rt.world_size and self.rt.is_main:
                log.warning("checkpoint has RNG states of %d rank(s), this run has %d: ranks beyond them take rank "
                            "0's", len(ranks), self.rt.world_size)
            self.rt.set_rng_state(ranks[self.rt.rank] if self.rt.rank < len(ranks) else ranks[0])
        return saved

    def _read_shards(self, ckpt: Path, state: dict[str, Any], fix: str) -> list[str]:
        """The checkpoint's dcp/ into `state` in place; the names of the tensors it lacks. Tensors of another shape
        are a config change (`fix`; DCP would load the overlap), a cut shard or metadata damage names the file."""
        from torch.distributed.checkpoint import FileSystemReader

        with _reading(ckpt, DCP_METADATA):
            metadata = FileSystemReader(str(ckpt / DCP_DIR)).read_metadata()
            saved = metadata.state_dict_metadata
            # Each shard file's end as its metadata places it: of a file's (file, end) pairs, sorted, the last wins.
            ends = dict(sorted((i.relative_path, i.offset + i.length) for i in (metadata.storage_data or {}).values()))
        tensors = [(name, t) for key in state for name, t in _flat(key, state[key])]
        if wrong := [f"{name} {tuple(saved[name].size)} in the checkpoint vs {tuple(t.shape)} here" for name, t in
                     tensors if name in saved and tuple(getattr(saved[name], "size", t.shape)) != tuple(t.shape)]:
            what = {"optimizer": "optimizer state", "ema": "averaged weights"}.get(wrong[0].split(".", 1)[0], "weights")
            raise ConfigError(f"checkpoint {ckpt}'s {what} does not fit this run: it holds tensors of other shapes: "
                              f"{'; '.join(wrong[:3])}. {fix}")
        for name, end in ends.items():
            if not (ckpt / DCP_DIR / name).is_file() or (ckpt / DCP_DIR / name).stat().st_size < end:
                raise _damaged(ckpt, f"{DCP_DIR}/{name}", EOFError(f"shorter than the {end} bytes its metadata "
                                                                    f"places in it"))
        with _reading(ckpt, f"{DCP_DIR}/ (its .metadata or a shard file)"):
            _dcp(ckpt / DCP_DIR, state, save=False)
        return [name for name, _ in tensors if name not in saved]

    def _load_ema(self, ckpt: Path, saved: dict[str, Any], ema: EMA) -> None:
        """The checkpoint's averaged weights into `ema`; none kept (EMA turned on at resume) leaves it unstarted."""
        if not saved.get("ema", {}).get("started"):
            if ema.start < saved["step"]:
                log.warning("checkpoint %s holds no averaged weights: the average starts from its weights at step "
                            "%d, not at train.ema_start (%d)", ckpt, saved["step"], ema.start)
            return
        if not (ckpt / EMA_FILE).is_file():
            raise ConfigError(f"checkpoint {ckpt}'s {STATE_FILE} says the run kept averaged weights but it holds no "
                              f"{EMA_FILE}; the checkpoint is damaged. {EARLIER}")

        def fill(tensors: dict[str, torch.Tensor]) -> None:
            if missing := self._read_shards(ckpt, {"ema": tensors}, ""):
                raise ConfigError(f"checkpoint {ckpt}'s {DCP_DIR}/ holds no averaged {', '.join(missing[:3])}; "
                                  f"the checkpoint is damaged. {EARLIER}")

        ema.load_tensors(fill)

    def should_save(self, step: int) -> bool:
        """A periodic save after this step; not the last, which finish() saves after the final evaluation."""
        return bool(every := self.cfg.checkpoint.every) and step % every == 0 and step != self.cfg.train.max_steps

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             states: dict[str, Stateful], ema: Optional[EMA] = None) -> Path:
        """Every rank calls this; rank 0 queues the mirror's copy. Returns the checkpoint path."""
        if self.latest and step_of(self.latest) == step:  # e.g. a preemption right after a periodic save
            return self.latest
        state = {**{name: c.state_dict() for name, c in states.items()}, "data": self.data,
                 "config": self.cfg.to_dict(), **({"ema": ema.state_dict()} if ema is not None else {})}
        final = save_resumable(self.root, step, model, optimizer, state, self.cfg.checkpoint.keep, self.rt, ema)
        if self.rt.is_main and self.mirror is not None:
            self.mirror.upload(final)
        self.rt.barrier()
        self.latest = final
        return final

    def close(self) -> None:
        """Wait for queued mirror copies (Mirror.wait). Safe to call again."""
        if self.mirror is not None and self.rt.is_main:
            self.mirror.wait()
