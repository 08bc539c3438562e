"""Loading a trained model from a run directory, a checkpoint (whole files, or a sharded one's DCP shards: read in
this one process whatever world size wrote them), or a Hugging Face Llama directory; a checkpoint's own weights or
its averaged ones (train.ema_decay's ema.safetensors)."""
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

# What `--weights` takes: the weights the run evaluated (its eval.weights), the model's own, or the averaged ones.
WEIGHTS = ("run", "model", "ema")


@dataclass
class Loaded:
    model: Llama
    cfg: Config  # the run's resolved config; for a Hugging Face directory, defaults + its model shape
    source: Path  # the checkpoint directory or the Hugging Face directory
    step: Optional[int]  # optimizer steps behind these weights, when known
    run_dir: Optional[Path]  # the run directory; None for a bare Hugging Face directory
    weights: str = "model"  # which weights the model holds: the checkpoint's own, or its averaged ones ("ema")

    @property
    def weights_file(self) -> str:
        return rundirs.EMA_FILE if self.weights == "ema" else rundirs.MODEL_FILE


def load(path: str | Path, device: str | torch.device = "cpu", verified: bool = False, weights: str = "run") -> Loaded:
    """Weights and config from a run directory, a checkpoint or a Hugging Face directory, in eval mode.
    verified: `path` is a checkpoint find_checkpoint just chose (verifying reads every byte: once is enough).
    weights: WEIGHTS (chosen_weights)."""
    path = Path(path)
    if (path / "config.json").is_file() and not (path / rundirs.STATE_FILE).is_file():  # a Hugging Face directory
        if weights == "ema":
            raise ConfigError(f"{path} is a Hugging Face directory, which holds one set of weights and no averaged "
                              f"ones; drop `--weights ema` (or export the run with `--weights ema`).")
        model, cfg = load_hf(path, device)
        return Loaded(model, cfg, path, None, None)
    ckpt = path if verified else checkpoint.find_checkpoint(path)
    cfg = checkpoint.checkpoint_config(ckpt)
    model = build_model(cfg.model, device, loss_chunk_tokens=cfg.train.loss_chunk_tokens)
    chosen = chosen_weights(ckpt, cfg, weights)
    loaded = Loaded(model, cfg, ckpt, checkpoint.read_state(ckpt)["step"], None, chosen)
    try:
        checkpoint.load_checkpoint_weights(model, ckpt, loaded.weights_file)  # whole files or any rank's shards
    except ConfigError:  # no safetensors file (checkpoint.weights_header): already one paragraph
        raise
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"the weights in {ckpt} do not fit the model its state.json describes: {e}") from None
    model.eval()
    loaded.run_dir = ckpt.parent.parent if ckpt.parent.name == rundirs.CHECKPOINTS_DIR else ckpt.parent
    return loaded


def chosen_weights(ckpt: Path, cfg: Config, weights: str) -> str:
    """"model" or "ema" for `--weights` (WEIGHTS): run = the run's eval.weights, whose averaged weights before
    train.ema_start are the model's own (as the run's own records say); ema = the averaged weights, ConfigError when
    the checkpoint holds none."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights is one of {WEIGHTS}, not {weights!r}")
    has_ema = checkpoint.has_averaged_weights(ckpt)
    if weights == "ema" and not has_ema:
        why = ("its run kept none (train.ema_decay 0)" if not cfg.train.ema_decay else
               f"it is from before train.ema_start ({cfg.train.ema_start})")
        raise ConfigError(f"checkpoint {ckpt} holds no averaged weights ({rundirs.EMA_FILE}): {why}. Use "
                          f"`--weights model`, or a later checkpoint of a run trained with `train.ema_decay` > 0.")
    if weights == "run":
        return "ema" if cfg.eval.weights == "ema" and has_ema else "model"
    return weights


def load_model(path: str | Path) -> Llama:
    """`from nanopt import load_model`: the model behind a run directory, checkpoint or Hugging Face
    directory, fp32, on CPU, in eval mode. `model(idx)` (idx: B T int64) returns B T V logits."""
    return load(path, "cpu").model
