"""Runs inside the torch_xla venv (scripts/xla_venv.sh), driven by tests/test_xla.py with PJRT_DEVICE=CPU.

`python tests/xla_driver.py train RUN_DIR [--k.v=x ...]` trains through nanopt's own entry points
(load_config -> runtime.init -> train) on the XLA device, then samples greedily from a freshly initialised
model on XLA and on the host, and prints one JSON line with what the tests check: the train step's
compilation counts, sampling's compilations and whether its tokens equal the CPU reference's.
`python tests/xla_driver.py guard` feeds the compiled-step wrapper a new shape on every call and reports
whether the recompile guard stopped it.
"""
from __future__ import annotations

import json
import sys

import torch


def train_and_sample(run_dir: str, overrides: list[str], sample: bool = True) -> dict:
    from nanopt import runtime
    from nanopt.config import load_config, parse_overrides, resolve
    from nanopt.generate import generate
    from nanopt.metrics import setup_logging
    from nanopt.model import build_model
    from nanopt.optim import build_optimizer
    from nanopt.train import train

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
    rt.mark_step()
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
    optimizer = build_optimizer(xla_model, cfg.train, rt.kind, cfg.optim)
    out["adamw_foreach"] = all(g["foreach"] for g in optimizer.param_groups if g["optimizer"] == "adamw")
    return out


def recompile_guard() -> dict:
    from nanopt import runtime
    from nanopt.errors import TrainingError
    from nanopt.xla import MAX_RECOMPILES, WARMUP_STEP_COMPILES

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


if __name__ == "__main__":
    if sys.argv[1] in ("train", "train-only"):
        result = train_and_sample(sys.argv[2], sys.argv[3:], sample=sys.argv[1] == "train")
    else:
        result = recompile_guard()
    print("XLA_RESULT " + json.dumps(result), flush=True)
