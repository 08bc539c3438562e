"""Verify nanopt's CUDA path on one GPU and measure it: one command, a Markdown report and a JSON file.

    python bench/gpu_check.py --quick --part 1 --deadline-s 270 --out DIR   # the never-run paths, half of them
    python bench/gpu_check.py --quick --part 2 --deadline-s 270 --out DIR   # the other half (gpu_quick.py's PLAN)
    python bench/gpu_check.py --quick --cpu-smoke               # the same at toy size on CPU (the suite runs it)
    python bench/gpu_check.py                                   # every full section, roughly 25 minutes on one H100
    python bench/gpu_check.py --sections env,attention,ddp      # some of them (each under 10 minutes)
    python bench/gpu_check.py --cpu-smoke                       # the same code at toy size on CPU (a test runs it)

Sections (docs/results.md "GPU: one H100"; issue 16's findings in brackets):
  env        versions (torchao included), the device, how nanopt names it (SXM/PCIe), its peak and FP8 support;
             a measured bf16 matmul
  attention  the SDPA kernel torch picks per dtype at 1B shapes, with and without nanopt's GQA handling
             [5]; nanopt's sdpa and flash-attn (when installed) against a float64 reference
  ddp        nanopt's own DDP path (train.step_model: compiled, then DDP; train_step's no_sync) at world size 1 in a
             real NCCL process group against the unwrapped model: tokens/s, graphs and graph breaks, loss; and
             DDP gradient memory under no_sync micro-steps, zeroing set to None vs in place [1]
  ranks2     two ranks of `python -m nanopt.main` on one GPU (gloo: NCCL refuses two ranks on one device) against
             one rank with twice the accumulation: the loss at every step, and the replicas' weights
  sample     KV-cache sampling: tokens/s with and without the cache, and the cache's logits against one full forward
  resume     a short run killed in a step and resumed on this device, against an uninterrupted one
  tasks      downstream scoring speed: a HellaSwag-sized synthetic set (10,042 items x 4 endings, ~100 tokens
             each) scored by nanopt.evals.scoring (lm-eval's `nanopt` model) on the 1B config in bf16; goal < 60 s
  fp8        train.fp8 (torchao, tensorwise): 1b and 170m tokens/s against bf16 compiled, and the loss gap after
             200 steps of the 170m model on real text (--text: shards of the embedded corpus by default; the GPU
             machine has no network, so carry them)
  170m, 1b   real `python -m nanopt.main` runs of configs/170m-1gpu.yaml and configs/1b.yaml (1B as one
             rank of eight: global batch 131072 = 4 x 4096 x 8 micro-steps), in each --variants: tokens/s,
             MFU, peak allocated and reserved memory, the profiler's shares and top ops [2, 3, 7]
Training data are synthetic shards written here (random tokens; nothing is downloaded), except fp8's loss gap.
Everything computes in bf16 on the GPU; --cpu-smoke too where the CPU has bf16 hardware, in fp32 where it would
emulate bf16 (_gpu.check_precision), and the JSON's `precision` and the reports say which.
Each section runs on its own: one that fails is reported as failed and the rest go on. The fp8, ranks2 and sample
sections, ddp's nanopt-path half and the top ops without "Command Buffer Full" rows have so far run only as
--cpu-smoke: their GPU times above are estimates.
"""
from __future__ import annotations

import time

STARTED = time.monotonic()  # --deadline-s counts from here, before the imports: the command's whole time

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import gpu_quick
from _common import parser
from _gpu import (QUIET, REPO, VARIANTS, WorldOfOne, _fmt, check_env, check_precision, check_sample, check_tasks,
                  free_port, md_env, md_sample, md_tasks, model_config, nanopt_run, peak_gib, process_group,
                  random_batches, run_sections, section_failed, speed_of, time_train_step, write_shards)

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from nanopt import io, rundirs  # noqa: E402
from nanopt.config import load_config, parse_overrides  # noqa: E402
from nanopt.data import shards  # noqa: E402
from nanopt.distributed.parallel import no_forward_buffer_sync  # noqa: E402
from nanopt.distributed.runtime import Runtime  # noqa: E402
from nanopt.lab import runs as experiments  # noqa: E402
from nanopt.recipe import attention  # noqa: E402
from nanopt.recipe.model import build_model  # noqa: E402

SECTIONS = ("env", "attention", "ddp", "ranks2", "sample", "resume", "tasks", "fp8", "speedrun", "170m", "1b")


# ---------------------------------------------------------------- sizes: the real ones and the CPU smoke's


# The 170m recipe at 2 layers and 8,192 tokens a step: a real run that is over in seconds.
SMALL_170M = ["--config", "configs/170m-1gpu.yaml", "--model.n_layers=2", "--train.seq_len=1024",
              "--train.micro_batch_size=4", "--train.global_batch_tokens=8192"]


def sizes(smoke: bool) -> dict[str, Any]:
    """Shapes and step counts for each section: the configs' own on a GPU, toys for --cpu-smoke (in its
    check_precision: fp32 where this CPU would emulate bf16)."""
    if not smoke:
        return {
            "attention": dict(B=1, T=4096, Hq=32, Hkv=8, D=64),  # configs/1b.yaml, one sequence
            "ddp_model": dict(config="configs/1b.yaml", micro=(1, 2048), accum=4, steps=5, overrides=[]),
            "fp8": dict(variants=["compiled", "fp8"], loss_steps=200, models=["1b", "170m"], precision="bf16", loss=[
                "--config", "configs/170m-1gpu.yaml", "--model.vocab_size=257", "--train.global_batch_tokens=32768",
                "--train.warmup_steps=20"]),
            "sample": dict(config="configs/1b.yaml", batch=4, prompt=128, new=256),
            # Byte-level text has whole plays for documents (packing would crop nearly all): windows, vocab 257.
            "speedrun": dict(speed=["--config", "configs/speedrun-gpu.yaml", "--data.packing=windows"],
                             curve=["--config", "configs/speedrun-gpu.yaml", "--data.packing=windows",
                                    "--model.vocab_size=257", "--train.target_val_loss=null"], curve_steps=300),
            "train": {
                "170m": ["--config", "configs/170m-1gpu.yaml"],
                "1b": ["--config", "configs/1b.yaml", "--train.global_batch_tokens=131072"],
            },
            "resume": SMALL_170M,
            "ranks2": SMALL_170M,
            "steps": 12, "shard_tokens": 4_000_000,
            "tasks": dict(config="configs/1b.yaml", items=10042, context=70, ending=30, batch=64),
        }
    precision = check_precision(torch.device("cpu"))
    toy = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
           "--model.ffn_dim=128", "--model.vocab_size=512", "--train.seq_len=64", "--train.micro_batch_size=2",
           "--train.global_batch_tokens=256", "--runtime.threads=1", f"--train.precision={precision}",
           "--train.fp8_filter=all"]  # toy Linears are below torchao's thresholds: FP8 variants convert them anyway
    return {
        "attention": dict(B=1, T=128, Hq=4, Hkv=2, D=16),
        "ddp_model": dict(config=None, micro=(2, 32), accum=4, steps=3, overrides=[*toy, "--train.compile=false"]),
        "fp8": dict(variants=["eager", "fp8_eager"], loss_steps=20, models=["1b"], precision=precision,  # 170m: 1b
                    loss=["--config", "configs/170m-1gpu.yaml", *toy, "--model.vocab_size=257"]),
        "sample": dict(config=None, batch=2, prompt=8, new=16),
        "speedrun": dict(speed=["--config", "configs/speedrun-gpu.yaml", "--data.packing=windows", *toy,
                                "--train.batch_schedule=", "--train.compile=false"],
                         curve=["--config", "configs/speedrun-gpu.yaml", "--data.packing=windows", *toy,
                                "--model.vocab_size=257", "--train.batch_schedule=", "--train.compile=false",
                                "--train.target_val_loss=null"], curve_steps=20),
        "train": {"170m": ["--config", "configs/170m-1gpu.yaml", *toy],
                  "1b": ["--config", "configs/1b.yaml", *toy]},
        # Eager: what these two check (the same loss across ranks, an exact resume) is not the compiler's, and a toy's
        # compilation costs a CPU 5 s per process.
        "resume": ["--config", "configs/170m-1gpu.yaml", *toy, "--train.compile=false"],
        "ranks2": ["--config", "configs/170m-1gpu.yaml", *toy, "--train.compile=false"],
        "steps": 10, "shard_tokens": 40_000,
        "tasks": dict(config=None, items=40, context=20, ending=8, batch=16),
    }




# ---------------------------------------------------------------- env




# ---------------------------------------------------------------- attention


def sdpa_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> str:
    """The kernel F.scaled_dot_product_attention would run for these inputs (causal)."""
    from torch.nn.attention import SDPBackend

    code = torch._fused_sdp_choice(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, enable_gqa=gqa)
    return next((name for name, b in SDPBackend.__members__.items() if int(b.value) == code), str(code))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def check_attention(device: torch.device, shape: dict[str, int]) -> dict[str, Any]:
    B, T, Hq, Hkv, D = (shape[k] for k in ("B", "T", "Hq", "Hkv", "D"))
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, h, T, D, generator=g).to(device) for h in (Hq, Hkv, Hkv))  # B H T D
    ref = attention.eager(q.double(), k.double(), v.double())  # B Hq T D, float64
    out: dict[str, Any] = {"shape": shape}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        qd, kd, vd = (t.to(dtype).requires_grad_() for t in (q, k, v))
        row: dict[str, Any] = {"sdpa_kernel_enable_gqa": sdpa_choice(qd, kd, vd, True)}
        kx, vx = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (kd, vd))
        row["sdpa_kernel_heads_repeated"] = sdpa_choice(qd, kx, vx, False)
        precision = "fp32" if dtype == torch.float32 else "bf16"
        row["nanopt_kernel"], kernel = attention.choose("sdpa", device.type, precision)
        row["nanopt_sdpa_rel_err"] = rel_err(kernel(qd, kd, vd).detach(), ref)
        row["nanopt_sdpa_peak_gib"] = peak_gib(device, lambda: kernel(qd, kd, vd).sum().backward())
        if device.type == "cuda" and attention.flash_unavailable_reason("cuda") is None:
            row["flash_attn_rel_err"] = rel_err(attention.flash(qd, kd, vd).detach(), ref)
        out[name] = row
    return out




# ---------------------------------------------------------------- ddp gradient memory






def check_ddp(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """nanopt's DDP path against the unwrapped model, then the gradient memory under no_sync, in one process group."""
    with process_group(device):
        out = {"nanopt_path": check_ddp_path(device, spec)}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out.update(check_ddp_memory(device, spec))
    return out




def check_ddp_path(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """The train step as train.step_model builds it (compiled per the config, then DDP) against the same step unwrapped:
    tokens/s, torch.compile's graphs and graph breaks, and the loss after the same steps from the same weights."""
    cfg = load_config(REPO / (spec["config"] or "configs/170m-1gpu.yaml"), parse_overrides(spec["overrides"]))
    (b, t), accum = spec["micro"], spec["accum"]
    batches = random_batches(cfg.model.vocab_size, (b, t), accum)
    out: dict[str, Any] = {"compile": cfg.train.compile, "micro_batch": [b, t], "accum": accum}
    for name, runtime in (("unwrapped", Runtime), ("ddp", WorldOfOne)):
        rt = runtime(device.type, device, 0, 0, 1, 1, cfg.train.precision)
        out[name] = time_train_step(cfg, rt, batches, spec["steps"])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["ddp_over_unwrapped"] = out["ddp"]["tokens_per_s"] / out["unwrapped"]["tokens_per_s"]
    out["loss_diff"] = abs(out["ddp"]["loss"] - out["unwrapped"]["loss"])
    return out




def check_ddp_memory(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """Two optimizer-free steps of `accum` micro-steps (no_sync but the last), zeroing the gradients after
    each as torch's default (set_to_none) or in place: the second step's peak memory, and the storages
    holding the gradients after its first micro-step."""
    cfg = model_config(spec["config"])
    (b, t), accum = spec["micro"], spec["accum"]
    out: dict[str, Any] = {"model": spec["config"] or "toy", "params": None, "micro_batch": [b, t], "accum": accum}
    bf16 = check_precision(device) == "bf16"  # autocast as training's, where the device computes bf16 natively
    for set_to_none in (True, False):
        torch.manual_seed(0)
        model = build_model(cfg, device)
        out["params"] = model.num_params()
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  gradient_as_bucket_view=True, **no_forward_buffer_sync())
        x = torch.randint(0, cfg.vocab_size, (b, t + 1), device=device)

        storages: set[int] = set()

        def step() -> None:
            storages.clear()
            for i in range(accum):
                with contextlib.nullcontext() if i == accum - 1 else ddp.no_sync():
                    with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                        loss = ddp(x[:, :-1], x[:, 1:])
                    loss.backward()
                if i == 0:  # where the no_sync gradients live: DDP's bucket, or storages of their own
                    storages.update(p.grad.untyped_storage().data_ptr() for p in model.parameters())
            ddp.zero_grad(set_to_none=set_to_none)

        step()
        peak = peak_gib(device, step)
        out["set_to_none" if set_to_none else "in_place"] = {"step_peak_gib": peak, "grad_storages": len(storages)}
        del ddp, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["grad_gib"] = round(out["params"] * 4 / 2**30, 2)
    return out


# ---------------------------------------------------------------- sampling with the KV cache






# ---------------------------------------------------------------- training runs (python -m nanopt.main)
















def check_train(name: str, args: list[str], variants: list[str], work: Path, steps: int, shards: Path,
                timeout: float, done: Optional[dict[tuple, dict[str, Any]]] = None) -> dict[str, Any]:
    """One nanopt run per variant; the profiler records steps wait+2..wait+3, which the speed leaves out. `done`:
    the runs of this check so far, by what they ran: the same run asked for again (fp8's bf16 baseline is the 1b
    and 170m sections' compiled run) is reported again, not run again."""
    done = {} if done is None else done
    out: dict[str, Any] = {}
    for variant in variants:
        key = (tuple(args), variant, steps, str(shards))
        if key not in done:
            done[key] = train_run(f"{name}-{variant}", [*args, *VARIANTS[variant]], work, steps, shards, timeout)
        out[variant] = {"flags": VARIANTS[variant], **done[key]}
    return out


def train_run(name: str, args: list[str], work: Path, steps: int, shards: Path, timeout: float) -> dict[str, Any]:
    """One profiled run: its speed, memory, profile shares and top ops."""
    wait = steps - 5  # profiled: step wait+1 (warm-up), wait+2..wait+3 (active); wait+4 pays the trace export
    profile = ["--profile.enabled=true", f"--profile.wait={wait}", "--profile.warmup=1", "--profile.active=2"]
    skip = {1, 2, *range(wait + 1, wait + 5)}
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    res = nanopt_run([*args, *QUIET, *profile, f"--data.source={shards}", f"--train.max_steps={steps}"], run_dir,
                     timeout)
    prof = experiments.read_profile(run_dir) or {}
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 15 GB at 1B: not wanted past the run
    return {"rc": res["rc"], "wall_s": res["wall_s"], **speed_of(res["records"], skip),
            "profile": {k: prof.get(k) for k in ("mode", "host_overhead_share", "data_loader_share", "compute_share",
                                                 "step_ms_mean")},
            "top_ops": [(o["name"], round(o["self_share"], 3)) for o in prof.get("top_ops", [])[:8]],
            # At most 1 since "Command Buffer Full" rows are left out (it was 1.28 at 1B, counted twice).
            "top_ops_share_sum": round(sum(o["self_share"] for o in prof.get("top_ops", [])), 3),
            "log_tail": res["log_tail"] if res["rc"] != 0 else "", "log_notable": res["log_notable"],
            "log_times": res["log_times"]}




# ---------------------------------------------------------------- fp8


def check_fp8(spec: dict[str, Any], train_args: dict[str, list[str]], work: Path, steps: int, shards: Path,
              text: Path, timeout: float, done: Optional[dict[tuple, dict[str, Any]]] = None) -> dict[str, Any]:
    """train.fp8 against bf16 (spec's precision: a CPU smoke's may be fp32): each model's speed (check_train's runs of
    both variants) and the loss gap on text."""
    base, fp8 = spec["variants"]
    out: dict[str, Any] = {"variants": spec["variants"], "models": spec["models"], "precision": spec["precision"]}
    for name in spec["models"]:
        runs = check_train(f"fp8-{name}", train_args[name], spec["variants"], work, steps, shards, timeout, done)
        speeds = [runs[v].get("tokens_per_s") for v in (base, fp8)]
        out[name] = {**runs, "fp8_speedup": speeds[1] / speeds[0] if all(speeds) else None}
    out["loss"] = fp8_loss_gap(spec, work, text, timeout)
    return out


def fp8_loss_gap(spec: dict[str, Any], work: Path, text: Path, timeout: float) -> dict[str, Any]:
    """The same run in bf16 and in FP8 for `loss_steps` steps on real text (byte-level, so any carried shards of the
    embedded corpus serve): the mean train loss of the last logged steps and the final validation loss of each."""
    out: dict[str, Any] = {"text": str(text), "steps": spec["loss_steps"]}
    for variant in spec["variants"]:
        run_dir = work / f"fp8-loss-{variant}"
        shutil.rmtree(run_dir, ignore_errors=True)
        res = nanopt_run([*spec["loss"], *QUIET, *VARIANTS[variant], f"--data.source={text}", "--eval.batches=8",
                          f"--train.max_steps={spec['loss_steps']}", "--log.every=5"], run_dir, timeout)
        losses = [r["loss"] for r in res["records"] if "loss" in r]
        val = [r["val_loss"] for r in res["records"] if "val_loss" in r]
        out[variant] = {"rc": res["rc"], "wall_s": res["wall_s"], "val_loss": val[-1] if val else None,
                        "train_loss_last": statistics.mean(losses[-4:]) if losses else None,
                        "log_tail": res["log_tail"] if res["rc"] != 0 else ""}
        shutil.rmtree(run_dir, ignore_errors=True)
    vals = [out[v]["val_loss"] for v in spec["variants"]]
    out["val_loss_gap"] = vals[1] - vals[0] if None not in vals else None  # FP8 minus bf16 (or the smoke's fp32)
    return out


# ---------------------------------------------------------------- configs/speedrun-gpu.yaml


def check_speedrun(spec: dict[str, Any], work: Path, steps: int, shards: Path, text: Path,
                   timeout: float) -> dict[str, Any]:
    """The GPU recipe as shipped: tokens/s and MFU on synthetic shards (its first batch stage), then its
    validation curve over `curve_steps` steps on real byte-level text (the model at vocab 257)."""
    out: dict[str, Any] = {"speed": check_train("speedrun", spec["speed"], ["default"], work, steps, shards,
                                                timeout)["default"]}
    run_dir = work / "speedrun-curve"
    shutil.rmtree(run_dir, ignore_errors=True)
    every = max(1, spec["curve_steps"] // 6)
    res = nanopt_run([*spec["curve"], *QUIET, f"--data.source={text}", f"--train.max_steps={spec['curve_steps']}",
                      f"--eval.every={every}", "--eval.batches=8", "--log.every=10"], run_dir, timeout)
    out["curve"] = {"rc": res["rc"], "wall_s": res["wall_s"], "text": str(text),
                    "val_loss": [(r["step"], round(r["val_loss"], 4)) for r in res["records"] if "val_loss" in r],
                    "log_tail": res["log_tail"] if res["rc"] != 0 else ""}
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


# ---------------------------------------------------------------- two ranks on one device

# NCCL refuses two ranks on one GPU, so these ranks' process group is gloo (it carries CUDA tensors through the
# host); the rest is nanopt's own `python -m nanopt.main`.
GLOO_DRIVER = """import sys
from nanopt.distributed import runtime  # noqa: E402
start = runtime.CudaBackend.__init__
def gloo(self, device):
    start(self, device)
    self.process_group_options = {"backend": "gloo"}
runtime.CudaBackend.__init__ = gloo
from nanopt.main import run  # noqa: E402
sys.exit(run(sys.argv[1:]))
"""


def two_ranks(args: list[str], run_dir: Path, timeout: float) -> dict[str, Any]:
    """Ranks 0 and 1 of a world of two, both on device 0 (each its node's only local rank): exit codes, records."""
    port, procs = free_port(), []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        log = open(run_dir.parent / f"{run_dir.name}.rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-c", GLOO_DRIVER, *args, f"--run.dir={run_dir}"], cwd=REPO,
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline, codes = time.monotonic() + timeout, []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(None)
        log.close()
    tail = Path(procs[0][1].name).read_text().strip().splitlines()[-15:]
    rc = next((c for c in codes if c != 0), 0)  # the first failure (None: timed out), else 0
    return {"rc": rc, "rc_per_rank": codes, "records": rundirs.read_metrics(run_dir), "log_tail": "\n".join(tail)}


def check_ranks2(args: list[str], work: Path, shards: Path, timeout: float) -> dict[str, Any]:
    """The same 10 steps as one rank (2 accumulation micro-steps) and as two ranks on one device (1 each): the loss
    at every step should agree to rounding (the gradient sums are added in another order); the replicas' weights
    must be equal."""
    common = [*args, *QUIET, f"--data.source={shards}", "--train.max_steps=10"]
    one = nanopt_run(common, work / "ranks-one", timeout)
    two = two_ranks(common, work / "ranks-two", timeout)
    losses = [{r["step"]: r["loss"] for r in res["records"] if "loss" in r} for res in (one, two)]
    steps = sorted(set(losses[0]) & set(losses[1]))
    digests = (rundirs.read_summary(work / "ranks-two") or {}).get("weights_sha256_per_rank") or []
    out = {"one_rank": {"rc": one["rc"], "wall_s": one["wall_s"]},
           "two_ranks": {"rc": two["rc"], "rc_per_rank": two["rc_per_rank"]}, "steps_compared": steps,
           "max_abs_loss_diff": max((abs(losses[0][s] - losses[1][s]) for s in steps), default=None),
           "replicas_equal": len(digests) == 2 and digests[0] == digests[1]}
    if one["rc"] != 0 or two["rc"] != 0:
        out["log_tail"] = one["log_tail"] if one["rc"] != 0 else two["log_tail"]
    for d in ("ranks-one", "ranks-two"):
        shutil.rmtree(work / d, ignore_errors=True)
    return out


def check_resume(args: list[str], work: Path, shards: Path, timeout: float) -> dict[str, Any]:
    """10 steps straight vs killed in step 7 (SIGKILL) and resumed from the step-4 checkpoint (RNG and fused
    AdamW state included): loss differences and whether the weights (the summaries' digests) are equal, next to
    the same for a second straight run, the device's own run-to-run noise (bitwise on CPU, not on cuDNN)."""
    common = [*args, *QUIET, f"--data.source={shards}", "--train.max_steps=10", "--checkpoint.every=4",
              "--checkpoint.keep=1"]
    straight = nanopt_run(common, work / "resume-straight", timeout)
    again = nanopt_run(common, work / "resume-again", timeout)  # the noise floor: is the device deterministic?
    killed = nanopt_run(common, work / "resume-killed", timeout, env={"NANOPT_TEST_HOOK": "kill-in-step:7"})
    resumed = nanopt_run(common, work / "resume-killed", timeout)
    losses = {name: {r["step"]: r["loss"] for r in res["records"] if "loss" in r}
              for name, res in (("straight", straight), ("again", again), ("resumed", resumed))}
    common_steps = sorted(set(losses["straight"]) & set(losses["resumed"]) - {1, 2, 3, 4})

    def max_diff(other: str) -> Optional[float]:
        diffs = [abs(losses["straight"][s] - losses[other].get(s, float("nan"))) for s in common_steps]
        return max(diffs) if diffs else None

    dirs = ("resume-straight", "resume-again", "resume-killed")
    digests = [(rundirs.read_summary(work / d) or {}).get("weights_sha256_per_rank") for d in dirs]
    out = {"rc": [straight["rc"], again["rc"], killed["rc"], resumed["rc"]], "steps_compared": common_steps,
           "max_abs_loss_diff": max_diff("resumed"), "weights_equal": digests[0] == digests[2] != None,
           "rerun_max_abs_loss_diff": max_diff("again"), "rerun_weights_equal": digests[0] == digests[1] != None}
    if resumed["rc"] != 0 or straight["rc"] != 0:
        out["log_tail"] = resumed["log_tail"] if resumed["rc"] != 0 else straight["log_tail"]
    for d in dirs:
        shutil.rmtree(work / d, ignore_errors=True)
    return out


# ---------------------------------------------------------------- report


def markdown(results: dict[str, Any]) -> str:
    """The report: one part per section that ran, then each failed section's traceback."""
    lines = [f"# nanopt GPU check, {results['date']}", "", f"command: `{results['command']}`", "",
             f"precision: {results.get('precision', 'bf16')}", ""]
    for name, part in MARKDOWN.items():
        r = results.get(name)
        if isinstance(r, dict) and r and "error" not in r:
            lines += part(r) + [""]
    for name in ("170m", "1b"):
        runs = results.get(name)
        if isinstance(runs, dict) and runs and "error" not in runs:
            lines += [f"## Training {name}", ""] + train_table(name, runs) + [""]
    for name, r in results.items():
        if isinstance(r, dict) and "error" in r:
            lines += [f"## {name}: FAILED", "", "```", r["error"], "```", ""]
    return "\n".join(lines)




def md_attention(att: dict[str, Any]) -> list[str]:
    lines = [f"## Attention at {att['shape']}", "",
             "| dtype | SDPA kernel, enable_gqa | SDPA kernel, heads repeated | nanopt's kernel | rel. err | "
             "fwd+bwd peak GiB | flash-attn rel. err |", "|---|---|---|---|---|---|---|"]
    for dtype in ("bfloat16", "float32"):
        r = att[dtype]
        lines.append(f"| {dtype} | {r['sdpa_kernel_enable_gqa']} | {r['sdpa_kernel_heads_repeated']} | "
                     f"{r['nanopt_kernel']} | {r['nanopt_sdpa_rel_err']:.1e} | {r['nanopt_sdpa_peak_gib']} | "
                     f"{_fmt(r.get('flash_attn_rel_err'), '.1e')} |")
    return lines


def md_ddp(ddp: dict[str, Any]) -> list[str]:
    path = ddp["nanopt_path"]
    lines = [f"## nanopt's DDP path at world size 1 (compile {path['compile']}, micro-batch {path['micro_batch']} x "
             f"{path['accum']})", "", "| model as trained | tokens/s | graphs | graph breaks | loss |",
             "|---|---|---|---|---|"]
    for name in ("unwrapped", "ddp"):
        r = path[name]
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['graphs']} | {r['graph_breaks']} | {r['loss']:.5f} |")
    lines += ["", f"DDP / unwrapped tokens/s **{path['ddp_over_unwrapped']:.3f}**; loss difference "
              f"{path['loss_diff']:.1e}",
              "", f"## DDP gradients under no_sync ({ddp['model']}, {ddp['params']:,} parameters, fp32 gradients "
              f"{ddp['grad_gib']} GiB, {ddp['accum']} micro-steps)", "",
              "| zero_grad | step peak GiB | gradient storages |", "|---|---|---|"]
    for mode in ("set_to_none", "in_place"):
        lines.append(f"| {mode} | {ddp[mode]['step_peak_gib']} | {ddp[mode]['grad_storages']} |")
    return lines


def md_ranks2(r: dict[str, Any]) -> list[str]:
    return ["## Two ranks on one GPU (gloo) against one rank", "",
            f"exit codes one rank {r['one_rank']['rc']}, two ranks {r['two_ranks']['rc_per_rank']}; steps compared "
            f"{r['steps_compared']}: max loss difference **{_fmt(r['max_abs_loss_diff'], '.1e')}**; the two replicas' "
            f"weights equal: {r['replicas_equal']}"]




def md_resume(res: dict[str, Any]) -> list[str]:
    return ["## Kill and resume", "", f"exit codes straight/again/killed/resumed {res['rc']}; steps compared "
            f"{res['steps_compared']}", "", "| against the straight run | max loss difference | final weights equal |",
            "|---|---|---|",
            f"| killed at step 7, resumed from 4 | {res['max_abs_loss_diff']} | {res['weights_equal']} |",
            f"| the same run again (noise floor) | {res['rerun_max_abs_loss_diff']} | {res['rerun_weights_equal']} |"]




def md_fp8(r: dict[str, Any]) -> list[str]:
    base, fp8 = r["variants"]
    lines = [f"## FP8 (train.fp8) against {r['precision']}: {fp8} vs {base}", "",
             "The FP8 rows' MFU is bf16-equivalent: their FP8 matmuls are counted against the dense bf16 peak.", ""]
    for name in r["models"]:
        runs = {v: r[name][v] for v in r["variants"]}
        lines += [f"{name}: FP8 / bf16 tokens/s **{_fmt(r[name]['fp8_speedup'], '.3f')}**", ""]
        lines += train_table(name, runs) + [""]
    loss = r["loss"]
    lines.append(f"Loss after {loss['steps']} steps of the 170m model on {loss['text']}: val loss {base} "
                 f"{_fmt(loss[base]['val_loss'], '.4f')}, {fp8} {_fmt(loss[fp8]['val_loss'], '.4f')}; gap "
                 f"**{_fmt(loss['val_loss_gap'], '+.4f')}** (train loss {_fmt(loss[base]['train_loss_last'], '.4f')} "
                 f"vs {_fmt(loss[fp8]['train_loss_last'], '.4f')})")
    return lines


def md_speedrun(r: dict[str, Any]) -> list[str]:
    curve = r["curve"]
    points = ", ".join(f"{step}: {loss:.4f}" for step, loss in curve["val_loss"])
    return ["## configs/speedrun-gpu.yaml", ""] + train_table("speedrun", {"default": r["speed"]}) + [
        "", f"Validation loss by step on {curve['text']} (byte-level, vocab 257; rc {curve['rc']}): {points or '-'}"]


def train_table(name: str, runs: dict[str, Any]) -> list[str]:
    """One row per variant: speed, MFU, memory, the profile's shares and its top ops."""
    lines = ["| variant | rc | tokens/s | MFU | step ms | peak alloc GiB | peak reserved GiB | compute / host / data "
             "| top ops (self share) |", "|---|---|---|---|---|---|---|---|---|"]
    for variant, r in runs.items():
        p = r["profile"]
        shares = "/".join(_fmt(p.get(k), ".0%") for k in ("compute_share", "host_overhead_share", "data_loader_share"))
        ops = ", ".join(f"{n} {s:.0%}" for n, s in r["top_ops"][:5])
        lines.append(f"| {variant} | {r['rc']} | {_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('mfu'), '.1%')} "
                     f"| {_fmt(r.get('step_ms'), '.0f')} | {_fmt(r.get('peak_allocated_gib'), '.1f')} | "
                     f"{_fmt(r.get('peak_reserved_gib'), '.1f')} | {shares} | {ops} |")
    lines += [f"{name} {v} failed:\n```\n{r['log_tail']}\n```\n" for v, r in runs.items() if r["rc"] != 0]
    return lines


MARKDOWN: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "env": md_env, "attention": md_attention, "ddp": md_ddp, "ranks2": md_ranks2, "sample": md_sample,
    "resume": md_resume, "tasks": md_tasks, "fp8": md_fp8, "speedrun": md_speedrun,
}




def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__file__, __doc__)
    p.add_argument("--quick", action="store_true", help="the quick check: every never-run GPU path at the smallest "
                   f"size that exercises it ({', '.join(gpu_quick.QUICK_SECTIONS)}; bench/gpu_quick.py)")
    p.add_argument("--sections", default="", help=f"comma list of {', '.join(SECTIONS)} (with --quick: of the quick "
                   "sections); default all")
    p.add_argument("--part", type=int, choices=(1, 2), help="with --quick: the sections of this part (gpu_quick.PLAN: "
                   "each part's budgets add up to under 5 minutes on the H200)")
    p.add_argument("--deadline-s", type=float, help="with --quick: start no section whose budget (gpu_quick.PLAN) "
                   "would carry the check past this many seconds from its start; it is reported skipped, `deadline`")
    p.add_argument("--variants", default="", help=f"comma list of {', '.join(VARIANTS)} (default: compiled,eager; "
                   "smoke: eager)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per training run (0: 12; smoke 10)")
    p.add_argument("--cpu-smoke", action="store_true", help="toy sizes on CPU: checks the script, measures nothing")
    p.add_argument("--out", default="runs/gpu_check", help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--work", default="", help="scratch directory for shards and runs (default: /dev/shm or tmp)")
    p.add_argument("--timeout", type=float, default=420, help="seconds allowed per training run")
    p.add_argument("--text", default="", help="fp8's loss gap: a directory of token shards of real text (default: "
                   "the embedded corpus, byte-level, fetched once into NANOPT_CACHE; a GPU machine without network "
                   "needs a carried copy)")
    a = p.parse_args(argv)
    if not a.quick and (a.part or a.deadline_s is not None) or a.part and a.sections:
        p.error("--part and --deadline-s go with --quick (its sections have budgets), and --part with no --sections")
    known = gpu_quick.QUICK_SECTIONS if a.quick else SECTIONS
    in_part = [s for s in known if a.part and gpu_quick.PLAN[s][0] in (0, a.part)]
    a.sections = [s for s in a.sections.split(",") if s] or in_part or list(known)
    a.variants = a.variants or ("eager" if a.cpu_smoke else "compiled,eager")
    unknown = set(a.sections) - set(known) | set(a.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown section or variant {sorted(unknown)}")
    if not a.cpu_smoke and not torch.cuda.is_available():
        p.error("no CUDA device here: this check is for a GPU (use --cpu-smoke to check the script on CPU)")
    return a


def full_jobs(a: argparse.Namespace, device: torch.device, work: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    """The full check's chosen sections as callables, in the order asked."""
    size = sizes(a.cpu_smoke)
    steps = a.steps or size["steps"]
    written: dict[int, Path] = {}

    def shards_for(vocab: int) -> Path:
        if vocab not in written:
            written[vocab] = write_shards(work / f"shards-{vocab}", vocab, size["shard_tokens"])
        return written[vocab]

    vocab = 512 if a.cpu_smoke else 128256
    done: dict[tuple, dict[str, Any]] = {}  # training runs by what they ran: fp8, 170m and 1b share their baselines

    def carried_text() -> Path:
        return Path(a.text) if a.text else shards.embedded_shards("byte")

    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        "env": lambda: check_env(device, a.cpu_smoke),
        "attention": lambda: check_attention(device, size["attention"]),
        "ddp": lambda: check_ddp(device, size["ddp_model"]),
        "ranks2": lambda: check_ranks2(size["ranks2"], work, shards_for(vocab), a.timeout),
        "sample": lambda: check_sample(device, size["sample"]),
        "resume": lambda: check_resume(size["resume"], work, shards_for(vocab), a.timeout),
        "tasks": lambda: check_tasks(device, size["tasks"]),
        "fp8": lambda: check_fp8(size["fp8"], size["train"], work, steps, shards_for(vocab),
                                 carried_text(), a.timeout, done),
        "speedrun": lambda: check_speedrun(size["speedrun"], work, steps,
                                           shards_for(vocab if a.cpu_smoke else 50304), carried_text(), a.timeout),
        "170m": lambda: check_train("170m", size["train"]["170m"], a.variants.split(","), work, steps,
                                    shards_for(vocab), a.timeout, done),
        "1b": lambda: check_train("1b", size["train"]["1b"], a.variants.split(","), work, steps,
                                  shards_for(vocab), a.timeout, done),
    }
    return {name: jobs[name] for name in a.sections}


def writer(out_dir: Path, report: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], None]:
    """Writes gpu_check.json and gpu_check.md, each atomically (a kill leaves the last complete one): after every
    section. A report that fails to render is its traceback, and the JSON is still written."""
    def write(results: dict[str, Any]) -> None:
        io.write_text(out_dir / "gpu_check.json", json.dumps(io.clean(results), indent=1, default=str) + "\n")
        try:
            text = report(results)
        except Exception:  # noqa: BLE001 - the JSON holds the figures; the report says why it is missing
            text = "# nanopt GPU check: the report failed to render\n\n```\n" + traceback.format_exc() + "```"
        io.write_text(out_dir / "gpu_check.md", text + "\n")
    return write


def main(argv: Optional[list[str]] = None) -> int:
    started = STARTED if argv is None else time.monotonic()  # in a test's process: from this call
    a = parse(argv)
    device = torch.device("cpu") if a.cpu_smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # as nanopt's runtime sets it for training
    # /dev/shm when it can hold a 1B run's checkpoint (15 GB): a container's is often 64 MB
    shm = Path("/dev/shm")
    roomy = shm.is_dir() and shutil.disk_usage(shm).free > 40 * 2**30
    scratch = shm if roomy and not a.cpu_smoke else None
    work = Path(a.work or tempfile.mkdtemp(prefix="nanopt-gpu-check-", dir=scratch))
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "command": " ".join(["python", "bench/gpu_check.py",
                                                    *(argv if argv is not None else sys.argv[1:])]),
                               "smoke": a.cpu_smoke, "quick": a.quick, "part": a.part, "deadline_s": a.deadline_s,
                               "precision": check_precision(device)}  # what every section computed in
    report = gpu_quick.markdown if a.quick else markdown
    if a.quick:
        why = f"not in --part {a.part}" if a.part else "not in --sections"
        jobs = gpu_quick.jobs(device, a.cpu_smoke, work, a.sections, why)
        budgets = {s: gpu_quick.PLAN[s][2 if a.cpu_smoke else 1] for s in a.sections}  # the others cost nothing
    else:
        jobs, budgets = full_jobs(a, device, work), None
    try:
        run_sections(jobs, results, writer(out_dir, report), budgets, a.deadline_s, started)
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    print((out_dir / "gpu_check.md").read_text())
    print(f"gpu_check: {time.monotonic() - started:.0f} s; {out_dir / 'gpu_check.json'}")
    return 1 if any(section_failed(results[n]) for n in jobs) else 0


if __name__ == "__main__":
    sys.exit(main())
