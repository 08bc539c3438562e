"""`nanopt average`: a checkpoint whose weights are the mean of some of one run's checkpoints (LAWA), summed in fp32,
each tensor saved in its dtype, weights only (checkpoint.save: nothing resumes from it); its state.json says which
checkpoints it averaged. Nothing is written unless every named checkpoint is whole and of one model."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file

from nanopt.config import comma_list
from nanopt.errors import ConfigError
from nanopt.rundirs import CHECKPOINTS_DIR, MODEL_FILE, refuse_inside_checkpoints
from nanopt.training import checkpoint


def parse_steps(text: str) -> list[int]:
    """`--steps 200,400,600` -> [200, 400, 600]; ConfigError when it is not a comma list of distinct steps."""
    try:
        steps = [int(part) for part in comma_list(text)]
    except ValueError:
        steps = []
    if len(steps) < 2 or len(set(steps)) != len(steps) or min(steps) < 0:
        raise ConfigError(f"--steps {text!r}: give two or more distinct checkpoint steps separated by commas, e.g. "
                          f"--steps 200,400,600 (the step_NNNNNN directories of the run's checkpoints).")
    return sorted(steps)


def choose(run: Path, last: Optional[int], steps: Optional[list[int]]) -> list[Path]:
    """The checkpoints to average, oldest first: the newest `last`, or those of `steps`; every one verified."""
    found = checkpoint.checkpoint_dirs(run)
    if not found:
        raise ConfigError(f"{run} holds no checkpoints (checkpoints/step_NNNNNN/); give a run directory that has "
                          f"saved some (checkpoint.every sets how often).")
    have = ", ".join(str(checkpoint.step_of(c)) for c in found)
    if (last is None) == (steps is None):
        raise ConfigError("name the checkpoints to average with one of --last K or --steps a,b,c.")
    if steps is None:
        if last < 2 or last > len(found):
            raise ConfigError(f"--last {last}: {run} has {len(found)} checkpoint(s) (steps {have}), and an average "
                              "takes 2 or more of them; " + (f"use --last 2 to --last {len(found)}." if len(found) > 1
                              else "save more often (checkpoint.every) or keep more (checkpoint.keep)."))
        chosen = found[-last:]
    else:
        by_step = {checkpoint.step_of(c): c for c in found}
        if missing := [s for s in steps if s not in by_step]:
            raise ConfigError(f"--steps: {run} has no checkpoint of step {', '.join(map(str, missing))} (it has "
                              f"steps {have}; checkpoint.keep prunes older ones). Name steps it has.")
        chosen = [by_step[s] for s in steps]
    for ckpt in chosen:
        if problem := checkpoint.verify_checkpoint(ckpt):
            raise ConfigError(f"checkpoint {ckpt} cannot be averaged: {problem}. Leave it out (--steps), or wait "
                              f"until it is written.")
    return chosen


def check_same_model(chosen: list[Path]) -> None:
    """ConfigError naming the first pair of checkpoints whose model keys, tokenizer, tensors, shapes or dtypes
    differ: an average of two different models is no model."""
    def describe(ckpt: Path) -> dict[str, Any]:
        cfg = checkpoint.checkpoint_config(ckpt)
        keys = {f"model.{k}": v for k, v in asdict(cfg.model).items() if k != "attention"}  # a kernel, not a shape
        return {**keys, "data.tokenizer": cfg.data.tokenizer}

    first = chosen[0]
    first_keys, first_shapes = describe(first), checkpoint.weights_header(first / MODEL_FILE)
    for ckpt in chosen[1:]:
        keys = describe(ckpt)
        changed = [f"{k}: {first_keys[k]!r} vs {keys.get(k)!r}" for k in first_keys if keys.get(k) != first_keys[k]]
        if changed:
            raise ConfigError(f"checkpoints {first} and {ckpt} come from different configs ({'; '.join(changed)}), "
                              f"so their weights cannot be averaged; name checkpoints of one model.")
        shapes = checkpoint.weights_header(ckpt / MODEL_FILE)
        if wrong := sorted(k for k in first_shapes.keys() | shapes.keys() if first_shapes.get(k) != shapes.get(k)):
            name = wrong[0]
            raise ConfigError(f"checkpoints {first} and {ckpt} hold different tensors ({len(wrong)} differ, e.g. "
                              f"{name}: {first_shapes.get(name)} vs {shapes.get(name)} as (shape, dtype)), so their "
                              f"weights cannot be averaged; name checkpoints of one model.")


def mean_weights(chosen: list[Path]) -> dict[str, torch.Tensor]:
    """The mean of the checkpoints' weights, summed in fp32 one at a time, each tensor in its saved dtype."""
    sums: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for ckpt in chosen:
        try:
            weights = load_file(str(ckpt / MODEL_FILE))
        except OSError as e:  # pruned by the run's checkpoint.keep while it trains
            raise ConfigError(f"checkpoint {ckpt} could not be read ({e}); if its run is training, it may have been "
                              f"pruned (checkpoint.keep): name checkpoints that are still there.") from None
        for name, tensor in weights.items():
            dtypes[name] = tensor.dtype
            sums[name] = sums[name].add_(tensor.float()) if name in sums else tensor.to(torch.float32, copy=True)
    return {name: (total / len(chosen)).to(dtypes[name]) for name, total in sums.items()}


def average_checkpoints(run: str | Path, out: str | Path, last: Optional[int] = None,
                        steps: Optional[list[int]] = None) -> Path:
    """Write OUT/checkpoints/step_NNNNNN (NNNNNN: the newest averaged step), the mean of the run's newest `last`
    checkpoints or those of `steps`; returns it. OUT must not exist or be empty: nothing is ever overwritten."""
    run, out = Path(run), Path(out)
    refuse_inside_checkpoints(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} {'is a file' if not out.is_dir() else 'is not empty'}, and nanopt average "
                          f"never overwrites; give a new directory (or an empty one).")
    chosen = choose(run, last, steps)
    check_same_model(chosen)
    weights = mean_weights(chosen)
    newest = chosen[-1]
    state = {**checkpoint.read_state(newest), "averaged_from": {
        "run": str(run.resolve()), "weights": MODEL_FILE,
        "checkpoints": [{"step": checkpoint.step_of(c), "weights_crc32": checkpoint.weights_crc32(c)}
                        for c in chosen]}}
    # The newest's counters and config (what eval, sample and export read); its step names the new directory.
    state = {k: v for k, v in state.items() if k not in ("versions", "step", "ema")}
    return checkpoint.save(out / CHECKPOINTS_DIR, checkpoint.step_of(newest), weights, state, keep=1)
