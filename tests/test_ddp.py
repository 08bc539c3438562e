"""Real torchrun processes (gloo on CPU): DDP equals one process, and two 'nodes' train together."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import REPO, free_port, run_module, small_overrides, torchrun
from nanopt import runtime
from nanopt.config import load_config, parse_overrides
from nanopt.model import build_model
from nanopt.train import train_step

# fp32 so the comparison is about the algorithm, not bf16 rounding; 8 sequences per step.
ARGS = small_overrides(**{"train.precision": "fp32", "train.max_steps": 4, "train.global_batch_tokens": 256})


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def _final_weights(run_dir: Path) -> dict:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model.safetensors"))


def _assert_same_run(a: Path, b: Path) -> None:
    la, lb = _losses(a), _losses(b)
    assert la.keys() == lb.keys() and len(la) == 4
    for step in la:
        assert abs(la[step] - lb[step]) < 1e-5, (step, la[step], lb[step])
    wa, wb = _final_weights(a), _final_weights(b)
    for name in wa:
        assert (wa[name] - wb[name]).abs().max().item() < 1e-5, name


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, corpus_dir) -> Path:
    run_dir = tmp_path_factory.mktemp("single")
    proc = run_module(["nanopt.main", *ARGS, f"--run.dir={run_dir}"], env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_two_ranks_match_one_rank(single_run, tmp_path):
    proc = torchrun(2, [*ARGS, f"--run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks x 1 accum" in proc.stdout
    _assert_same_run(single_run, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    digests = summary["weights_sha256_per_rank"]
    assert len(digests) == 2 and digests[0] == digests[1], "ranks ended with different weights"


@pytest.mark.slow
def test_two_nodes_over_c10d_rendezvous_match_one_rank(single_run, tmp_path):
    port = free_port()
    procs = []
    for node in (0, 1):
        launcher = ["--nnodes=2", f"--node-rank={node}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=nanopt-test"]
        cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "--nproc-per-node=1",
               "-m", "nanopt.main", *ARGS, f"--run.dir={tmp_path}"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    _assert_same_run(single_run, tmp_path)
    digests = json.loads((tmp_path / "summary.json").read_text())["weights_sha256_per_rank"]
    assert len(digests) == 2 and digests[0] == digests[1]


def test_gradients_accumulate_in_ddp_buckets_not_beside_them(monkeypatch):
    """gradient_as_bucket_view=True only saves memory if the gradients stay bucket views: zero_grad(set_to_none)
    would free them each step, so the no_sync micro-steps allocated a second set (one tensor per parameter)
    and the last micro-step copied it into the buckets (GPU review finding 1: 4.6 GiB and a 4.9 GB copy per
    step at 1B). In-process DDP over gloo, world size 1, two micro-steps per step."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cfg = load_config(None, parse_overrides(small_overrides()))
        model = build_model(cfg.model, "cpu")
        ddp = DDP(model, gradient_as_bucket_view=True, broadcast_buffers=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        storages: list[int] = []  # the storage each gradient lives in, as autograd accumulates into it
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: storages.append(p.grad.untyped_storage().data_ptr()))
        batches = [(torch.randint(0, 257, (4, 32)), torch.randint(0, 257, (4, 32))) for _ in range(2)]
        per_step = []
        for _ in range(3):
            storages.clear()
            train_step(ddp, optimizer, batches, runtime.init("cpu", "fp32", 1), 1.0)
            per_step.append(set(storages))
    finally:
        dist.destroy_process_group()
    params = len(list(model.parameters()))
    assert len(per_step[0]) == params  # the first step allocates them; DDP then makes them views of its bucket
    assert per_step[1] == per_step[2] and len(per_step[1]) < params, [len(s) for s in per_step]
