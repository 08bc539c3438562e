"""Checkpoints: atomic save with a checksummed manifest, exact resume, and background copies to a mirror.

A checkpoint directory `checkpoints/step_NNNNNN/` holds
  model.safetensors  weights (a tied LM head is stored once, as embed.weight)
  optimizer.pt       optimizer state (torch.save; loaded with weights_only=True)
  state.json         step, tokens seen, run state, loader position, data fingerprint, resolved config, versions
  rng.pt             python / numpy / torch (/ CUDA) RNG states of every rank (weights_only=True)
  COMPLETE           written last: a JSON manifest of every file's size and crc32
It is written to `.tmp_step_NNNNNN/`, fsynced, renamed into place; `checkpoints/latest` is updated last.
On resume the newest checkpoint whose manifest verifies is used; a broken one is renamed `corrupt_step_NNNNNN`
with a warning and the previous one is tried.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import random
import re
import shutil
import threading
import zlib
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nanopt import runtime
from nanopt.config import Config, ConfigError
from nanopt.faults import fault_hook

log = logging.getLogger("nanopt")

STEP_DIR = re.compile(r"^step_(\d{6,})$")

# Config keys that may differ between a checkpoint and the run resuming it: they change how long the run
# goes, what it logs or where things live, not the state the next step computes from.
SAFE_KEYS = {
    "run.name", "run.dir", "train.max_steps", "train.compile", "train.target_val_loss", "train.stop_at_target",
    "train.init_from", "train.loss_chunk_tokens", "model.attention", "data.source", "data.dir", "data.verify_checksum",
    "checkpoint.every", "checkpoint.keep", "checkpoint.resume", "checkpoint.mirror", "checkpoint.allow_changes",
    "eval.every", "eval.test_at_end",
}
# Not eval.seed / eval.batches: they pick the validation windows, so changing them mid-run would make the
# val-loss curve before and after the resume measure different tokens.
SAFE_SECTIONS = {"log", "sample", "runtime", "profile", "prepare", "mfu"}
DERIVED_KEYS = {"train.grad_accum_steps"}  # follows from the world size, which may change


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights to save: contiguous CPU tensors, the tied head left out (it is embed.weight)."""
    state = {}
    seen: dict[int, str] = {}
    # A tied parameter is listed once by named_parameters(); XLA tensors have no data_ptr (all 0) to compare.
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    for name, t in model.state_dict().items():
        if name in tied or (t.data_ptr() and t.data_ptr() in seen):  # tied: already stored under its first name
            continue
        seen[t.data_ptr()] = name
        state[name] = t.detach().to("cpu").contiguous()
    return state


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    check_shapes(model, path)
    state = load_file(str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.cfg, "tie_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def check_shapes(model: torch.nn.Module, path: Path) -> None:
    """Raise ValueError naming the first tensors whose saved shape differs from the model's."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with safe_open(str(path), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    wrong = [f"{k} {saved[k]} in the checkpoint vs {own[k]} in the model"
             for k in saved if k in own and saved[k] != own[k]]
    if wrong:
        raise ValueError(f"{path} holds weights of other shapes: {'; '.join(wrong[:3])}")


# ---------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """This process's RNG states, in types torch.load(weights_only=True) accepts."""
    _, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    state.update(runtime.device_rng_state())  # CUDA generators where a GPU is in use
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    npy = state["numpy"]
    if isinstance(npy, dict):
        npy = ("MT19937", npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    np.random.set_state(npy)
    torch.set_rng_state(state["torch"])
    runtime.set_device_rng_state(state)


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---------------------------------------------------------------- save


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def save(
    ckpt_root: Path, step: int, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
    state: dict[str, Any], keep: int, rng: Optional[list[dict[str, Any]]] = None,
) -> Path:
    """Write checkpoints/step_NNNNNN atomically and prune to the newest `keep`. Rank 0 only.

    `rng` is every rank's rng_state() in rank order (default: this process's only).
    """
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    # One metadata entry only: safetensors writes a map, and its order is not stable across processes.
    save_file(model_state(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    fault_hook("kill-in-save", step)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save({"ranks": rng if rng is not None else [rng_state()]}, tmp / "rng.pt")
    versions = {"torch": torch.__version__, "numpy": np.__version__}
    (tmp / "state.json").write_text(json.dumps({**state, "step": step, "versions": versions}, indent=2))
    manifest = {}
    for f in sorted(tmp.iterdir()):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        manifest[f.name] = {"bytes": f.stat().st_size, "crc32": _crc32(f)}
    with open(tmp / "COMPLETE", "w") as fh:
        json.dump({"step": step, "files": manifest}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists():  # same step saved again (e.g. final save right after a periodic one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_root)
    fault_hook("kill-after-save", step)
    (ckpt_root / "latest.tmp").write_text(final.name + "\n")
    os.replace(ckpt_root / "latest.tmp", ckpt_root / "latest")
    for old in complete_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / "COMPLETE").exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def read_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "state.json").read_text())


def verify(ckpt: Path) -> Optional[str]:
    """None if the checkpoint is whole, else why not (missing marker, missing file, size or crc32 mismatch)."""
    marker = ckpt / "COMPLETE"
    if not marker.exists():
        return "it has no COMPLETE marker (its write was interrupted)"
    text = marker.read_text()
    try:
        files = json.loads(text)["files"]
    except (ValueError, KeyError, TypeError):
        if text.strip() != "ok":  # "ok" = a checkpoint from before manifests: check what can be checked
            return "its COMPLETE manifest is unreadable"
        files = {name: None for name in ("model.safetensors", "state.json")}
    for name, expected in files.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if expected is None:
            continue
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if _crc32(path) != expected["crc32"]:
            return f"{name} fails its crc32 checksum (the file is corrupt)"
    try:
        read_state(ckpt)["step"]
    except (ValueError, KeyError, TypeError):
        return "state.json is unreadable"
    return None


# ---------------------------------------------------------------- config and data checks


def _flatten(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, values in cfg_dict.items() if isinstance(values, dict) for k, v in values.items()}


def config_changes(saved: dict[str, Any], cfg: Config) -> list[str]:
    """Keys whose value differs from the checkpoint's and that are neither known safe nor allowed by the user."""
    before, now = _flatten(saved), _flatten(cfg.to_dict())
    allowed = {k.strip() for k in cfg.checkpoint.allow_changes.split(",") if k.strip()}
    out = []
    for key in sorted(before.keys() & now.keys()):  # a key only one side knows is from another nanopt version
        if before[key] == now[key] or key in SAFE_KEYS | DERIVED_KEYS | allowed or key.split(".")[0] in SAFE_SECTIONS:
            continue
        out.append(f"{key}: {before[key]!r} in the checkpoint, {now[key]!r} now")
    return out


def data_fingerprint(paths: list[Path]) -> list[dict[str, Any]]:
    """Name, token count, vocabulary and stored crc32 of each training shard (headers only: cheap)."""
    from nanopt.data import HEADER, HEADER_BYTES

    out = []
    for p in paths:
        with open(p, "rb") as f:
            _, _, _, count, vocab, crc = HEADER.unpack_from(f.read(HEADER_BYTES))
        out.append({"name": p.name, "tokens": count, "vocab": vocab, "crc32": crc})
    return out


def _describe_data_change(before: list[dict], now: list[dict]) -> Optional[str]:
    if before == now:
        return None
    if len(before) != len(now):
        return f"the checkpoint was trained on {len(before)} shard(s), the data has {len(now)}"
    for a, b in zip(before, now):
        if a != b:
            diff = ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in a if a.get(k) != b.get(k))
            return f"shard {a.get('name')} differs ({diff})"
    return "the shards differ"


# ---------------------------------------------------------------- mirror


class Mirror:
    """Copies each completed checkpoint to an fsspec URL in a background thread; fetches them back.

    The remote layout matches the local one: URL/step_NNNNNN/<files> with COMPLETE uploaded last (object
    stores have no atomic rename), then URL/latest. Uploads read from hard-linked snapshots, so pruning the
    local directory never races an upload.
    """

    def __init__(self, url: str, keep: int):
        try:
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise ConfigError(
                f"`checkpoint.mirror` is {url!r}, which fsspec cannot open ({e}). Use a local path or file://, "
                f"or install the filesystem's package (gcsfs for gs://, s3fs for s3://)."
            ) from None
        self.url, self.keep = url, keep
        self.root = self.root.rstrip("/")
        self.failures: list[str] = []
        self._queue: "queue.Queue[Path]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def upload(self, ckpt: Path) -> None:
        """Queue a copy of `ckpt`; returns at once."""
        staging = ckpt.parent / ".mirror-staging" / ckpt.name
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        for f in ckpt.iterdir():
            try:
                os.link(f, staging / f.name)
            except OSError:  # a filesystem without hard links
                shutil.copy2(f, staging / f.name)
        self._queue.put(staging)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="nanopt-mirror", daemon=True)
            self._thread.start()

    def wait(self) -> None:
        """Block until every queued copy is done (or failed with a warning)."""
        if self._thread is not None:
            self._queue.join()

    def _work(self) -> None:
        while True:
            staging = self._queue.get()
            try:
                self._put(staging)
            except Exception as e:  # a remote hiccup must not kill training; the local checkpoint is intact
                self.failures.append(f"{staging.name}: {e}")
                log.warning("checkpoint mirror: copying %s to %s failed: %s", staging.name, self.url, e)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
                self._queue.task_done()

    def _put(self, staging: Path) -> None:
        remote = f"{self.root}/{staging.name}"
        if self.fs.exists(remote):
            self.fs.rm(remote, recursive=True)
        self.fs.makedirs(remote, exist_ok=True)
        names = sorted(f.name for f in staging.iterdir() if f.name != "COMPLETE") + ["COMPLETE"]
        for name in names:
            self.fs.put_file(str(staging / name), f"{remote}/{name}")
        self.fs.pipe_file(f"{self.root}/latest", (staging.name + "\n").encode())
        for step in self.steps()[:-self.keep]:
            self.fs.rm(f"{self.root}/step_{step:06d}", recursive=True)
        log.info("checkpoint mirror: %s copied to %s", staging.name, self.url)

    def steps(self) -> list[int]:
        """Steps of complete remote checkpoints, oldest first."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for entry in entries:
            m = STEP_DIR.match(str(entry).rstrip("/").rsplit("/", 1)[-1])
            if m and self.fs.exists(f"{self.root}/{m.group(0)}/COMPLETE"):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def fetch(self, step: int, ckpt_root: Path) -> Path:
        """Download URL/step_NNNNNN into ckpt_root (via a temp dir) and return it; ValueError if it does not verify."""
        name = f"step_{step:06d}"
        tmp = ckpt_root / f".tmp_{name}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        for entry in self.fs.ls(f"{self.root}/{name}", detail=False):
            fname = str(entry).rstrip("/").rsplit("/", 1)[-1]
            self.fs.get_file(f"{self.root}/{name}/{fname}", str(tmp / fname))
        problem = verify(tmp)
        if problem:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(problem)
        os.replace(tmp, ckpt_root / name)
        return ckpt_root / name


# ---------------------------------------------------------------- the run's checkpointer


class Checkpointer:
    """Everything train() asks of checkpoints: restore at start, save (all ranks call it), finish mirror copies."""

    def __init__(self, cfg: Config, rt: Any, data_paths: list[Path]):
        self.cfg, self.rt = cfg, rt
        self.run_dir = cfg.run_dir
        self.root = self.run_dir / "checkpoints"
        self.data = data_fingerprint(data_paths)
        self.mirror = Mirror(cfg.checkpoint.mirror, cfg.checkpoint.keep) if cfg.checkpoint.mirror else None
        self.latest: Optional[Path] = None  # the newest good checkpoint of this run
        self.last_saved_step = -1
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ConfigError(f"the run directory {self.run_dir} is a file; set `run.dir` to a directory "
                              f"(or remove the file).")
        if rt.is_main:  # fail now, in one paragraph, rather than at the first checkpoint
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"cannot create the run directory {self.run_dir} ({e.strerror}); "
                                  f"set `run.dir` to a writable directory.") from None
            if self.mirror is not None:
                try:
                    self.mirror.fs.makedirs(self.mirror.root, exist_ok=True)
                except Exception as e:  # any fsspec backend error: permissions, credentials, network
                    raise ConfigError(f"`checkpoint.mirror` {cfg.checkpoint.mirror!r} cannot be written ({e}); "
                                      f"check the URL and credentials, or unset it.") from None

    # -- restore

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: Any) -> Optional[dict[str, Any]]:
        """Load the newest usable checkpoint into model/optimizer/loader/RNGs; its state.json, or None to start fresh."""
        rt = self.rt
        if not self.cfg.checkpoint.resume:
            if self.run_dir.is_dir() and any(self.run_dir.iterdir()):
                raise ConfigError(
                    f"`checkpoint.resume` is false (start fresh) but the run directory {self.run_dir} is not empty, "
                    f"and nanopt never overwrites a run. Pick a new `run.dir` (or `run.name`), delete the directory, "
                    f"or drop `--checkpoint.resume=false` to continue the run from its newest checkpoint."
                )
            rt.barrier()  # every rank looks before rank 0 writes into the directory
            return None
        # Rank 0 picks (and, when needed, downloads) the checkpoint; all ranks load that same one.
        chosen, error = 0, None
        if rt.is_main:
            try:
                found = self._choose()
                chosen = int(STEP_DIR.match(found.name).group(1)) + 1 if found else 0
            except ConfigError as e:
                chosen, error = -(rt.world_size + 1), e
        code = torch.tensor([chosen], dtype=torch.int64, device=rt.device)
        chosen = int(rt.all_reduce_sum(code).item())
        if error is not None:
            raise error
        if chosen < 0:
            raise ConfigError(f"rank 0 could not resume from {self.root}; its message says why.")
        if chosen == 0:
            if rt.is_main:
                trim_metrics(self.run_dir / "metrics.jsonl", 0)
            return None
        ckpt = self.root / f"step_{chosen - 1:06d}"
        saved = self._load(ckpt, model, optimizer, loader)
        self.latest = ckpt
        if rt.is_main:
            trim_metrics(self.run_dir / "metrics.jsonl", saved["step"])
            log.info("resuming from %s (step %d, %s tokens seen)", ckpt, saved["step"],
                     f"{saved.get('tokens_seen', 0):,}")
        return saved

    def _choose(self) -> Optional[Path]:
        """Newest verified local checkpoint, else the newest verified one on the mirror, else None (fresh)."""
        root = self.root
        problems = []
        if root.is_dir():
            for tmp in root.glob(".tmp_step_*"):
                log.warning("removing %s: a checkpoint write that was interrupted", tmp)
                shutil.rmtree(tmp, ignore_errors=True)
            dirs = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
            for p in sorted(dirs, key=lambda p: int(STEP_DIR.match(p.name).group(1)), reverse=True):
                problem = verify(p)
                if problem is None:
                    return p
                aside = p.with_name("corrupt_" + p.name)
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(p, aside)
                log.warning("skipping checkpoint %s: %s; moved it to %s and trying the previous one", p, problem, aside)
                problems.append(f"{p.name}: {problem}")
        if self.mirror is not None:
            for step in reversed(self.mirror.steps()):
                root.mkdir(parents=True, exist_ok=True)
                try:
                    found = self.mirror.fetch(step, root)
                except (ValueError, OSError) as e:
                    log.warning("skipping mirror checkpoint step_%06d in %s: %s", step, self.mirror.url, e)
                    problems.append(f"mirror step_{step:06d}: {e}")
                    continue
                log.info("no usable local checkpoint: fetched step_%06d from the mirror %s", step, self.mirror.url)
                return found
        if problems:
            raise ConfigError(
                f"no usable checkpoint in {root}: {'; '.join(problems)}. Nothing was loaded. To start the run over, "
                f"move or delete {self.run_dir} (or set `run.dir` to a new directory)."
            )
        return None

    def _load(self, ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: Any) -> dict[str, Any]:
        saved = read_state(ckpt)
        fix = ("Resume with the checkpoint's values, start a new run (a new `run.dir`), or accept the change with "
               "`--checkpoint.allow_changes=KEY[,KEY...]` (the run will then differ from an uninterrupted one).")
        changes = config_changes(saved.get("config", {}), self.cfg)
        if changes:
            raise ConfigError(
                f"the config differs from the one checkpoint {ckpt} was trained with: {'; '.join(changes)}. {fix}"
            )
        data_change = _describe_data_change(saved["data"], self.data) if "data" in saved else None
        if data_change:
            raise ConfigError(
                f"the training shards do not match checkpoint {ckpt}: {data_change}. Point `data.source` at the "
                f"shards the run was trained on, or start a new run (a new `run.dir`)."
            )
        try:
            load_model_weights(model, ckpt / "model.safetensors")
        except (ValueError, RuntimeError) as e:
            raise ConfigError(f"checkpoint {ckpt} does not fit this config's model: {e}. {fix}") from None
        # init_device: XLA storages cannot be mapped straight to the device; load_state_dict moves them.
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True, map_location=self.rt.init_device))
        loader.load_state_dict(saved["loader"])
        rngs = torch.load(ckpt / "rng.pt", weights_only=True)
        ranks = rngs["ranks"] if "ranks" in rngs else [rngs]
        if len(ranks) != self.rt.world_size and self.rt.is_main:
            log.warning("checkpoint has RNG states of %d rank(s), this run has %d: ranks beyond them take rank 0's",
                        len(ranks), self.rt.world_size)
        set_rng_state(ranks[self.rt.rank] if self.rt.rank < len(ranks) else ranks[0])
        self.last_saved_step = saved["step"]
        return saved

    # -- save

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: Any,
             run_state: dict[str, Any]) -> Path:
        """Every rank calls this (RNG states are gathered); rank 0 writes. Returns the checkpoint path."""
        final = self.root / f"step_{step:06d}"
        if step == self.last_saved_step:  # e.g. a preemption right after a periodic save
            return final
        rngs = self.rt.gather_objects(rng_state())
        if self.rt.is_main:
            state = {**run_state, "loader": loader.state_dict(), "data": self.data, "config": self.cfg.to_dict()}
            final = save(self.root, step, model, optimizer, state, keep=self.cfg.checkpoint.keep, rng=rngs)
            if self.mirror is not None:
                self.mirror.upload(final)
        self.rt.barrier()
        self.latest, self.last_saved_step = final, step
        return final

    def close(self) -> None:
        """Wait for queued mirror copies; warn about any that failed."""
        if self.mirror is not None and self.rt.is_main:
            self.mirror.wait()
            if self.mirror.failures:
                log.warning("checkpoint mirror %s: %d copy(ies) failed: %s", self.mirror.url,
                            len(self.mirror.failures), "; ".join(self.mirror.failures))


def trim_metrics(path: Path, step: int) -> None:
    """Drop metrics.jsonl records past `step` (all of them for a fresh start): the resumed run logs them again."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record_step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):
            continue
        if step > 0 and record_step <= step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
