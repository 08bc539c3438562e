"""FP8 training (train.fp8) through torchao's float8: the blocks' Linears (train.fp8_filter) compute their matmuls in
FP8 with dynamic scaling; the rest stays. A Float8Linear keeps its weight and state_dict keys, so checkpoints load
either way, and dynamic scaling keeps no state, so a resume is exact. Native, emulated or none: the backend's answer."""
from __future__ import annotations

import dataclasses
import logging
from types import ModuleType
from typing import Any, Callable

import torch.nn as nn

from nanopt.config import Config, TrainConfig
from nanopt.distributed.runtime import Runtime
from nanopt.errors import ConfigError
from nanopt.recipe.mfu import meta_model, token_flops
from nanopt.training.plan import build_plan

log = logging.getLogger("nanopt")

# torchao's FP8 matmul (torch._scaled_mm) takes dimensions that are multiples of 16.
DIM_MULTIPLE = 16


def gains(recipe: str, in_features: int, out_features: int) -> bool:
    """Whether FP8 pays for a Linear of this shape, by torchao's per-recipe auto-filter thresholds (its H100
    measurements): tensorwise covers 68.6% of configs/1b.yaml's FLOPs, rowwise 39.2%."""
    k, n = in_features, out_features
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)  # rowwise


def converts(recipe: str, which: str, in_features: int, out_features: int) -> bool:
    """train.fp8_filter's rule for one block Linear: `all` takes every shape torchao accepts, `auto` those gaining."""
    accepted = in_features % DIM_MULTIPLE == 0 and out_features % DIM_MULTIPLE == 0
    return accepted and (which == "all" or gains(recipe, in_features, out_features))


def module_filter(recipe: str, which: str) -> Callable[[nn.Module, str], bool]:
    """torchao's module_filter_fn: a block Linear that train.fp8_filter converts."""
    def keep(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and fqn.startswith("layers.")
                and converts(recipe, which, module.in_features, module.out_features))
    return keep


def flops_share(model: nn.Module, t: TrainConfig, seq_len: int, causal_halving: bool = True) -> float:
    """The share of `model`'s FLOPs per token at `seq_len` that run in FP8 (0 without FP8)."""
    if t.fp8 == "none":
        return 0.0
    keep = module_filter(t.fp8, t.fp8_filter)
    return 6 * sum(m.weight.numel() for fqn, m in model.named_modules() if keep(m, fqn)) / token_flops(
        model, seq_len, causal_halving).model


def _torchao_float8() -> ModuleType:
    """torchao.float8, imported on first use, quiet about C++ extensions float8 training does not use."""
    levels = {q: q.level for q in map(logging.getLogger, ("torchao", "torch.utils._pytree"))}
    for q in levels:
        q.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ConfigError(f"`train.fp8` needs torchao, which is not importable ({e}); install it with "
                          f"`pip install -e '.[fp8]'` or set `--train.fp8=none`.") from None
    finally:
        for q, level in levels.items():
            q.setLevel(level)
    return float8


def convert(model: nn.Module, cfg: Config, rt: Runtime) -> int:
    """Swap the block Linears for Float8Linear in place; returns how many. Before the optimizer, compile and DDP."""
    recipe = cfg.train.fp8
    if recipe == "none":
        return 0
    support = rt.backend.fp8
    if support is None:
        raise ConfigError(f"`train.fp8` is {recipe!r} but this {rt.kind} device has no FP8 matmuls (torchao's float8 "
                          f"needs an NVIDIA GPU of compute capability 8.9 or later, e.g. an H100 or L4, or the CPU, "
                          f"where it is emulated for testing); set `--train.fp8=none` to train in bf16 here.")
    float8 = _torchao_float8()
    seq_len = build_plan(cfg.train, 1).stages[0].seq_len  # the first stage's, which no world size changes
    share = flops_share(model, cfg.train, seq_len, cfg.mfu.causal_halving)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    if support == "emulated":
        config = dataclasses.replace(config, emulate=True)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=module_filter(recipe,
                                                                                           cfg.train.fp8_filter))
    converted = sum(isinstance(m, float8.float8_linear.Float8Linear) for m in model.modules())
    if rt.is_main:
        _explain(cfg, support, converted, rt.kind, share, seq_len)
    return converted


def _explain(cfg: Config, support: str, converted: int, device: str, share: float, seq_len: int) -> None:
    t = cfg.train
    log.info("fp8: %d block Linears in FP8 (%s scaling, %s, filter %s), %.1f%% of the model's FLOPs at seq_len %d; "
             "embeddings and LM head stay in %s", converted, t.fp8, support, t.fp8_filter, 100 * share, seq_len,
             t.precision)
    if converted == 0:
        log.warning("fp8: no block Linear of this model is large enough to gain from FP8 (train.fp8_filter=auto, "
                    "torchao's H100 thresholds), so the run trains in %s; --train.fp8_filter=all converts every one "
                    "whose dims are multiples of 16", t.precision)
    if support == "emulated":
        log.warning("fp8: emulated on %s: torchao computes FP8's numerics in higher precision, so this run "
                    "tests FP8's effect on the loss but is not faster; FP8 speed needs an H100-class GPU", device)
    elif not t.compile:
        log.warning("fp8: train.compile is false: eager FP8 runs each cast and scale as its own kernel and is "
                    "slower than bf16; set --train.compile=true for FP8's speed")


def summary(cfg: Config, seq_len: int) -> dict[str, Any]:
    """summary.json's FP8 keys, the share at the last stage's seq_len."""
    share = flops_share(meta_model(cfg.model), cfg.train, seq_len, cfg.mfu.causal_halving)
    return {"fp8": cfg.train.fp8, "fp8_filter": cfg.train.fp8_filter if cfg.train.fp8 != "none" else None,
            "fp8_matmul_flops_share": share}
