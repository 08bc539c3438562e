"""Checkpoints on disk: atomic save (temp dir, fsync, rename), newest-complete lookup, keep last k.

A checkpoint directory `checkpoints/step_NNNNNN/` holds
  model.safetensors  weights (a tied LM head is stored once, as embed.weight)
  optimizer.pt       optimizer state (torch.save; loaded with weights_only=True)
  state.json         step, tokens seen, loader position, resolved config, library versions
  rng.pt             python / numpy / torch RNG states
  COMPLETE           written last; a directory without it is ignored
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger("nanopt")

STEP_DIR = re.compile(r"^step_(\d{6,})$")


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights to save: contiguous CPU tensors, the tied head left out (it is embed.weight)."""
    state = {}
    seen: dict[int, str] = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:  # tied: already stored under its first name
            continue
        seen[t.data_ptr()] = name
        state[name] = t.detach().to("cpu").contiguous()
    return state


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    state = load_file(str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.cfg, "tie_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    ckpt_root: Path, step: int, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
    state: dict[str, Any], keep: int,
) -> Path:
    """Write checkpoints/step_NNNNNN atomically and prune to the newest `keep`. Rank 0 only."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(model_state(model), str(tmp / "model.safetensors"), metadata={"format": "pt", "step": str(step)})
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    versions = {"torch": torch.__version__, "numpy": np.__version__}
    (tmp / "state.json").write_text(json.dumps({**state, "step": step, "versions": versions}, indent=2))
    (tmp / "COMPLETE").write_text("ok\n")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists():  # same step saved again (e.g. final save right after a periodic one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_root)
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
