"""Loading a trained model from a run directory, a checkpoint (its whole model.safetensors or ema.safetensors), or a
Hugging Face Llama directory."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from nanopt import rundirs
from nanopt.config import Config
from nanopt.errors import ConfigError
from nanopt.hf import load_hf
from nanopt.recipe.model import Llama, build_model
from nanopt.training import checkpoint

# What `--weights` takes: the weights the run evaluated (its eval.weights), the model's own, or the averaged ones.
WEIGHTS = ("run", "model", "ema")


@dataclass
class Loaded:
    model: Llama
    cfg: Config  # the run's resolved config; for a Hugging Face directory, defaults + its model shape
    source: Path  # the checkpoint directory or the Hugging Face directory
    step: Optional[int]  # optimizer steps behind these weights, when known
    run_dir: Optional[Path]  # the run directory; None for a bare Hugging Face directory
    # "model" (the checkpoint's own), "ema" (its averaged ones), or nanopt average's averaged_name.
    weights: str = "model"
    averaged_from: Optional[dict] = None

    @property
    def weights_file(self) -> str:
        return rundirs.EMA_FILE if self.weights == "ema" else rundirs.MODEL_FILE


def load(path: str | Path, device: str | torch.device = "cpu", verified: bool = False, weights: str = "run") -> Loaded:
    """Weights and config from a run directory, a checkpoint or a Hugging Face directory, in eval mode.
    verified: `path` is a checkpoint find_checkpoint just chose (verifying reads every byte). weights: WEIGHTS."""
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
    state = checkpoint.read_state(ckpt)
    loaded = Loaded(model, cfg, ckpt, state["step"], None, chosen_weights(ckpt, state, cfg, weights),
                    state.get("averaged_from"))
    load_weights(model, ckpt / loaded.weights_file)
    model.eval()
    loaded.run_dir = ckpt.parent.parent if ckpt.parent.name == rundirs.CHECKPOINTS_DIR else ckpt.parent
    return loaded


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load a checkpoint's whole weights into an unsharded model; ConfigError naming the first tensors of another
    shape, missing or unexpected, or (weights_header) a file that is no safetensors file."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    saved = {k: shape for k, (shape, _) in checkpoint.weights_header(path).items()}
    wrong = [f"{k} {shape} in the checkpoint vs {own[k]} in the model" for k, shape in saved.items()
             if shape != own.get(k, shape)]
    missing, unexpected = ([], []) if wrong else model.load_state_dict(load_file(str(path)), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and getattr(model.cfg, "tie_embeddings", False))]
    if wrong or missing or unexpected:
        why = (f"holds weights of other shapes: {'; '.join(wrong[:3])}" if wrong else
               f"does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        raise ConfigError(f"the weights in {path.parent} do not fit the model its state.json describes: {path} {why}")


def averaged_name(averaged_from: dict) -> str:
    """An averaged checkpoint's weights as its records name them: "average of steps 4,6,8 of RUN"."""
    steps = ",".join(str(c["step"]) for c in averaged_from["checkpoints"])  # its shape: checkpoint.STATE
    return f"average of steps {steps} of {averaged_from['run']}"


def chosen_weights(ckpt: Path, state: dict, cfg: Config, weights: str) -> str:
    """The name of the weights `--weights` (WEIGHTS) loads from a checkpoint (its `state`), as loaded: run = the
    run's eval.weights (the model's own before train.ema_start), ema = the averaged ones, an average's one set by
    averaged_name. ConfigError when `ema` is asked of a checkpoint that holds none, or one that should is lacking."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights is one of {WEIGHTS}, not {weights!r}")
    if averaged := state.get("averaged_from"):
        if weights == "ema":
            raise ConfigError(f"checkpoint {ckpt} is an average of checkpoints ({averaged_name(averaged)}, written "
                              f"by nanopt average), which holds one set of weights, the mean of their "
                              f"{averaged.get('weights') or rundirs.MODEL_FILE}, and no EMA; drop `--weights ema`.")
        return averaged_name(averaged)
    has_ema, started = (ckpt / rundirs.EMA_FILE).is_file(), state.get("ema", {}).get("started")
    if started and not has_ema and (weights == "ema" or (weights == "run" and cfg.eval.weights == "ema")):
        raise ConfigError(f"checkpoint {ckpt}'s {rundirs.STATE_FILE} says its run kept averaged weights, but "
                          f"{ckpt / rundirs.EMA_FILE} is missing; the checkpoint is damaged. Use an earlier "
                          f"checkpoint, or `--weights model` for the model's own weights.")
    if weights == "ema" and not has_ema:
        why = ("its run kept none (train.ema_decay 0)" if not cfg.train.ema_decay else
               f"it is from before train.ema_start ({cfg.train.ema_start})")
        raise ConfigError(f"checkpoint {ckpt} holds no averaged weights ({rundirs.EMA_FILE}): {why}. Use "
                          f"`--weights model`, or a later checkpoint of a run trained with `train.ema_decay` > 0.")
    return ("ema" if cfg.eval.weights == "ema" and has_ema else "model") if weights == "run" else weights


def load_model(path: str | Path) -> Llama:
    """`from nanopt import load_model`: the model behind a run directory, checkpoint or Hugging Face
    directory, fp32, on CPU, in eval mode. `model(idx)` (idx: B T int64) returns B T V logits."""
    return load(path, "cpu").model
