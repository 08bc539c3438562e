"""Loading a trained model from a run directory, a checkpoint, or a Hugging Face Llama directory."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from nanopt import checkpoint, rundirs
from nanopt.config import Config
from nanopt.errors import ConfigError
from nanopt.hf import load_hf
from nanopt.model import Llama, build_model


@dataclass
class Loaded:
    model: Llama
    cfg: Config  # the run's resolved config; for a Hugging Face directory, defaults + its model shape
    source: Path  # the checkpoint directory or the Hugging Face directory
    step: Optional[int]  # optimizer steps behind these weights, when known
    run_dir: Optional[Path]  # the run directory; None for a bare Hugging Face directory


def load(path: str | Path, device: str | torch.device = "cpu", verified: bool = False) -> Loaded:
    """Weights and config from a run directory, a checkpoint or a Hugging Face directory, in eval mode.
    verified: `path` is a checkpoint find_checkpoint just chose (verifying reads every byte: once is enough)."""
    path = Path(path)
    if (path / "config.json").is_file() and not (path / rundirs.STATE_FILE).is_file():  # a Hugging Face directory
        model, cfg = load_hf(path, device)
        return Loaded(model, cfg, path, None, None)
    ckpt = path if verified else checkpoint.find_checkpoint(path)
    cfg = checkpoint.checkpoint_config(ckpt)
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
