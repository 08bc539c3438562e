"""Finding and loading a trained model: a run directory, a checkpoint, or a Hugging Face Llama directory."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from nanopt import checkpoint, rundirs
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


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run directory (its newest complete checkpoint, damaged ones skipped with a
    warning naming each and why), a checkpoints/ directory, or a checkpoint itself; ConfigError when none is."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a run directory (runs/<name>) or a checkpoint directory "
                          f"(runs/<name>/checkpoints/step_NNNNNN).")
    if checkpoint.step_of(path) is not None and path.is_dir():
        problem = checkpoint.verify_checkpoint(path)
        if problem:
            raise ConfigError(f"checkpoint {path} cannot be used: {problem}. Pick an earlier one in {path.parent}, "
                              f"or give the run directory to take its newest complete checkpoint.")
        return path
    ckpt, skipped = checkpoint.newest_checkpoint(path)
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
    state = checkpoint.read_state(ckpt)
    where = str(ckpt / rundirs.STATE_FILE)
    if "config" not in state:
        raise ConfigError(f"{where} has no `config` entry, so the model shape is unknown; it was not written by "
                          f"this version of nanopt.")
    return config_from_dict(state["config"], where)


def load(path: str | Path, device: str | torch.device = "cpu") -> Loaded:
    """Weights and config from a run directory, a checkpoint or a Hugging Face directory, in eval mode."""
    path = Path(path)
    if (path / "config.json").is_file() and not (path / rundirs.STATE_FILE).is_file():  # a Hugging Face directory
        model, cfg = load_hf(path, device)
        return Loaded(model, cfg, path, None, None)
    ckpt = find_checkpoint(path)
    cfg = checkpoint_config(ckpt)
    model = build_model(cfg.model, device, loss_chunk_tokens=cfg.train.loss_chunk_tokens)
    try:
        checkpoint.load_model_weights(model, ckpt / rundirs.MODEL_FILE)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"the weights in {ckpt} do not fit the model its state.json describes: {e}") from None
    model.eval()
    run_dir = ckpt.parent.parent if ckpt.parent.name == rundirs.CHECKPOINTS_DIR else ckpt.parent
    return Loaded(model, cfg, ckpt, checkpoint.read_state(ckpt)["step"], run_dir)


def load_model(path: str | Path) -> Llama:
    """`from nanopt import load_model`: the model behind a run directory, checkpoint or Hugging Face
    directory, fp32, on CPU, in eval mode. `model(idx)` (idx: B T int64) returns B T V logits."""
    return load(path, "cpu").model
