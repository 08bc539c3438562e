"""Optimizer groups by kind, the learning-rate schedule (a pure function of step), optimizer-state resume, and
optim.name=muon: Muon orthogonalises the hidden matrices' updates, AdamW takes embeddings, head and scalars with
their own lr and weight decay. Muon runs: e2e/test_resume.py and e2e/test_ddp.py."""
from __future__ import annotations

import copy
import io
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import CPU, fork_ranks

from nanopt.config import ModelConfig, OptimConfig, TrainConfig
from nanopt.distributed.runtime import CpuBackend, CudaBackend, Runtime
from nanopt.recipe import optim as optim_module
from nanopt.recipe.model import build_model
from nanopt.recipe.optim import (BatchedMuon, MuonWithAdamW, apply_schedule, build_optimizer, kind_hparams,
                                 load_state_dict, lr_multiplier, owners, param_groups)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of a group whose base lr is cfg.lr: the schedule in absolute terms."""
    return cfg.lr * lr_multiplier(step, cfg)


def tiny(tie: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                   max_seq_len=16, tie_embeddings=tie))


# The "xla" kind's optimizer flags without torch_xla: its parameters and backend are the CPU's.
XLA = Runtime("xla", torch.device("cpu"), 0, 0, 1, 1, "fp32", backend=CpuBackend(torch.device("cpu")))


def by_kind(groups: list[dict]) -> dict[str, dict]:
    return {g["kind"]: g for g in groups}


@pytest.mark.parametrize("tie", [True, False])
def test_groups_are_kinds_in_a_fixed_order_with_every_param_once_and_no_vector_decays(tie):
    model = tiny(tie)
    cfg = TrainConfig(lr=0.02, weight_decay=0.3)
    groups = param_groups(model, cfg)
    g = by_kind(groups)
    assert [x["kind"] for x in groups] == (["matrix", "embedding", "scalar"] if tie
                                           else ["matrix", "embedding", "head", "scalar"])
    assert g["embedding"]["params"] == [model.embed.weight]  # tied: the head is this one param
    if not tie:
        assert g["head"]["params"] == [model.lm_head.weight]
    block_linears = [m.weight for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert {id(p) for p in g["matrix"]["params"]} == {id(p) for p in block_linears}
    assert len(g["matrix"]["params"]) == 7 * 2  # wq wk wv wo w1 w2 w3 per layer
    assert len(g["scalar"]["params"]) == 2 * 2 + 1  # two norms per layer + the final norm
    ids = [id(p) for x in groups for p in x["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # each exactly once
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    for x in groups:  # today every kind runs at the one lr; only scalars (every vector) skip decay
        assert all(p.dim() == 2 for p in x["params"]) or all(p.dim() == 1 for p in x["params"])
        assert x["base_lr"] == 0.02 and x["weight_decay"] == (0.0 if x["params"][0].dim() == 1 else 0.3)
        assert x["weight_decay"] == (0.0 if x["kind"] == "scalar" else 0.3)
    opt = build_optimizer(model, cfg, CPU)
    assert [x["lr"] for x in opt.param_groups] == [0.02] * len(groups)
    assert [x["kind"] for x in opt.param_groups] == [x["kind"] for x in groups]
    assert opt.defaults["betas"] == (0.9, 0.95)


COSINE = TrainConfig(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1, schedule="cosine")


@pytest.mark.parametrize("cfg, want", [
    # cosine: a linear warm-up, then half a cosine to the floor; half way it is the mean of peak and floor
    (COSINE, {0: 0.1, 9: 1.0, 10: 1.0, 60: 0.55, 110: 0.1}),
    # wsd: flat, then a linear decay over the last decay_fraction of the steps
    (TrainConfig(lr=2.0, warmup_steps=0, max_steps=100, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2),
     {0: 2.0, 79: 2.0, 80: 2.0 - 2.0 / 20, 99: 0.0}),
    (TrainConfig(lr=0.5, warmup_steps=4, schedule="constant"), {0: 0.125, 3: 0.5, 4: 0.5, 1000: 0.5}),
], ids=["cosine", "wsd", "constant"])
def test_each_schedule_warms_up_then_follows_its_shape(cfg, want):
    assert {s: lr_at(s, cfg) for s in want} == pytest.approx(want, abs=1e-12)
    if cfg is COSINE:  # and never rises after the warm-up
        values = [lr_at(s, cfg) for s in range(10, 111)]
        assert all(a >= b for a, b in zip(values, values[1:]))


def test_the_multiplier_is_the_schedule_relative_to_the_peak_and_scales_each_groups_own_base_lr():
    cfg = TrainConfig(lr=3.0, warmup_steps=5, max_steps=50, min_lr_ratio=0.2, schedule="cosine")
    assert lr_multiplier(4, cfg) == 1.0 and lr_multiplier(50, cfg) == pytest.approx(0.2)
    assert all(lr_at(s, cfg) == pytest.approx(3.0 * lr_multiplier(s, cfg)) for s in range(60))
    opt = build_optimizer(tiny(), TrainConfig(lr=1.0), CPU)
    opt.param_groups[0]["base_lr"] = 0.1  # a group with its own lr must not be overwritten by the others'
    apply_schedule(opt, 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert all(g["lr"] == pytest.approx(0.5) for g in opt.param_groups[1:])


# ---------------------------------------------------------------- resume
def step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 50, (2, 9), generator=g)
    opt.zero_grad(set_to_none=True)
    model(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()


def saved(opt: torch.optim.Optimizer) -> dict:
    """The state_dict as a checkpoint holds it: serialised, so later steps cannot mutate it."""
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_a_kind_layout_checkpoint_round_trips_bit_identically():
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2)
    model = tiny(tie=False)
    opt = build_optimizer(model, cfg, CPU)
    for s in range(3):
        apply_schedule(opt, lr_multiplier(s, cfg))
        step(model, opt, s)
    state = saved(opt)

    resumed_model = copy.deepcopy(model)
    resumed = build_optimizer(resumed_model, cfg, CPU)
    load_state_dict(resumed, state)
    assert [g["kind"] for g in resumed.param_groups] == ["matrix", "embedding", "head", "scalar"]
    for opt_, model_ in ((opt, model), (resumed, resumed_model)):
        apply_schedule(opt_, lr_multiplier(3, cfg))
        step(model_, opt_, 3)
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name


def test_a_resume_takes_decay_base_lr_and_implementation_from_this_run():
    model = tiny()
    opt = build_optimizer(model, TrainConfig(lr=1e-2, weight_decay=0.1), CPU)  # fused
    step(model, opt, 0)
    state = saved(opt)
    resumed = build_optimizer(model, TrainConfig(lr=5e-3, weight_decay=0.05), XLA)  # not fused
    load_state_dict(resumed, state)
    for g in resumed.param_groups:
        assert g["base_lr"] == 5e-3 and g["lr"] == 1e-2  # the saved lr stays until apply_schedule
        assert g["weight_decay"] == (0.0 if g["kind"] == "scalar" else 0.05)
        assert not g["fused"]
    apply_schedule(resumed, 1.0)
    step(model, resumed, 1)  # the unfused path accepts the state the fused one saved


def test_a_checkpoint_of_other_groups_or_the_old_two_group_layout_is_refused():
    opt = build_optimizer(tiny(tie=False), TrainConfig(), CPU)
    with pytest.raises(ValueError, match="groups"):
        load_state_dict(build_optimizer(tiny(tie=True), TrainConfig(), CPU), saved(opt))
    model = tiny()
    params = list(model.parameters())  # what build_optimizer made before kinds: [>=2-D params, 1-D params]
    old = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}])
    step(model, old, 0)
    new = build_optimizer(model, TrainConfig(), CPU)
    with pytest.raises(ValueError, match="have no kind.*start a new run"):
        load_state_dict(new, saved(old))
    assert not new.state  # nothing was loaded


@pytest.mark.parametrize("saved_flags", [{"fused": True}, {"capturable": True, "fused": False}],
                         ids=["fused-cuda-or-cpu", "capturable-xla"])
def test_adamw_is_foreach_on_xla_fused_elsewhere_and_a_resume_keeps_this_runs_flags(saved_flags):
    # torch picks foreach only on CUDA-like devices: left alone, AdamW on XLA traces its per-parameter loop.
    groups = build_optimizer(tiny(), TrainConfig(), XLA).param_groups
    assert all(g["foreach"] is True and not g["fused"] and not g["capturable"] for g in groups)
    assert all(g["fused"] is True for g in build_optimizer(tiny(), TrainConfig(), CPU).param_groups)
    # A resume on another device type: the trajectory from the checkpoint, the implementation from this run.
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1)
    model = tiny()
    opt = build_optimizer(model, cfg, CPU)
    for s in range(3):
        step(model, opt, s)
    state = saved(opt)
    for g in state["param_groups"]:
        g.update(saved_flags)
    for target in (CPU, XLA):  # fused here; the XLA backend's foreach (built on CPU params here)
        resumed_model = copy.deepcopy(model)
        resumed = build_optimizer(resumed_model, cfg, target)
        load_state_dict(resumed, copy.deepcopy(state))  # a step shares the loaded tensor
        built = build_optimizer(tiny(), cfg, target).param_groups[0]
        for g in resumed.param_groups:
            assert all(g[k] == built[k] for k in ("fused", "capturable", "foreach", "differentiable")), g
        first = resumed.state[resumed_model.embed.weight]
        assert first["step"].item() == 3 and first["step"].dtype == torch.float32
        step(resumed_model, resumed, 3)
        model_, opt_ = copy.deepcopy((model, opt))  # the uninterrupted run, one more step
        step(model_, opt_, 3)
        for p, q in zip(model_.parameters(), resumed_model.parameters()):  # same update, to fused/foreach rounding
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- optim.name=muon
def step_with_random_grads(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """One optimizer step on Gaussian gradients (full rank, unlike a tiny batch's); returns each weight's change."""
    g = torch.Generator().manual_seed(1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def stepped(shapes: list[tuple[int, int]], *makers, steps: int = 4) -> tuple[list, list[list], list, torch.Generator]:
    """Each maker(params) over its own copy of the same random matrices, `steps` steps on the same Gaussian
    gradients: (the start, each one's params, the optimizers, the generator)."""
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in shapes]
    params = [[p.clone().requires_grad_() for p in start] for _ in makers]
    opts = [make(ps) for make, ps in zip(makers, params)]
    for _ in range(steps):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for ps, opt in zip(params, opts):
            for p, grad in zip(ps, grads):
                p.grad = grad.clone()
            opt.step()
    return start, params, opts, g


ULP = 0.02 * 0.2 * 64 ** 0.5 * 2 ** -7  # the largest per-shape lr times bf16's relative step near 1


def test_muon_orthogonalises_each_matrix_update_where_adamw_does_not():
    lr = 0.01
    spreads: dict[str, list[tuple[float, float]]] = {"muon": [], "adamw": []}
    for name in spreads:
        model = tiny(tie=False)
        opt = build_optimizer(model, TrainConfig(lr=lr, weight_decay=0.0), CPU,
                              OptimConfig(name=name, muon_momentum=0.0, muon_nesterov=False))
        changes = step_with_random_grads(model, opt)
        names = {id(p): n for n, p in model.named_parameters()}
        for p in by_kind(opt.param_groups)["matrix"]["params"]:
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
    """BatchedMuon (matrices above batch_max_numel one at a time: 600 elements in the last case) against
    torch.optim.Muon, 4 steps with weight decay, to one bf16 ulp of the largest update (batched matmuls may round
    otherwise on another CPU)."""
    kw = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust)
    start, (ref, mine), (torch_muon, batched), _ = stepped(
        [(32, 32)] * 3 + [(64, 32)] * 2 + [(32, 64), (8, 16)], lambda ps: torch.optim.Muon(ps, **kw),
        lambda ps: BatchedMuon(ps, **kw, batch_max_numel=batch_max, ns_dtype=torch.bfloat16))
    for a, b, s in zip(ref, mine, start):
        assert (a - s).abs().max() > 100 * ULP  # the parameters did move
        torch.testing.assert_close(b, a, rtol=0, atol=ULP)
        torch.testing.assert_close(batched.state[b]["momentum_buffer"], torch_muon.state[a]["momentum_buffer"])
    # The state_dicts are interchangeable: torch's Muon resumes from the batched one's.
    torch_muon.load_state_dict(batched.state_dict())
    assert torch.equal(torch_muon.state[ref[0]]["momentum_buffer"], batched.state[mine[0]]["momentum_buffer"])


def test_fp32_newton_schulz_is_the_bf16_update_to_bf16s_rounding_and_reaches_the_optimizer():
    """Where bf16 is emulated the backend runs Newton-Schulz in fp32: the exact iteration bf16 approximates, so
    after 4 steps the parameters agree with bf16's to a few bf16 ulps, far below what they moved."""
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    start, (bf16, fp32), _, g = stepped([(32, 32)] * 3 + [(64, 32), (32, 64)],
                                        lambda ps: BatchedMuon(ps, **kw, ns_dtype=torch.bfloat16),
                                        lambda ps: BatchedMuon(ps, **kw, ns_dtype=torch.float32))
    for a, b, s in zip(bf16, fp32, start):
        assert (a - s).abs().max() > 100 * ULP
        torch.testing.assert_close(b, a, rtol=0, atol=8 * ULP)
    x = torch.randn(3, 32, 64, generator=g)
    assert optim_module.orthogonalize(x, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32).dtype == torch.float32
    # BatchedMuon's iteration in fp32 differs from bf16's: the bf16 result is not just cast up.
    assert not torch.equal(optim_module.orthogonalize(x, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.bfloat16).float(),
                           optim_module.orthogonalize(x, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32))
    # optim.muon_dtype as the runtime reads it, for every caller: auto is the backend's.
    for choice, want in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("auto", CPU.backend.reduced_dtype)):
        opt = build_optimizer(tiny(tie=False), TrainConfig(), CPU, OptimConfig(name="muon", muon_dtype=choice))
        assert opt.optimizers["muon"].ns_dtype == want, choice


def test_the_batch_cut_off_is_the_devices_and_reaches_the_optimizer():
    """Every same-shaped matrix shares a Newton-Schulz call without a cut-off (CUDA's), large ones alone above it."""
    shapes = [(32, 32), (64, 32), (32, 32), (8, 16), (64, 32)]
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    assert BatchedMuon(params, ns_dtype=torch.float32).batches(params) == [[0, 2], [1, 4], [3]]
    assert BatchedMuon(params, ns_dtype=torch.float32, batch_max_numel=1024).batches(params) == [[0, 2], [1], [4], [3]]
    cpu = CpuBackend(torch.device("cpu"))
    assert cpu.muon_batch_max_numel == (3 * 2**16 if cpu.native_bf16 else 2**16)  # bf16's cut-off, fp32's
    assert CudaBackend.muon_batch_max_numel is None
    cpu.muon_batch_max_numel = 77  # the runtime's backend's, whatever it is
    rt = Runtime("cpu", torch.device("cpu"), 0, 0, 1, 1, "fp32", backend=cpu)
    opt = build_optimizer(tiny(tie=False), TrainConfig(), rt, OptimConfig(name="muon"))
    assert opt.optimizers["muon"].batch_max_numel == 77 and opt.optimizers["muon"].process_group is None


# ---------------------------------------------------------------- Muon shared out across ranks
# Square, wide and tall matrices, and row counts two ranks cut unevenly (5 = 3 + 2) or leave one rank none of (1).
SPLIT_SHAPES = [(32, 32)] * 3 + [(64, 32)] * 2 + [(32, 64), (5, 16), (1, 8)]
SPLIT_KW = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")


def test_owners_spread_same_shaped_matrices_and_balance_the_newton_schulz_work():
    shapes = [torch.Size(s) for s in [(64, 64)] * 4 + [(64, 256)] * 2 + [(8, 8)]]
    assert owners(shapes, 1) == [0] * 7
    # Largest cost first (the 64x256s), each to the least loaded rank: the 64x64s then go two to a rank.
    assert owners(shapes, 2) == [0, 1, 0, 1, 0, 1, 0]
    # At 4 ranks a 64x256 (3x a 64x64's multiply-adds) takes a rank of its own; two 64x64s share each other one.
    assert owners(shapes, 4) == [2, 3, 2, 3, 0, 1, 2]


def _split_worker(rank: int, world: int, mesh_shape: tuple[int, ...], store: str, out: str,
                  dtype: torch.dtype) -> None:
    """One gloo rank: three Muon steps of SPLIT_SHAPES split across the ranks as DDP replicas and as FSDP2 shards
    on `mesh_shape` ((world,): fsdp; (replicas, group): hsdp), the same gradients on every rank; saves the whole
    results and the matrices this rank orthogonalised."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in SPLIT_SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SPLIT_SHAPES] for _ in range(3)]
    replicas = [p.clone().requires_grad_() for p in start]
    model = torch.nn.Sequential(*(torch.nn.Linear(s[1], s[0], bias=False) for s in SPLIT_SHAPES))  # never run
    with torch.no_grad():
        for linear, p in zip(model, start):
            linear.weight.copy_(p)
    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")  # as parallel._mesh names them
    fully_shard(model, mesh=torch.distributed.device_mesh.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names))
    sharded = [m.weight for m in model]
    opts = {"ddp": BatchedMuon(replicas, **SPLIT_KW, process_group=dist.group.WORLD, ns_dtype=dtype),
            "fsdp": BatchedMuon(sharded, **SPLIT_KW, process_group=dist.group.WORLD, ns_dtype=dtype)}
    done: dict[str, list[tuple[int, ...]]] = {"ddp": [], "fsdp": []}
    real = optim_module.orthogonalize
    for name, params in (("ddp", replicas), ("fsdp", sharded)):
        optim_module.orthogonalize = lambda x, *a: done[name].append(tuple(x.shape)) or real(x, *a)
        for step_grads in grads:
            for p, grad in zip(params, step_grads):
                p.grad = distribute_tensor(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad
            opts[name].step()
    optim_module.orthogonalize = real
    momentum = [opts["fsdp"].state[p]["momentum_buffer"] for p in sharded]
    layout = (Shard(0),) if len(mesh_shape) == 1 else (Replicate(), Shard(0))  # fsdp's, hsdp's
    assert all(isinstance(m, DTensor) and m.placements == layout for m in momentum)  # the param's layout
    torch.save({"ddp": [p.detach() for p in replicas], "fsdp": [p.full_tensor() for p in sharded],
                "fsdp_momentum": [m.full_tensor() for m in momentum], "done": done}, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("mesh_shape,dtype", [((2,), torch.bfloat16), ((2, 2), torch.bfloat16), ((2,), torch.float32)],
                         ids=["fsdp2", "hsdp2x2", "fsdp2-fp32"])
def test_muon_split_over_ranks_steps_like_one_rank_as_replicas_and_as_fsdp_or_hsdp_shards(mesh_shape, dtype,
                                                                                           tmp_path):
    """The owner split over 2 forked gloo ranks (or hsdp's 2 x 2) equals one rank's BatchedMuon after 3 steps, to one
    bf16 ulp, for DDP replicas and FSDP2/hsdp DTensors (uneven rows included); the momentum stays sharded like the
    param; each rank orthogonalised only the matrices it owns, together each once per step (per shard group)."""
    import torch.distributed.fsdp  # noqa: F401 (here, not in each fork: seconds of import)

    world = math.prod(mesh_shape)
    fork_ranks(_split_worker, world, (world, mesh_shape, str(tmp_path / "store"), str(tmp_path), dtype))
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    _, (ref,), (opt,), _ = stepped(SPLIT_SHAPES, lambda ps: BatchedMuon(ps, **SPLIT_KW, ns_dtype=dtype), steps=3)
    for name in ("ddp", "fsdp"):
        for mine, want in zip(ranks[0][name], ref):
            torch.testing.assert_close(mine, want.detach(), rtol=0, atol=ULP)
        for other in ranks[1:]:  # every rank the same
            assert all(torch.equal(a, b) for a, b in zip(ranks[0][name], other[name]))
    for mine, p in zip(ranks[0]["fsdp_momentum"], ref):
        torch.testing.assert_close(mine, opt.state[p]["momentum_buffer"])
    shapes = [torch.Size(s) for s in SPLIT_SHAPES]
    group = mesh_shape[-1]  # the ranks a shard group splits the sharded matrices over
    for name, split, position in (("ddp", world, lambda r: r), ("fsdp", group, lambda r: r % group)):
        owner = owners(shapes, split)
        for r in range(world):
            want = sorted(tuple(shapes[i]) for i in range(len(shapes)) if owner[i] == position(r)) * 3
            got = sorted(s[-2:] for s in ranks[r]["done"][name] for _ in range(s[0] if len(s) == 3 else 1))
            assert got == sorted(want), (name, r)


def test_embedding_head_and_scalars_go_to_adamw_with_their_own_lr_and_decay():
    optim = OptimConfig(name="muon", matrix_lr=0.02, embedding_lr=0.03, head_lr=0.004, scalar_lr=0.005,
                        matrix_weight_decay=0.0, embedding_weight_decay=0.5, head_weight_decay=0.25)
    model = tiny(tie=False)
    opt = build_optimizer(model, TrainConfig(lr=1e-3, weight_decay=0.1), CPU, optim)
    assert isinstance(opt, MuonWithAdamW)
    groups = by_kind(opt.param_groups)
    assert [g["kind"] for g in opt.param_groups] == ["matrix", "embedding", "head", "scalar"]
    assert opt.optimizers["muon"].param_groups == [groups["matrix"]]
    assert opt.optimizers["adamw"].param_groups == [groups["embedding"], groups["head"], groups["scalar"]]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    idx = torch.randint(1, 6, (4, 9), generator=torch.Generator().manual_seed(0))  # 5 of 50 token ids
    model(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()

    # AdamW's first step: decay p by lr * decay, then move it by lr * g / (|g| + eps). Rows of unseen tokens have no
    # grad: they only decay; scalars never decay.
    for name, lr, decay in (("embed.weight", 0.03, 0.5), ("lm_head.weight", 0.004, 0.25), ("norm.weight", 0.005, 0)):
        p = dict(model.named_parameters())[name]
        expected = before[name] * (1 - lr * decay) - lr * p.grad / (p.grad.abs() + 1e-8)
        assert torch.allclose(p.detach(), expected, rtol=1e-4, atol=1e-7), name
    assert (model.embed.weight.grad.abs().sum(1) == 0).sum() >= 40
    assert all("momentum_buffer" in opt.state[p] for p in groups["matrix"]["params"])
    assert all("exp_avg" in opt.state[p] for g in opt.param_groups[1:] for p in g["params"])


def test_per_kind_keys_fall_back_to_train_and_the_schedule_scales_every_kind():
    train = TrainConfig(lr=1e-3, weight_decay=0.1)
    optim = OptimConfig(name="muon", matrix_lr=0.02, embedding_weight_decay=0.0)
    assert kind_hparams("matrix", train, optim) == (0.02, 0.1)
    assert kind_hparams("embedding", train, optim) == (1e-3, 0.0)
    assert kind_hparams("head", train, optim) == (1e-3, 0.1)
    assert kind_hparams("scalar", train, OptimConfig(scalar_lr=0.5)) == (0.5, 0.0)
    optimizers = {name: build_optimizer(tiny(tie=False), train, CPU,
                                        OptimConfig(name=name, matrix_lr=0.02, head_lr=0.004))
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
    model = tiny(tie=False)
    opt = build_optimizer(model, train, CPU, muon)
    step_with_random_grads(model, opt)
    state = saved(opt)
    assert [g["optimizer"] for g in state["param_groups"]] == ["muon", "adamw", "adamw", "adamw"]

    resumed_model = copy.deepcopy(model)
    resumed = build_optimizer(resumed_model, train, CPU, muon)
    load_state_dict(resumed, state)
    assert resumed.optimizers["muon"].param_groups[0] is resumed.param_groups[0]  # re-shared after the load
    assert step_with_random_grads(model, opt).keys() == step_with_random_grads(resumed_model, resumed).keys()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed_model.parameters()))

    adamw_model = copy.deepcopy(model)
    adamw = build_optimizer(adamw_model, train, CPU)
    with pytest.raises(ValueError, match="muon's and this run's optimizer is adamw.*--optim.name=muon"):
        load_state_dict(adamw, state)
    step_with_random_grads(adamw_model, adamw)
    with pytest.raises(ValueError, match="adamw's and this run's optimizer is muon.*--optim.name=adamw"):
        load_state_dict(build_optimizer(model, train, CPU, muon), saved(adamw))
