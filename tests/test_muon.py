"""optim.name=muon: Muon orthogonalises the hidden matrices' updates, AdamW takes embeddings, head and scalars with
their own lr and weight decay, and a muon run resumes exactly, trains under DDP like on one rank, and learns."""
from __future__ import annotations

import copy
import io
import json
import signal
from pathlib import Path

import pytest
import torch

from conftest import torchrun
from nanopt.config import ModelConfig, OptimConfig, TrainConfig
from nanopt.main import run
from nanopt.model import build_model
from nanopt.optim import BatchedMuon, MuonWithAdamW, apply_schedule, build_optimizer, kind_hparams, load_state_dict
from nanopt.runtime import CpuBackend, CudaBackend
from test_ddp import ARGS as DDP_ARGS, _assert_same_run
from test_resume import assert_same_as, losses, train_here, train_process

MUON = "--optim.name=muon"


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                   max_seq_len=16, tie_embeddings=False))


def by_kind(opt: torch.optim.Optimizer) -> dict[str, dict]:
    return {g["kind"]: g for g in opt.param_groups}


def step_with_random_grads(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """One optimizer step on Gaussian gradients (full rank, unlike a tiny batch's); returns each weight's change."""
    g = torch.Generator().manual_seed(1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def saved(opt: torch.optim.Optimizer) -> dict:
    """The state_dict as a checkpoint holds it (serialised and read back weights-only)."""
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------- which optimizer updates what, and how


def test_muon_orthogonalises_each_matrix_update_where_adamw_does_not():
    lr = 0.01
    spreads: dict[str, list[tuple[float, float]]] = {"muon": [], "adamw": []}
    for name in spreads:
        model = tiny()
        opt = build_optimizer(model, TrainConfig(lr=lr, weight_decay=0.0), "cpu",
                              OptimConfig(name=name, muon_momentum=0.0, muon_nesterov=False))
        changes = step_with_random_grads(model, opt)
        names = {id(p): n for n, p in model.named_parameters()}
        for p in by_kind(opt)["matrix"]["params"]:
            # Momentum off: the change is lr * adjust * NS(grad), match_rms_adamw's adjust 0.2 * sqrt(max dim).
            sv = torch.linalg.svdvals(changes[names[id(p)]]) / (lr * 0.2 * max(p.shape) ** 0.5)
            spreads[name].append((sv.min().item(), sv.max().item()))
    # Newton-Schulz's quintic leaves every singular value in a band around 1 (~0.68-1.14), not exactly at 1.
    for low, high in spreads["muon"]:
        assert 0.6 < low and high < 1.25 and high / low < 2.0, spreads["muon"]
    # AdamW's first step is lr * sign(grad), whose singular values spread widely: the bound tells the two apart.
    assert all(high / low > 3.0 for low, high in spreads["adamw"]), spreads["adamw"]


@pytest.mark.parametrize("nesterov,adjust,batch_max", [(True, "match_rms_adamw", 2**18), (False, "original", 2**18),
                                                       (True, None, 600)])
def test_batched_muon_steps_like_torchs_muon_and_shares_its_state(nesterov, adjust, batch_max):
    """BatchedMuon (one Newton-Schulz per shape, batched; matrices above batch_max_numel one at a time, here
    600 elements in the last case) against torch.optim.Muon (one per matrix): square, wide and tall matrices, 4
    steps with weight decay. The iteration is bf16 in both; batched matmuls may round otherwise on another CPU, so
    the bound is one bf16 ulp of the largest update, far below the updates themselves."""
    g = torch.Generator().manual_seed(0)
    shapes = [(32, 32)] * 3 + [(64, 32)] * 2 + [(32, 64), (8, 16)]
    start = [torch.randn(s, generator=g) for s in shapes]
    ref, mine = ([p.clone().requires_grad_() for p in start] for _ in range(2))
    kw = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust)
    torch_muon, batched = torch.optim.Muon(ref, **kw), BatchedMuon(mine, **kw, batch_max_numel=batch_max)
    for _ in range(4):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for params, opt in ((ref, torch_muon), (mine, batched)):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            opt.step()
    ulp = 0.02 * 0.2 * 64 ** 0.5 * 2 ** -7  # the largest per-shape lr times bf16's relative step near 1
    for a, b, s in zip(ref, mine, start):
        assert (a - s).abs().max() > 100 * ulp  # the parameters did move
        torch.testing.assert_close(b, a, rtol=0, atol=ulp)
        torch.testing.assert_close(batched.state[b]["momentum_buffer"], torch_muon.state[a]["momentum_buffer"])
    # The state_dicts are interchangeable: torch's Muon resumes from the batched one's.
    torch_muon.load_state_dict(batched.state_dict())
    assert torch.equal(torch_muon.state[ref[0]]["momentum_buffer"], batched.state[mine[0]]["momentum_buffer"])


def test_the_batch_cut_off_is_the_devices_and_reaches_the_optimizer():
    """Which matrices share a Newton-Schulz call: every same-shaped one without a cut-off (CUDA's default), the
    large ones alone above it (the CPU backend's, measured on 2 cores); train.py passes the backend's."""
    shapes = [(32, 32), (64, 32), (32, 32), (8, 16), (64, 32)]
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    assert BatchedMuon(params).batches(params) == [[0, 2], [1, 4], [3]]
    assert BatchedMuon(params, batch_max_numel=1024).batches(params) == [[0, 2], [1], [4], [3]]
    assert CpuBackend.muon_batch_max_numel == 3 * 2**16 and CudaBackend.muon_batch_max_numel is None
    opt = build_optimizer(tiny(), TrainConfig(), "cpu", OptimConfig(name="muon"), muon_batch_max_numel=77)
    assert opt.optimizers["muon"].batch_max_numel == 77


def test_embedding_head_and_scalars_go_to_adamw_with_their_own_lr_and_decay():
    optim = OptimConfig(name="muon", matrix_lr=0.02, embedding_lr=0.03, head_lr=0.004, scalar_lr=0.005,
                        matrix_weight_decay=0.0, embedding_weight_decay=0.5, head_weight_decay=0.25)
    model = tiny()
    opt = build_optimizer(model, TrainConfig(lr=1e-3, weight_decay=0.1), "cpu", optim)
    assert isinstance(opt, MuonWithAdamW)
    groups = by_kind(opt)
    assert [g["kind"] for g in opt.param_groups] == ["matrix", "embedding", "head", "scalar"]
    assert opt.optimizers["muon"].param_groups == [groups["matrix"]]
    assert opt.optimizers["adamw"].param_groups == [groups["embedding"], groups["head"], groups["scalar"]]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    idx = torch.randint(1, 6, (4, 9), generator=torch.Generator().manual_seed(0))  # 5 of 50 token ids
    model(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()

    def assert_adamw_first_step(name: str, lr: float, decay: float) -> None:
        """AdamW's first step: decay p by lr * decay, then move it by lr * g / (|g| + eps)."""
        p = dict(model.named_parameters())[name]
        expected = before[name] * (1 - lr * decay) - lr * p.grad / (p.grad.abs() + 1e-8)
        assert torch.allclose(p.detach(), expected, rtol=1e-4, atol=1e-7), name

    assert_adamw_first_step("embed.weight", 0.03, 0.5)  # rows of unseen tokens have no grad: they only decay
    assert (model.embed.weight.grad.abs().sum(1) == 0).sum() >= 40
    assert_adamw_first_step("lm_head.weight", 0.004, 0.25)
    assert_adamw_first_step("norm.weight", 0.005, 0.0)  # scalars never decay
    assert all("momentum_buffer" in opt.state[p] for p in groups["matrix"]["params"])
    assert all("exp_avg" in opt.state[p] for g in opt.param_groups[1:] for p in g["params"])


def test_per_kind_keys_fall_back_to_train_and_the_schedule_scales_every_kind():
    train = TrainConfig(lr=1e-3, weight_decay=0.1)
    optim = OptimConfig(name="muon", matrix_lr=0.02, embedding_weight_decay=0.0)
    assert kind_hparams("matrix", train, optim) == (0.02, 0.1)
    assert kind_hparams("embedding", train, optim) == (1e-3, 0.0)
    assert kind_hparams("head", train, optim) == (1e-3, 0.1)
    assert kind_hparams("scalar", train, OptimConfig(scalar_lr=0.5)) == (0.5, 0.0)
    optimizers = {name: build_optimizer(tiny(), train, "cpu", OptimConfig(name=name, matrix_lr=0.02, head_lr=0.004))
                  for name in ("adamw", "muon")}
    for opt in optimizers.values():  # the per-kind keys shape the groups of either optimizer
        apply_schedule(opt, 0.5)
        lrs = {g["kind"]: g["lr"] for g in opt.param_groups}
        assert lrs == pytest.approx({"matrix": 0.01, "embedding": 5e-4, "head": 0.002, "scalar": 5e-4})
        assert opt.param_groups[0]["lr"] == pytest.approx(0.01)  # what the logger shows: the matrix lr
    # The schedule reaches the lr torch's Muon itself reads, not a copy of the group.
    assert optimizers["muon"].optimizers["muon"].param_groups[0]["lr"] == pytest.approx(0.01)


def test_a_muon_state_dict_round_trips_and_another_optimizers_is_refused():
    train, muon = TrainConfig(lr=1e-2), OptimConfig(name="muon")
    model = tiny()
    opt = build_optimizer(model, train, "cpu", muon)
    step_with_random_grads(model, opt)
    state = saved(opt)
    assert [g["optimizer"] for g in state["param_groups"]] == ["muon", "adamw", "adamw", "adamw"]

    resumed_model = copy.deepcopy(model)
    resumed = build_optimizer(resumed_model, train, "cpu", muon)
    load_state_dict(resumed, state)
    assert resumed.optimizers["muon"].param_groups[0] is resumed.param_groups[0]  # re-shared after the load
    for m, o in ((model, opt), (resumed_model, resumed)):
        step_with_random_grads(m, o)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)

    adamw_model = copy.deepcopy(model)
    adamw = build_optimizer(adamw_model, train, "cpu")
    with pytest.raises(ValueError, match="muon's and this run's optimizer is adamw.*--optim.name=muon"):
        load_state_dict(adamw, state)
    step_with_random_grads(adamw_model, adamw)
    with pytest.raises(ValueError, match="adamw's and this run's optimizer is muon.*--optim.name=adamw"):
        load_state_dict(build_optimizer(model, train, "cpu", muon), saved(adamw))


# ---------------------------------------------------------------- whole runs

@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted muon run (test_resume's 8 fp32 steps, a checkpoint every 2)."""
    run_dir = tmp_path_factory.mktemp("muon_reference")
    assert train_here(run_dir, MUON) == 0
    return run_dir


@pytest.mark.slow
def test_a_muon_run_lowers_the_loss(reference):
    values = [loss for _, loss in losses(reference)]
    assert values[-1] < values[0] - 0.5, values
    config = (reference / "config.yaml").read_text()
    assert "name: muon" in config


@pytest.mark.slow
def test_a_killed_muon_run_resumes_bitwise_identically(tmp_path, reference, capsys):
    proc = train_process(tmp_path, "kill-in-step:5", MUON)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert train_here(tmp_path, MUON) == 0
    assert f"resuming from {tmp_path / 'checkpoints' / 'step_000004'}" in capsys.readouterr().out
    assert_same_as(reference, tmp_path)  # weights, every logged loss, and Muon's and AdamW's state


def test_switching_optimizer_on_resume_is_refused_even_when_allowed(tmp_path, capsys):
    assert train_here(tmp_path, "--train.max_steps=2") == 0  # adamw
    assert train_here(tmp_path, "--train.max_steps=4", MUON) == 2
    assert "optim.name: 'adamw' in the checkpoint, 'muon' now" in capsys.readouterr().err
    assert train_here(tmp_path, "--train.max_steps=4", MUON, "--checkpoint.allow_changes=optim.name") == 2
    err = capsys.readouterr().err
    assert "optimizer state does not fit this run" in err and "--optim.name=adamw" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_two_ranks_match_one_rank_with_muon(tmp_path):
    args = [*DDP_ARGS, MUON]
    one, two = tmp_path / "one", tmp_path / "two"
    assert run([*args, f"--run.dir={one}"]) == 0  # in this process: the single-rank reference
    proc = torchrun(2, [*args, f"--run.dir={two}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks x 1 accum" in proc.stdout
    _assert_same_run(one, two)
    digests = json.loads((two / "summary.json").read_text())["weights_sha256_per_rank"]
    assert len(digests) == 2 and digests[0] == digests[1], "ranks ended with different weights"
