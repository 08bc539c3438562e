"""Finding and loading a trained model: a run directory, a checkpoint, or a Hugging Face Llama directory."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from nanopt import checkpoint
from nanopt.config import Config, config_from_dict
from nanopt.errors import ConfigError
from nanopt.hf import load_hf
from nanopt.model import Llama, build_model

log = logging.getLogger("nanopt")


@dataclass
class Loaded:
    model: Llama
    cfg: Config  # the run's resolved config; for a Hugging Face directory, defaults + its model shape
    source: Path  # the checkpoint directory or the Hugging Face directory
    step: Optional[int]  # optimizer steps behind these weights, when known
    run_dir: Optional[Path]  # the run directory; None for a bare Hugging Face directory


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / "state.json").is_file()


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run directory (its newest complete checkpoint), a checkpoints/
    directory, or a checkpoint itself. Raises ConfigError naming what was expected."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a run directory (runs/<name>) or a checkpoint directory "
                          f"(runs/<name>/checkpoints/step_NNNNNN).")
    if (path / "state.json").is_file():
        problem = checkpoint.verify(path)
        if problem:
            raise ConfigError(f"checkpoint {path} cannot be used: {problem}; pick an earlier one in {path.parent}.")
        return path
    for root in (path / "checkpoints", path):
        for ckpt in reversed(checkpoint.complete_checkpoints(root)):
            problem = checkpoint.verify(ckpt)
            if problem is None:
                return ckpt
            log.warning("skipping checkpoint %s: %s", ckpt, problem)
    raise ConfigError(f"{path} holds no complete checkpoint (looked for checkpoints/step_NNNNNN/ with a COMPLETE "
                      f"marker); train the run first, or point at a checkpoint directory.")


def run_dir_of(ckpt: Path) -> Path:
    """runs/<name>/checkpoints/step_N -> runs/<name>."""
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def checkpoint_config(ckpt: Path) -> Config:
    state = checkpoint.read_state(ckpt)
    if "config" not in state:
        raise ConfigError(f"{ckpt / 'state.json'} has no `config` entry, so the model shape is unknown; "
                          f"it was not written by this version of nanopt.")
    return config_from_dict(state["config"])


def load(path: str | Path, device: str | torch.device = "cpu") -> Loaded:
    """Weights and config from a run directory, a checkpoint or a Hugging Face directory, in eval mode."""
    path = Path(path)
    if path.is_dir() and is_hf_dir(path):
        model, cfg = load_hf(path, device)
        return Loaded(model, cfg, path, None, None)
    ckpt = find_checkpoint(path)
    cfg = checkpoint_config(ckpt)
    model = build_model(cfg.model, device, loss_chunk_tokens=cfg.train.loss_chunk_tokens)
    try:
        checkpoint.load_model_weights(model, ckpt / "model.safetensors")
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"the weights in {ckpt} do not fit the model its state.json describes: {e}") from None
    model.eval()
    step = checkpoint.read_state(ckpt).get("step")
    return Loaded(model, cfg, ckpt, step, run_dir_of(ckpt))


def load_model(path: str | Path) -> Llama:
    """`from nanopt import load_model`: the model behind a run directory, checkpoint or Hugging Face
    directory, fp32, on CPU, in eval mode. `model(idx)` (idx: B T int64) returns B T V logits."""
    return load(path, "cpu").model
