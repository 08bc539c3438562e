"""Verify nanopt's CUDA path on one GPU and measure it: one command, a Markdown report and a JSON file.

    python bench/gpu_check.py                                   # every section, about 11 minutes on one H100
    python bench/gpu_check.py --sections env,attention,ddp      # some of them
    python bench/gpu_check.py --cpu-smoke                       # the same code at toy size on CPU (a test runs it)

Sections (docs/results.md "GPU: one H100"; issue 16's findings in brackets):
  env        versions, the device, how nanopt names it (SXM/PCIe) and its peak; a measured bf16 matmul
  attention  the SDPA kernel torch picks per dtype at 1B shapes, with and without nanopt's GQA handling
             [5]; nanopt's sdpa and flash-attn (when installed) against a float64 reference
  ddp        DDP (world size 1) gradient memory under no_sync micro-steps, zeroing set to None vs in place [1]
  resume     a short run killed in a step and resumed on this device, against an uninterrupted one
  tasks      downstream scoring speed: a HellaSwag-sized synthetic set (10,042 items x 4 endings, ~100 tokens
             each) scored by nanopt.scoring (lm-eval's `nanopt` model) on the 1B config in bf16; goal < 60 s
  170m, 1b   real `python -m nanopt.main` runs of configs/170m-1gpu.yaml and configs/1b.yaml (1B as one
             rank of eight: global batch 131072 = 4 x 4096 x 8 micro-steps), in each --variants: tokens/s,
             MFU, peak allocated and reserved memory, the profiler's shares and top ops [2, 3, 7]
Training data are synthetic shards written here (random tokens; nothing is downloaded). Each section runs
on its own: one that fails is reported as failed and the rest go on.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from _common import REPO, spec_peak  # importing _common puts REPO on sys.path: nanopt from this checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from nanopt import attention, data, experiments, hardware, rundirs  # noqa: E402
from nanopt.config import ModelConfig, load_config  # noqa: E402
from nanopt.model import build_model  # noqa: E402
from nanopt.runtime import Runtime  # noqa: E402
from nanopt.scoring import continuation_scores  # noqa: E402

SECTIONS = ("env", "attention", "ddp", "resume", "tasks", "170m", "1b")


# ---------------------------------------------------------------- sizes: the real ones and the CPU smoke's


def sizes(smoke: bool) -> dict[str, Any]:
    """Shapes and step counts for each section: the configs' own on a GPU, toys for --cpu-smoke."""
    if not smoke:
        return {
            "attention": dict(B=1, T=4096, Hq=32, Hkv=8, D=64),  # configs/1b.yaml, one sequence
            "ddp_model": dict(config="configs/1b.yaml", micro=(1, 2048), accum=4),
            "train": {
                "170m": ["--config", "configs/170m-1gpu.yaml"],
                "1b": ["--config", "configs/1b.yaml", "--train.global_batch_tokens=131072"],
            },
            "resume": ["--config", "configs/170m-1gpu.yaml", "--model.n_layers=2", "--train.seq_len=1024",
                       "--train.micro_batch_size=4", "--train.global_batch_tokens=8192"],
            "steps": 12, "shard_tokens": 4_000_000,
            "tasks": dict(config="configs/1b.yaml", items=10042, context=70, ending=30, batch=64),
        }
    toy = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
           "--model.ffn_dim=128", "--model.vocab_size=512", "--train.seq_len=64", "--train.micro_batch_size=2",
           "--train.global_batch_tokens=256", "--runtime.threads=1"]
    return {
        "attention": dict(B=1, T=128, Hq=4, Hkv=2, D=16),
        "ddp_model": dict(config=None, micro=(2, 32), accum=4),
        "train": {"170m": ["--config", "configs/170m-1gpu.yaml", *toy],
                  "1b": ["--config", "configs/1b.yaml", *toy]},
        "resume": ["--config", "configs/170m-1gpu.yaml", *toy],
        "steps": 10, "shard_tokens": 40_000,
        "tasks": dict(config=None, items=40, context=20, ending=8, batch=16),
    }


def model_config(path: Optional[str]) -> ModelConfig:
    """The model section of a config file, or a toy Llama (CPU smoke)."""
    if path is None:
        return ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    return load_config(REPO / path, []).model


# ---------------------------------------------------------------- env


def check_env(device: torch.device, smoke: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0], "cuda": torch.version.cuda,
                           "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None}
    for name in ("triton", "flash_attn"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - report why, whatever it is
            out[name] = f"not importable ({type(e).__name__})"
    if device.type != "cuda":
        out["device"] = hardware.cpu_model_name()
        return out
    props = torch.cuda.get_device_properties(device)
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    out.update(device=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
               memory_gib=round(props.total_memory / 2**30, 1))
    rt = Runtime("cuda", device, 0, 0, 1, 1, "bf16")
    out["power_limit_w"] = rt.backend.power_limit_watts()
    out["nanopt_hardware"] = hardware.detect_hardware(props.name, out["power_limit_w"])
    out["spec_peak_bf16_tflops"] = (spec_peak(device, "bf16") or 0) / 1e12 or None
    out["measured_bf16_matmul_tflops"] = round(hardware.measure_matmul_flops(  # 8192^3: big enough to fill an H100
        torch.bfloat16, device, budget_s=2.0, sync=torch.cuda.synchronize, n=8192) / 1e12, 1)
    return out


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
        row["nanopt_kernel"], kernel = attention.choose("sdpa", device.type, "fp32" if dtype == torch.float32 else "bf16")
        row["nanopt_sdpa_rel_err"] = rel_err(kernel(qd, kd, vd).detach(), ref)
        row["nanopt_sdpa_peak_gib"] = peak_gib(device, lambda: kernel(qd, kd, vd).sum().backward())
        if device.type == "cuda" and attention.flash_unavailable_reason("cuda") is None:
            row["flash_attn_rel_err"] = rel_err(attention.flash(qd, kd, vd).detach(), ref)
        out[name] = row
    return out


def peak_gib(device: torch.device, fn: Callable[[], Any]) -> Optional[float]:
    """Peak allocated GiB while fn runs (CUDA), or None (CPU: the run is still checked to complete)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)


# ---------------------------------------------------------------- ddp gradient memory


@contextlib.contextmanager
def process_group(device: torch.device):
    """A world of one (NCCL on CUDA, gloo on CPU) for DDP, torn down afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, device_id=device if device.type == "cuda" else None)
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_ddp(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """Two optimizer-free steps of `accum` micro-steps (no_sync but the last), zeroing the gradients after
    each as torch's default (set_to_none) or in place: the second step's peak memory, and the storages
    holding the gradients after its first micro-step."""
    cfg = model_config(spec["config"])
    (b, t), accum = spec["micro"], spec["accum"]
    out: dict[str, Any] = {"model": spec["config"] or "toy", "params": None, "micro_batch": [b, t], "accum": accum}
    with process_group(device):
        for set_to_none in (True, False):
            torch.manual_seed(0)
            model = build_model(cfg, device)
            out["params"] = model.num_params()
            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                      gradient_as_bucket_view=True, broadcast_buffers=False)
            x = torch.randint(0, cfg.vocab_size, (b, t + 1), device=device)

            storages: set[int] = set()

            def step() -> None:
                storages.clear()
                for i in range(accum):
                    with contextlib.nullcontext() if i == accum - 1 else ddp.no_sync():
                        with torch.autocast(device.type, torch.bfloat16):
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


# ---------------------------------------------------------------- training runs (python -m nanopt.main)


def check_tasks(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """Scoring speed as the harness drives it: items x 4 (context, ending) loglikelihood requests of random ids,
    contexts and endings of varied length around the given means, bf16 autocast; a few requests are re-scored
    one by one, unbatched, to check the batching changed nothing."""
    cfg = model_config(spec["config"])
    model = build_model(cfg, device).eval()
    rt = Runtime(device.type, device, 0, 0, 1, 1, "bf16")
    g = torch.Generator().manual_seed(0)
    requests = []
    for _ in range(spec["items"]):
        context = torch.randint(0, cfg.vocab_size, (spec["context"] + int(torch.randint(-10, 11, (1,), generator=g)),),
                                generator=g).tolist()
        for _ in range(4):
            n = max(1, spec["ending"] + int(torch.randint(-10, 11, (1,), generator=g)))
            requests.append((context, torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()))
    continuation_scores(model, requests[: spec["batch"] * 2], rt, spec["batch"])  # warm-up
    sync(device)
    t0 = time.perf_counter()
    scores = continuation_scores(model, requests, rt, spec["batch"])
    sync(device)
    seconds = time.perf_counter() - t0
    alone = [continuation_scores(model, [r], rt, 1)[0][0] for r in requests[:8]]
    return {"items": spec["items"], "requests": len(requests), "batch": spec["batch"], "seconds": seconds,
            "requests_per_s": len(requests) / seconds, "goal_s": 60,
            "tokens": sum(len(c) + len(e) for c, e in requests),
            "batched_vs_alone_max_abs": max(abs(a - s[0]) for a, s in zip(alone, scores))}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_shards(directory: Path, vocab: int, tokens: int) -> Path:
    """train and val shards of random ids (no tokenizer, no hub): speed and resume do not need language."""
    rng = np.random.default_rng(0)
    for split, n in (("train", tokens), ("val", max(tokens // 20, 20_000))):
        data.write_shard(directory / f"{split}_000000.bin", rng.integers(0, vocab, n), vocab)
    return directory


# Every run: synthetic data, no evaluation, samples or curves; a step per log line for per-step speed.
QUIET = ["--data.tokenizer=byte", "--eval.every=0", "--eval.test_at_end=false", "--eval.batches=2",
         "--sample.num_samples=0", "--log.curves=false", "--log.every=1", "--train.warmup_steps=2"]


def nanopt_run(args: list[str], run_dir: Path, timeout: float, env: Optional[dict] = None) -> dict[str, Any]:
    """python -m nanopt.main ARGS; its exit code, wall time, log tail, and the metrics records it wrote."""
    cmd = [sys.executable, "-m", "nanopt.main", *args, f"--run.dir={run_dir}"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = None, f"timed out after {timeout:.0f} s\n" + (e.stdout or b"").decode(errors="replace")[-3000:]
    records = rundirs.read_metrics(run_dir)
    lines = log.strip().splitlines()
    notable = [ln for ln in lines if any(w in ln for w in ("profile", "WARNING", "Error", "attention", "model:"))]
    return {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "records": records,
            "log_tail": "\n".join(lines[-15:]), "log_notable": notable[-12:], "log_times": _stamps(lines)}


def _stamps(lines: list[str]) -> list[str]:
    """The first and last log lines, and the first step's: where a run's wall time went."""
    steps = [ln for ln in lines if " step " in ln]
    return [ln[:120] for ln in (lines[:1] + steps[:1] + steps[-1:] + lines[-1:])]


def speed_of(records: list[dict[str, Any]], skip: set[int]) -> dict[str, Any]:
    """Medians over the logged steps outside `skip` (warm-up, the profiler's, the trace export's)."""
    steps = [r for r in records if "tokens_per_s" in r and r["step"] not in skip and r.get("mfu") is not None]
    if not steps:
        return {}

    def med(key: str) -> Optional[float]:
        xs = [r[key] for r in steps if r.get(key) is not None]
        return statistics.median(xs) if xs else None

    last = steps[-1]
    return {"steps_timed": [r["step"] for r in steps], "tokens_per_s": med("tokens_per_s"), "mfu": med("mfu"),
            # every logged step's time, the skipped ones too: compilation, the profiler's cost, recompiles
            "step_ms_each": {r["step"]: round(r["step_ms"]) for r in records if "step_ms" in r},
            "step_ms": med("step_ms"), "loss_last": last["loss"],
            "peak_allocated_gib": max((r.get("peak_memory_gib") or 0) for r in records if "loss" in r) or None,
            "peak_reserved_gib": max((r.get("peak_reserved_gib") or 0) for r in records if "loss" in r) or None}


def check_train(name: str, args: list[str], variants: list[str], work: Path, steps: int, shards: Path,
                timeout: float) -> dict[str, Any]:
    """One nanopt run per variant; the profiler records steps wait+2..wait+3, which the speed leaves out."""
    wait = steps - 5  # profiled: step wait+1 (warm-up), wait+2..wait+3 (active); wait+4 pays the trace export
    profile = ["--profile.enabled=true", f"--profile.wait={wait}", "--profile.warmup=1", "--profile.active=2"]
    skip = {1, 2, *range(wait + 1, wait + 5)}
    out: dict[str, Any] = {}
    for variant in variants:
        run_dir = work / f"{name}-{variant}"
        shutil.rmtree(run_dir, ignore_errors=True)
        flags = VARIANTS[variant]
        res = nanopt_run([*args, *QUIET, *profile, *flags, f"--data.source={shards}",
                          f"--train.max_steps={steps}"], run_dir, timeout)
        prof = experiments.read_profile(run_dir) or {}
        out[variant] = {"flags": flags, "rc": res["rc"], "wall_s": res["wall_s"], **speed_of(res["records"], skip),
                        "profile": {k: prof.get(k) for k in ("mode", "host_overhead_share", "data_loader_share",
                                                             "compute_share", "step_ms_mean")},
                        "top_ops": [(o["name"], round(o["self_share"], 3)) for o in prof.get("top_ops", [])[:8]],
                        "log_tail": res["log_tail"] if res["rc"] != 0 else "", "log_notable": res["log_notable"],
                        "log_times": res["log_times"]}
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 15 GB at 1B: not wanted past the run
    return out


# Each variant is a set of overrides on the config as shipped (the GPU configs: compiled, loss unchunked).
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "compiled": ["--train.compile=true"],
    # The documented escape hatch: eager needs the loss in chunks, or it holds whole-batch fp32 logits.
    "eager": ["--train.compile=false", "--train.loss_chunk_tokens=8192"],
    "chunked": ["--train.compile=true", "--train.loss_chunk_tokens=8192"],  # compiled, with the eager loss
    "nochunk": ["--train.compile=true", "--train.loss_chunk_tokens=0"],
}


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
    lines = [f"# nanopt GPU check, {results['date']}", "", f"command: `{results['command']}`", ""]
    env = results.get("env", {})
    if env:
        lines += ["## Environment", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in env.items()] + [""]
    att = results.get("attention")
    if att and "error" not in att:
        lines += [f"## Attention at {att['shape']}", "",
                  "| dtype | SDPA kernel, enable_gqa | SDPA kernel, heads repeated | nanopt's kernel | rel. err | "
                  "fwd+bwd peak GiB | flash-attn rel. err |", "|---|---|---|---|---|---|---|"]
        for dtype in ("bfloat16", "float32"):
            r = att[dtype]
            lines.append(f"| {dtype} | {r['sdpa_kernel_enable_gqa']} | {r['sdpa_kernel_heads_repeated']} | "
                         f"{r['nanopt_kernel']} | {r['nanopt_sdpa_rel_err']:.1e} | {r['nanopt_sdpa_peak_gib']} | "
                         f"{_fmt(r.get('flash_attn_rel_err'), '.1e')} |")
        lines.append("")
    ddp = results.get("ddp")
    if ddp and "error" not in ddp:
        lines += [f"## DDP gradients under no_sync ({ddp['model']}, {ddp['params']:,} parameters, "
                  f"fp32 gradients {ddp['grad_gib']} GiB, {ddp['accum']} micro-steps)", "",
                  "| zero_grad | step peak GiB | gradient storages |", "|---|---|---|"]
        for mode in ("set_to_none", "in_place"):
            lines.append(f"| {mode} | {ddp[mode]['step_peak_gib']} | {ddp[mode]['grad_storages']} |")
        lines.append("")
    res = results.get("resume")
    if res and "error" not in res:
        lines += ["## Kill and resume", "", f"exit codes straight/again/killed/resumed {res['rc']}; steps compared "
                  f"{res['steps_compared']}", "", "| against the straight run | max loss difference | final weights equal |",
                  "|---|---|---|", f"| killed at step 7, resumed from 4 | {res['max_abs_loss_diff']} | {res['weights_equal']} |",
                  f"| the same run again (noise floor) | {res['rerun_max_abs_loss_diff']} | {res['rerun_weights_equal']} |", ""]
    tasks = results.get("tasks")
    if tasks and "error" not in tasks:
        lines += ["## Downstream scoring (HellaSwag-sized, nanopt.scoring)", "",
                  f"{tasks['items']:,} items x 4 = {tasks['requests']:,} requests ({tasks['tokens']:,} tokens), batch "
                  f"{tasks['batch']}: **{tasks['seconds']:.1f} s** ({tasks['requests_per_s']:,.0f} requests/s; goal "
                  f"< {tasks['goal_s']} s); batched vs one-by-one max |Δ| {tasks['batched_vs_alone_max_abs']:.1e}", ""]
    for name in ("170m", "1b"):
        runs = results.get(name)
        if not runs or "error" in runs:
            continue
        lines += [f"## Training {name}", "", "| variant | rc | tokens/s | MFU | step ms | peak alloc GiB | "
                  "peak reserved GiB | compute / host / data | top ops (self share) |", "|---|---|---|---|---|---|---|---|---|"]
        for variant, r in runs.items():
            p = r["profile"]
            shares = "/".join(_fmt(p.get(k), ".0%") for k in ("compute_share", "host_overhead_share", "data_loader_share"))
            ops = ", ".join(f"{n} {s:.0%}" for n, s in r["top_ops"][:5])
            lines.append(f"| {variant} | {r['rc']} | {_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('mfu'), '.1%')} "
                         f"| {_fmt(r.get('step_ms'), '.0f')} | {_fmt(r.get('peak_allocated_gib'), '.1f')} | "
                         f"{_fmt(r.get('peak_reserved_gib'), '.1f')} | {shares} | {ops} |")
        lines.append("")
        lines += [f"{name} {v} failed:\n```\n{r['log_tail']}\n```\n" for v, r in runs.items() if r["rc"] != 0]
    for name, r in results.items():
        if isinstance(r, dict) and "error" in r:
            lines += [f"## {name}: FAILED", "", "```", r["error"], "```", ""]
    return "\n".join(lines)


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--variants", default="", help=f"comma list of {', '.join(VARIANTS)} (default: compiled,eager; "
                   "smoke: eager)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per training run (0: 12; smoke 10)")
    p.add_argument("--cpu-smoke", action="store_true", help="toy sizes on CPU: checks the script, measures nothing")
    p.add_argument("--out", default="runs/gpu_check", help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--work", default="", help="scratch directory for shards and runs (default: /dev/shm or tmp)")
    p.add_argument("--timeout", type=float, default=420, help="seconds allowed per training run")
    a = p.parse_args(argv)
    sections = [s for s in a.sections.split(",") if s]
    a.variants = a.variants or ("eager" if a.cpu_smoke else "compiled,eager")
    unknown = set(sections) - set(SECTIONS) | set(a.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown section or variant {sorted(unknown)}")
    if not a.cpu_smoke and not torch.cuda.is_available():
        p.error("no CUDA device here: this check is for a GPU (use --cpu-smoke to check the script on CPU)")
    device = torch.device("cpu") if a.cpu_smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # as nanopt's runtime sets it for training
    size = sizes(a.cpu_smoke)
    steps = a.steps or size["steps"]
    shm = Path("/dev/shm")
    work = Path(a.work or tempfile.mkdtemp(prefix="nanopt-gpu-check-", dir=shm if shm.is_dir() and not a.cpu_smoke else None))
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "command": " ".join(["python", "bench/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
                               "smoke": a.cpu_smoke}
    shards: dict[int, Path] = {}

    def shards_for(vocab: int) -> Path:
        if vocab not in shards:
            shards[vocab] = write_shards(work / f"shards-{vocab}", vocab, size["shard_tokens"])
        return shards[vocab]

    vocab = 512 if a.cpu_smoke else 128256
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        "env": lambda: check_env(device, a.cpu_smoke),
        "attention": lambda: check_attention(device, size["attention"]),
        "ddp": lambda: check_ddp(device, size["ddp_model"]),
        "resume": lambda: check_resume(size["resume"], work, shards_for(vocab), a.timeout),
        "tasks": lambda: check_tasks(device, size["tasks"]),
        "170m": lambda: check_train("170m", size["train"]["170m"], a.variants.split(","), work, steps,
                                    shards_for(vocab), a.timeout),
        "1b": lambda: check_train("1b", size["train"]["1b"], a.variants.split(","), work, steps,
                                  shards_for(vocab), a.timeout),
    }
    try:
        for name in sections:
            t0 = time.perf_counter()
            print(f"gpu_check: {name} ...", flush=True)
            try:
                results[name] = jobs[name]()
            except Exception:  # noqa: BLE001 - one failed section must not hide the others' results
                results[name] = {"error": traceback.format_exc()[-3000:]}
            print(f"gpu_check: {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
            (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    report = markdown(results)
    (out_dir / "gpu_check.md").write_text(report + "\n")
    print(report)
    failed = [n for n in sections if "error" in results[n]
              or any(isinstance(v, dict) and v.get("rc") not in (0, None) for v in results[n].values())]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
