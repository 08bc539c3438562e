"""Runs inside the torch_xla venv (scripts/xla_venv.sh), driven by tests/xla_jobs.py with PJRT_DEVICE=CPU; prints
one `XLA_RESULT {json}` line with what the tests check.

`train RUN_DIR [--k.v=x ...]` trains through nanopt's own entry points on the XLA device (compilation counts), then
samples greedily on XLA and on the host (`train-only` skips that). `score` scores continuations and generates until a
stop, as lm-eval's `nanopt` model asks, on XLA and on the host. `guard` feeds the compiled step a new shape on every
call: does the recompile guard stop it?"""
from __future__ import annotations

import json
import sys

import torch

from nanopt.config import ModelConfig, load_config, parse_overrides, resolve
from nanopt.distributed import runtime
from nanopt.distributed.xla import MAX_RECOMPILES, WARMUP_STEP_COMPILES
from nanopt.errors import TrainingError
from nanopt.evals.generate import generate
from nanopt.evals.scoring import continuation_scores
from nanopt.recipe.model import build_model
from nanopt.recipe.optim import build_optimizer
from nanopt.training.metrics import setup_logging
from nanopt.training.train import train


def train_and_sample(run_dir: str, overrides: list[str], sample: bool = True) -> dict:
    setup_logging(True)
    cfg = load_config(None, parse_overrides([*overrides, "--runtime.device=xla", f"--run.dir={run_dir}"]))
    rt = runtime.init(cfg.runtime.device, cfg.train.precision, cfg.runtime.threads)
    resolve(cfg, rt.world_size)
    train(cfg, rt)
    out = {"step_calls": rt.backend.step_calls, "step_compiles": rt.backend.step_compiles,
           "recompiles": rt.backend.recompiles, "num_devices": rt.num_devices, "hardware": rt.hardware_name(),
           "precision": cfg.train.precision}
    if not sample:  # sampling compiles its own graphs: one run checks it, the others skip that cost
        return out

    # Sampling: the same host-initialised weights on XLA and on the CPU, greedy, two prompt lengths.
    torch.manual_seed(cfg.run.seed)
    host_model = build_model(cfg.model, "cpu").eval()
    torch.manual_seed(cfg.run.seed)
    xla_model = build_model(cfg.model, rt.device, init_device=rt.backend.init_device).eval()
    rt.backend.mark_step()
    matches, compiles = [], []
    for prompt_len in (5, 9):  # both fall in the same length bucket
        prompt = torch.arange(3, 3 + 2 * prompt_len).view(2, prompt_len) % cfg.model.vocab_size
        before = rt.backend.compile_count()
        on_xla = generate(xla_model, prompt.to(rt.device), 12, temperature=0).cpu()
        compiles.append(rt.backend.compile_count() - before)
        on_host = generate(host_model, prompt, 12, temperature=0)
        matches.append(bool(torch.equal(on_xla, on_host)))
    out.update(sample_tokens=12, sample_compiles=compiles, sample_matches_cpu=matches)
    # The optimizer train() built, as build_optimizer builds it for this device.
    optimizer = build_optimizer(xla_model, cfg.train, rt, cfg.optim)
    out["adamw_foreach"] = all(g["foreach"] for g in optimizer.param_groups if g["optimizer"] == "adamw")
    return out


def recompile_guard() -> dict:
    rt = runtime.init("xla", "fp32", 1)
    weight = torch.nn.Parameter(torch.ones(3, device=rt.device))
    optimizer = torch.optim.SGD([weight], lr=0.1)

    def step(model, opt, micro_batches, rt, grad_clip):  # a "step" whose input grows every call
        x, _ = micro_batches[0]
        return (x.float().sum() * weight).sum(), torch.zeros((), device=rt.device)

    step_fn = rt.backend.compile_step(step, optimizer)
    calls = 0
    try:
        for n in range(1, WARMUP_STEP_COMPILES + MAX_RECOMPILES + 5):
            batch = torch.ones(n, 4, dtype=torch.long)
            step_fn(None, optimizer, [(batch, batch)], rt, 0.0)
            calls += 1
    except TrainingError as e:
        return {"stopped": True, "calls_before_stop": calls, "message": str(e), "limit": MAX_RECOMPILES}
    return {"stopped": False, "calls_before_stop": calls, "limit": MAX_RECOMPILES}


def score() -> dict:
    import torch_xla.debug.metrics as met  # only in the venv, and only here: the other modes set XLA up first

    rt = runtime.init("xla", "fp32", 1)
    cpu = runtime.Runtime("cpu", torch.device("cpu"), 0, 0, 1, 1, "fp32")
    torch.manual_seed(0)
    host = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                                   max_seq_len=32)).eval()
    dev = build_model(host.cfg).eval()
    dev.load_state_dict(host.state_dict())
    dev = dev.to(rt.device)
    requests = [(list(range(1, n)), [5, 6, 7][: 1 + n % 3]) for n in range(2, 40)]  # past the context too
    a, b = continuation_scores(host, requests, cpu, 8), continuation_scores(dev, requests, rt, 8)
    stop = (lambda ids: len(ids) >= 6)
    compiles = met.metric_data("CompileTime")
    generated = [generate(m, torch.tensor([[1, 2, 3]], device=r.device), 10, 0, stop=stop)[0, 3:].tolist()
                 for m, r in ((host, cpu), (dev, rt))]
    return {"max_abs": max(abs(x[0] - y[0]) for x, y in zip(a, b)),
            "greedy_equal": [x[1] for x in a] == [y[1] for y in b], "generate_equal": generated[0] == generated[1],
            "requests": len(requests), "compiles": compiles[0] if compiles else 0}


if __name__ == "__main__":
    if sys.argv[1] in ("train", "train-only"):
        result = train_and_sample(sys.argv[2], sys.argv[3:], sample=sys.argv[1] == "train")
    elif sys.argv[1] == "score":
        result = score()
    else:
        result = recompile_guard()
    print("XLA_RESULT " + json.dumps(result), flush=True)
