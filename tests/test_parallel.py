"""The parallelism (nanopt/parallel.py) in one process: without torchrun fsdp and hsdp leave the model whole, and the
full optimizer state of a sharded run is converted to the files a DDP run writes. Two ranks: e2e/test_ddp.py."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from conftest import CPU
from nanopt import parallel
from nanopt.config import ModelConfig, load_config, parse_overrides
from nanopt.model import build_model
from nanopt.optim import build_optimizer

TINY = ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


@pytest.mark.parametrize("args", [["--runtime.parallel=fsdp"],
                                  ["--runtime.parallel=hsdp", "--runtime.shard_group_size=8"]])
def test_fsdp_and_hsdp_without_torchrun_are_one_process_with_the_model_left_whole(args):
    cfg = load_config(None, parse_overrides(args))
    model = build_model(TINY)
    parallel.shard(model, cfg, CPU)
    assert not parallel.is_sharded(model)
    assert parallel.wrap(model, CPU) is model


def test_a_name_keyed_optimizer_state_becomes_the_position_keyed_one_torch_saves():
    """What full_state writes for a sharded model is what optimizer.state_dict() gives an unsharded one: the same
    positions, groups and tensors (a tied embedding once), so DDP and FSDP checkpoints are the same files."""
    cfg = load_config(None, parse_overrides(["--optim.name=adamw"]))
    model = build_model(TINY)
    optimizer = build_optimizer(model, cfg.train, "cpu", cfg.optim)
    x = torch.randint(0, TINY.vocab_size, (2, 16))
    model(x, x).backward()
    optimizer.step()
    ours, torchs = parallel._indexed(get_optimizer_state_dict(model, optimizer)), optimizer.state_dict()
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in torchs["param_groups"]]
    assert ours["param_groups"] == torchs["param_groups"]
    assert ours["state"].keys() == torchs["state"].keys()
    for i, state in torchs["state"].items():
        for k, v in state.items():
            assert torch.equal(ours["state"][i][k], v), (i, k)
