"""What bench/gpu_check.py's full sections and its --quick sections (bench/gpu_quick.py) share: the environment, a
world of one for nanopt's DDP path, a timed train step, sampling and scoring checks, synthetic shards, real runs of
`python -m nanopt.main` and their speed, running sections so that one failure hides none of the others, and the
report's common parts."""
from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from _common import REPO, free_port, spec_peak  # importing _common puts REPO on sys.path: nanopt from this checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nanopt import rundirs  # noqa: E402
from nanopt.config import load_config, ModelConfig  # noqa: E402
from nanopt.data import shards  # noqa: E402
from nanopt.distributed import hardware, parallel  # noqa: E402
from nanopt.distributed.runtime import Runtime  # noqa: E402
from nanopt.evals.generate import generate  # noqa: E402
from nanopt.evals.scoring import continuation_scores  # noqa: E402
from nanopt.recipe import fp8  # noqa: E402
from nanopt.recipe.model import build_model  # noqa: E402
from nanopt.recipe.optim import build_optimizer  # noqa: E402
from nanopt.training import train  # noqa: E402
from nanopt.training.plan import build_plan  # noqa: E402


def model_config(path: Optional[str]) -> ModelConfig:
    """The model section of a config file, or a toy Llama (CPU smoke)."""
    if path is None:
        return ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    return load_config(REPO / path, []).model


def check_precision(device: torch.device) -> str:
    """What the check computes in (train.precision, autocast), decided here for every section: bf16 where `device`
    computes it natively (the GPUs it is for, AMX and AVX512-BF16 CPUs), else fp32: a CPU smoke checks the script
    and measures nothing, and emulated bf16 is ~85x slower on an AVX2 CPU. The results and reports name it."""
    return "bf16" if Runtime(device.type, device, 0, 0, 1, 1, "bf16").backend.native_bf16 else "fp32"


def check_env(device: torch.device, smoke: bool) -> dict[str, Any]:
    """Versions (torchao and lm-eval included), the device, how nanopt names it, its peak and FP8 support, and a
    measured bf16 matmul."""
    out: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0], "cuda": torch.version.cuda,
                           "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None}
    for name in ("triton", "flash_attn", "torchao", "lm_eval"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - report why, whatever it is
            out[name] = f"not importable ({type(e).__name__})"
    if device.type != "cuda":
        out["device"] = hardware.cpu_model_name()
        out["nanopt_fp8"] = Runtime("cpu", device, 0, 0, 1, 1, "bf16").backend.fp8
        return out
    props = torch.cuda.get_device_properties(device)
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    out.update(device=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
               memory_gib=round(props.total_memory / 2**30, 1))
    rt = Runtime("cuda", device, 0, 0, 1, 1, "bf16")
    out["nanopt_fp8"] = rt.backend.fp8  # how train.fp8 runs here: native, emulated or not at all
    out["power_limit_w"] = rt.backend.power_limit_watts()
    out["nanopt_hardware"] = hardware.detect_hardware(props.name, out["power_limit_w"])
    out["spec_peak_bf16_tflops"] = (spec_peak(device, "bf16") or 0) / 1e12 or None
    out["measured_bf16_matmul_tflops"] = round(hardware.measure_matmul_flops(  # 8192^3: big enough to fill an H100
        torch.bfloat16, device, budget_s=2.0, sync=torch.cuda.synchronize, n=8192) / 1e12, 1)
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


@contextlib.contextmanager
def process_group(device: torch.device):
    """A world of one (NCCL on CUDA, gloo on CPU) for DDP, torn down afterwards."""
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1, device_id=device if device.type == "cuda" else None)
    try:
        yield
    finally:
        dist.destroy_process_group()


class WorldOfOne(Runtime):
    """A rank alone in a real process group. nanopt wraps its model in DDP only when distributed (world > 1):
    claiming to be runs nanopt's own DDP path (train.step_model, train_step's no_sync) at world size 1 on one device."""

    @property
    def distributed(self) -> bool:
        return True


def random_batches(vocab: int, micro: tuple[int, int], accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`accum` micro-batches of (B T inputs, B T targets) of random ids, the same every call (seed 0)."""
    (b, t), g = micro, torch.Generator().manual_seed(0)
    rows = [torch.randint(0, vocab, (b, t + 1), generator=g) for _ in range(accum)]  # B T+1 each
    return [(x[:, :-1], x[:, 1:]) for x in rows]


def time_train_step(cfg: Any, rt: Runtime, batches: list, steps: int) -> dict[str, Any]:
    """tokens/s and ms per step over `steps` optimizer steps after two warm-up steps (compilation), the graphs and
    graph breaks torch.compile made, and the last step's loss."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = build_model(cfg.model, rt.device, loss_chunk_tokens=cfg.train.loss_chunk_tokens)
    converted = fp8.convert(model, cfg, rt)  # train.fp8, as train.Trainer converts: before optimizer, compile, DDP
    parallel.shard(model, cfg, rt)  # runtime.parallel=fsdp/hsdp in a process group, as train.Trainer shards
    optimizer = build_optimizer(model, cfg.train, rt, cfg.optim)  # as train.Trainer builds it
    plan = build_plan(cfg.train, rt.world_size)
    step_model = train.step_model(model, cfg.train, rt, plan)  # as train.Trainer builds it: compiled, then DDP
    step = rt.backend.compile_step(train.train_step, optimizer, shapes=len(plan.stages))
    for _ in range(2):
        step(step_model, optimizer, batches, rt, cfg.train.grad_clip)
    sync(rt.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss, _ = step(step_model, optimizer, batches, rt, cfg.train.grad_clip)
    sync(rt.device)
    seconds = time.perf_counter() - t0
    tokens = steps * sum(x.numel() for x, _ in batches)
    return {"tokens_per_s": tokens / seconds, "step_ms": 1e3 * seconds / steps, "loss": float(loss),
            "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "fp8_linears": converted}


def check_sample(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """Greedy sampling as at the end of a run (fp32 weights, no autocast) of a fresh model (sample_check)."""
    cfg = model_config(spec["config"])
    torch.manual_seed(0)
    model = build_model(cfg, device).eval()
    return {"model": spec["config"] or "toy", **sample_check(model, spec)}


# The cached decode's logits against one full forward, relative to the largest logit: a cache that is wrong (a
# position, a layer) is off by the logits' own size; rounding (TF32 on a GPU, FP8) by far less than 1%.
LOGIT_TOLERANCE = 1e-2


def sample_check(model: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Greedy decoding of `model` with the KV cache and without: tokens/s, and the logits the cache gave each new
    token against one full forward, which judge it. Whether both picked the same tokens is reported, not judged:
    with TF32 on, a near-tie between two logits of a random model may flip."""
    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    prompt = torch.randint(0, model.embed.num_embeddings, (spec["batch"], spec["prompt"]), generator=g).to(device)
    out: dict[str, Any] = {"batch": spec["batch"], "prompt": spec["prompt"], "new_tokens": spec["new"]}
    ids = {}
    for use_cache in (True, False):
        generate(model, prompt[:, :8], 4, temperature=0, use_cache=use_cache)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        ids[use_cache] = generate(model, prompt, spec["new"], temperature=0, use_cache=use_cache)
        sync(device)
        out["cached_tokens_per_s" if use_cache else "uncached_tokens_per_s"] = \
            spec["batch"] * spec["new"] / (time.perf_counter() - t0)
    out["greedy_tokens_equal"] = bool(torch.equal(ids[True], ids[False]))
    out["max_abs_logit_diff"], out["max_abs_logit"] = cache_logit_diff(model, ids[True], spec["prompt"])
    out["logits_agree"] = out["max_abs_logit_diff"] <= LOGIT_TOLERANCE * out["max_abs_logit"]
    return out


@torch.no_grad()
def cache_logit_diff(model: Any, ids: torch.Tensor, prompt_len: int) -> tuple[float, float]:
    """The largest |logit| difference between the cached decode of `ids` (prefill, then one token per forward) and
    one forward over all of them, at the positions that predicted new tokens; and the largest |logit| for scale."""
    caches = model.new_caches(ids.shape[0], ids.shape[1], ids.device, model.embed.weight.dtype)
    steps = [model(ids[:, :prompt_len], caches=caches, start_pos=0)[:, -1]]
    for pos in range(prompt_len, ids.shape[1] - 1):
        steps.append(model(ids[:, pos : pos + 1], caches=caches, start_pos=pos)[:, -1])
    cached = torch.stack(steps, dim=1).float()  # B new V
    full = model(ids)[:, prompt_len - 1 : -1].float()  # B new V
    return float((cached - full).abs().max()), float(full.abs().max())


def check_tasks(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """Scoring speed as the harness drives it: items x 4 (context, ending) loglikelihood requests of random ids,
    contexts and endings of varied length around the given means, bf16 autocast (check_precision); a few requests
    are re-scored one by one, unbatched, to check the batching changed nothing."""
    cfg = model_config(spec["config"])
    model = build_model(cfg, device).eval()
    rt = Runtime(device.type, device, 0, 0, 1, 1, check_precision(device))
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
    return {"items": spec["items"], "requests": len(requests), "batch": spec["batch"], "precision": rt.precision,
            "seconds": seconds, "requests_per_s": len(requests) / seconds, "goal_s": 60,
            "tokens": sum(len(c) + len(e) for c, e in requests),
            "batched_vs_alone_max_abs": max(abs(a - s[0]) for a, s in zip(alone, scores))}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_shards(directory: Path, vocab: int, tokens: int) -> Path:
    """train and val shards of random ids (no tokenizer, no hub): speed and resume do not need language."""
    rng = np.random.default_rng(0)
    for split, n in (("train", tokens), ("val", max(tokens // 20, 20_000))):
        shards.write_shard(directory / f"{split}_000000.bin", rng.integers(0, vocab, n), vocab)
    return directory


# Every run: synthetic data, no evaluation, samples or curves; a step per log line for per-step speed.
QUIET = ["--data.tokenizer=byte", "--eval.every=0", "--eval.test_at_end=false", "--eval.batches=2",
         "--sample.num_samples=0", "--log.curves=false", "--log.every=1", "--train.warmup_steps=2"]


def nanopt_run(args: list[str], run_dir: Path, timeout: float, env: Optional[dict] = None,
               full_log: bool = False) -> dict[str, Any]:
    """python -m nanopt.main ARGS; its exit code, wall time, log tail, and the metrics records it wrote. full_log:
    stderr into stdout, in the order written (torch's logs beside nanopt's step lines), and all of it returned."""
    cmd = [sys.executable, "-m", "nanopt.main", *args, f"--run.dir={run_dir}"]
    # nanopt from this checkout, in front of what the caller's PYTHONPATH holds (a carried torchao, say)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT if full_log else subprocess.PIPE, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env or {})})
        rc, log = proc.returncode, proc.stdout + (proc.stderr or "")
    except subprocess.TimeoutExpired as e:
        rc, log = None, f"timed out after {timeout:.0f} s\n" + (e.stdout or b"").decode(errors="replace")[-3000:]
    records = rundirs.read_metrics(run_dir)
    lines = log.strip().splitlines()
    words = ("profile", "WARNING", "Error", "attention", "model:", "fp8:")
    notable = [ln for ln in lines if any(w in ln for w in words)]
    out = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "records": records,
           "log_tail": "\n".join(lines[-15:]), "log_notable": notable[-12:], "log_times": _stamps(lines)}
    return {**out, "log": lines} if full_log else out


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


# Each variant is a set of overrides on the config as shipped (the GPU configs: compiled, loss unchunked).
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "compiled": ["--train.compile=true"],
    # The documented escape hatch: eager needs the loss in chunks, or it holds whole-batch fp32 logits.
    "eager": ["--train.compile=false", "--train.loss_chunk_tokens=8192"],
    "chunked": ["--train.compile=true", "--train.loss_chunk_tokens=8192"],  # compiled, with the eager loss
    "nochunk": ["--train.compile=true", "--train.loss_chunk_tokens=0"],
    "fp8": ["--train.compile=true", "--train.fp8=tensorwise"],  # torchao's float8 on the block Linears
    "fp8_rowwise": ["--train.compile=true", "--train.fp8=rowwise"],
    "fp8_eager": ["--train.compile=false", "--train.loss_chunk_tokens=8192", "--train.fp8=tensorwise"],
}


def md_env(env: dict[str, Any]) -> list[str]:
    return ["## Environment", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in env.items()]


def md_sample(r: dict[str, Any]) -> list[str]:
    return [f"## Sampling with the KV cache ({r['model']}, fp32, batch {r['batch']}, prompt {r['prompt']}, "
            f"{r['new_tokens']} new tokens, greedy)", "",
            f"**{r['cached_tokens_per_s']:,.0f} tokens/s** with the cache, {r['uncached_tokens_per_s']:,.0f} without; "
            f"cached vs full-forward logits max |Δ| {r['max_abs_logit_diff']:.1e} (max |logit| "
            f"{r['max_abs_logit']:.1f}): agree **{r['logits_agree']}**; same greedy tokens (not judged: near-ties "
            f"flip under TF32) {r['greedy_tokens_equal']}"]


def md_tasks(tasks: dict[str, Any]) -> list[str]:
    return [f"## Downstream scoring (HellaSwag-sized, nanopt.evals.scoring, {tasks['precision']})", "",
            f"{tasks['items']:,} items x 4 = {tasks['requests']:,} requests ({tasks['tokens']:,} tokens), batch "
            f"{tasks['batch']}: **{tasks['seconds']:.1f} s** ({tasks['requests_per_s']:,.0f} requests/s; goal "
            f"< {tasks['goal_s']} s); batched vs one-by-one max |Δ| {tasks['batched_vs_alone_max_abs']:.1e}"]


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def section_failed(result: Any) -> bool:
    """Whether a section raised, or a run in it exited non-zero or timed out (rc None). A list of exit codes is
    the section's own to judge (resume's holds a kill on purpose)."""
    if not isinstance(result, dict):
        return False
    if "error" in result or ("rc" in result and not isinstance(result["rc"], list) and result["rc"] != 0):
        return True
    return any(section_failed(v) for v in result.values())


def run_sections(jobs: dict[str, Callable[[], dict[str, Any]]], results: dict[str, Any],
                 write: Callable[[dict[str, Any]], None], budgets: Optional[dict[str, float]] = None,
                 deadline_s: Optional[float] = None, started: float = 0.0) -> None:
    """Each job in order, on its own: one that raises is recorded with its traceback and the rest go on. With a
    deadline (seconds since `started`, a time.monotonic() reading), a job whose budget would carry the check past
    it is not started but recorded as skipped for the `deadline`. `write(results)` after every job, so a command
    stopped at its time limit still leaves every finished section's result."""
    for name, job in jobs.items():
        t0, budget = time.monotonic(), (budgets or {}).get(name, 0)
        if budget and deadline_s is not None and t0 - started + budget > deadline_s:
            results[name] = {"skipped": "deadline", "budget_s": budget, "at_s": round(t0 - started, 1),
                             "deadline_s": deadline_s}
            print(f"gpu_check: {name} skipped: its {budget} s from {t0 - started:.0f} s pass the deadline", flush=True)
        else:
            print(f"gpu_check: {name} ...", flush=True)
            try:
                results[name] = job()
            except Exception:  # noqa: BLE001 - one failed section must not hide the others' results
                results[name] = {"error": traceback.format_exc()[-3000:]}
            results.setdefault("section_seconds", {})[name] = round(time.monotonic() - t0, 1)
            print(f"gpu_check: {name} done in {time.monotonic() - t0:.0f} s", flush=True)
        write(results)
