"""The parallelism (nanopt/distributed/parallel.py): without torchrun fsdp and hsdp leave the model whole; across forked
ranks accumulation keeps gradients sharded. Checkpoints of every parallelism: test_checkpoint.py, e2e/test_ddp.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import CPU

from nanopt.config import ModelConfig, load_config, parse_overrides
from nanopt.distributed import parallel
from nanopt.distributed.runtime import Runtime
from nanopt.recipe.model import build_model

TINY = ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


@pytest.mark.parametrize("args", [["--runtime.parallel=fsdp"],
                                  ["--runtime.parallel=hsdp", "--runtime.shard_group_size=8"]])
def test_fsdp_and_hsdp_without_torchrun_are_one_process_with_the_model_left_whole(args):
    cfg = load_config(None, parse_overrides(args))
    model = build_model(TINY)
    parallel.shard(model, cfg, CPU)
    assert not parallel.is_sharded(model)
    assert parallel.wrap(model, CPU) is model


# ---------------------------------------------------------------- accumulation across forked gloo ranks
def _accumulate_worker(rank: int, world: int, parallel_args: list[str], store: str, out: str) -> None:
    """One gloo rank: two micro-steps of a sharded TINY model through parallel.accumulating, each rank on its own
    batches; saves the gradient's local shape after the first micro-step and the whole gradients after the last."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = load_config(None, parse_overrides(["--train.precision=fp32", *parallel_args]))
    rt = Runtime(kind="cpu", device=torch.device("cpu"), rank=rank, local_rank=rank, world_size=world,
                 local_world_size=world, precision="fp32")
    torch.manual_seed(0)
    model = build_model(TINY)
    parallel.shard(model, cfg, rt)
    shapes = {}
    for micro in range(2):
        x = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(10 * rank + micro))
        with parallel.accumulating(model, last=micro == 1):
            (model(x, x) / 2).backward()  # the mean over the 2 micro-steps, as train_step scales it
        if micro == 0:
            shapes = {n: None if p.grad is None else tuple(parallel.local_tensor(p.grad).shape)
                      for n, p in model.named_parameters()}
    torch.save({"first_local_shapes": shapes,
                "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}, Path(out) / f"{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world, args", [(2, ["--runtime.parallel=fsdp"]),
                                         (4, ["--runtime.parallel=hsdp", "--runtime.shard_group_size=2"])])
def test_accumulation_keeps_gradients_sharded_between_micro_steps_and_ends_with_the_mean(world, args, tmp_path):
    """fsdp reduce-scatters every micro-step, so between micro-steps a rank holds only its shard of each gradient
    (not the whole fp32 gradients set_requires_gradient_sync(False) would keep: what fsdp is chosen to save); hsdp
    does so inside its shard group and all-reduces across replicas on the last micro-step alone (FSDP2 holds the
    group's reduced shard aside until then: no .grad between micro-steps). Either way the
    gradients after the last one are the mean over every rank's micro-batches, as one process computes them."""
    mp.start_processes(_accumulate_worker, args=(world, args, str(tmp_path / "store"), str(tmp_path)), nprocs=world,
                       start_method="fork")
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    torch.manual_seed(0)
    model = build_model(TINY)
    for rank in range(world):
        for micro in range(2):
            x = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(10 * rank + micro))
            (model(x, x) / (2 * world)).backward()
    group = 2 if world == 4 else world  # the ranks a parameter's rows are cut over
    for name, p in model.named_parameters():
        for r in ranks:
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=1e-5, atol=1e-6)
        first = ranks[0]["first_local_shapes"][name]
        if world == 4 and first is None:  # hsdp: the reduce-scattered shard waits, outside .grad, for the all-reduce
            continue
        assert first is not None and first[0] == -(-p.shape[0] // group) and first[1:] == p.shape[1:], (name, first)
