"""The speed paths must not change the numbers: torch.compile (train.compile) gives eager's loss and
gradients; and `nanopt.main.run` makes idle OpenMP threads spin (OMP_WAIT_POLICY=ACTIVE) before torch
loads, unless the user chose a policy.

Speed itself is never asserted here (see bench/ for that). The compile test builds two SMALL models in
fp32 with inductor: each about 30-50 s cold on 2 busy cores, ~10 s once inductor's on-disk graph cache is warm.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from nanopt.config import ModelConfig
from nanopt.model import build_model

SMALL_MODEL = ModelConfig(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
# Every speedrun option on (configs/speedrun-cpu.yaml's and the two it leaves off): their ops and the hand-written
# RMS-norm backward must trace and compile too.
ALL_OPTIONS = dataclasses.replace(SMALL_MODEL, qk_norm=True, mlp="relu2", logit_softcap=15.0, value_embeddings=True,
                                  residual_scalars=True, tie_embeddings=False)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [SMALL_MODEL, ALL_OPTIONS], ids=["llama", "speedrun-options"])
def test_compiled_model_matches_eager_loss_and_grads(cfg):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(cfg)
    idx = torch.randint(0, 257, (4, 32))
    targets = torch.roll(idx, -1, dims=1)
    targets[:, -1] = -100  # an ignored position must stay ignored when compiled

    eager_loss = model(idx, targets)
    eager_loss.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    compiled = torch.compile(model)  # inductor, the train.compile path
    compiled_loss = compiled(idx, targets)
    compiled_loss.backward()

    assert torch.isfinite(compiled_loss)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-5)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)



def _policy_after_run(env_policy: str | None) -> str:
    """OMP_WAIT_POLICY as torch will see it after `nanopt.main.run`, in a fresh interpreter."""
    code = (
        "import os, sys, nanopt.main as m\n"
        "assert 'torch' not in sys.modules, 'torch imported before run(): too late to set OMP_WAIT_POLICY'\n"
        "m.run(['--help'])\n"
        "import torch\n"
        "print('POLICY=' + os.environ['OMP_WAIT_POLICY'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.rsplit("POLICY=", 1)[1].strip()


@pytest.mark.slow
def test_run_makes_idle_openmp_threads_spin_before_torch_loads():
    assert _policy_after_run(None) == "ACTIVE"


@pytest.mark.slow
def test_run_keeps_a_user_chosen_openmp_wait_policy():
    assert _policy_after_run("PASSIVE") == "PASSIVE"
