"""`python bench/gpu_check.py --quick`: every GPU path nanopt has that never ran on a GPU, each at the smallest size
that still exercises it, in two calls of at most 5 minutes each (`--part 1`, `--part 2`) on the lent H200 (a rental is
15 minutes, its start included, at most 10 of them for one command). Offline: synthetic data, torchao and lm-eval
from carried wheels; a section that cannot run says why and the rest go on. `--quick --cpu-smoke` runs the same
sections at toy size on CPU (the test suite does), in fp32 where the CPU would emulate bf16 (_gpu.check_precision:
the fp8 section's baseline line is then `fp32`), as its report says.

Sections, in the order they run: by what they decide, most first (PLAN below: each one's part and budget).
  env         versions (torch, CUDA, cuDNN, NCCL, torchao, lm-eval), the device, its peak and FP8 support
  fp8         the headline, measured against itself: bf16, then FP8 tensorwise and rowwise, at the 1B config's width
              (4 of its blocks, its vocabulary, seq_len and micro-batch), compiled, in this process, from the same
              initial weights on the same batches: step ms of each, FP8's speed-up, the loss gap after the same
              steps (goals: tensorwise >= 1.15x bf16, within 0.01 nats). The shipped H100 row is shown as a
              reference only: other code, 16 blocks, another device
  fp8_ddp     rowwise FP8 + compile + nanopt's own DDP wrapper at world size 1, split at DDP's buckets and as one
              graph (train.compile_ddp_split's default under FP8), against the model unwrapped: graphs, graph
              breaks, loss difference; each line on its own
  speedrun    configs/speedrun-gpu.yaml with bos_bestfit packing, a batch ramp and a seq_len change and return
              (2048 -> 1024 -> 2048): recompiles and tokens/s per stage (goals: the last stage within 5% of the
              first's tokens/s; no recompile at a batch stage or at the return to a length already compiled)
  muon        BatchedMuon against torch.optim.Muon on speedrun-gpu's and 1B's matrices: the whole step, and per
              shape batched against one at a time, which gives this device's cut-off (goal: <= 0.5x torch's time
              on speedrun-gpu's matrices)
  tasks       HellaSwag-sized scoring at 1B in bf16: 10,042 items x 4 endings (goal < 60 s)
  fsdp        nanopt's FSDP2 path (runtime.parallel=fsdp) at world size 1 against its DDP path at world size 1, both
              compiled (fsdp per block, ddp the whole model), configs/170m-1gpu.yaml with the loss in chunks:
              tokens/s of each, fsdp's graphs and graph breaks, and the loss after the same steps (goal: FSDP >=
              0.95x DDP's tokens/s); each line on its own
  decode_fp8  KV-cache greedy decoding of an FP8-converted model (tensorwise and rowwise): tokens/s, cached logits
              against one full forward
  sample      the same for the 1B model in fp32 (TF32 on), judged by the logits, not by greedy tokens
  harness     lm-eval's `nanopt` model on this device against nanopt.evals.scoring (lm-eval from a carried wheel)
"""
from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from _gpu import (LOGIT_TOLERANCE, QUIET, REPO, WorldOfOne, _fmt, check_env, check_precision, check_sample,
                  check_tasks, md_env, nanopt_run, process_group, random_batches, sample_check, sync, time_train_step)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from nanopt.config import Config, load_config, parse_overrides  # noqa: E402
from nanopt.data import shards  # noqa: E402
from nanopt.data.tokenizer import get_tokenizer  # noqa: E402
from nanopt.distributed.runtime import Runtime  # noqa: E402
from nanopt.evals.scoring import continuation_scores  # noqa: E402
from nanopt.evals.tasks import lm_class  # noqa: E402
from nanopt.recipe import fp8  # noqa: E402
from nanopt.recipe.mfu import meta_model  # noqa: E402
from nanopt.recipe.model import build_model  # noqa: E402
from nanopt.recipe.optim import BatchedMuon  # noqa: E402
from nanopt.training import train  # noqa: E402
from nanopt.training.plan import build_plan  # noqa: E402

# Each section's part (0: both parts) and budget in seconds: on the H200, from the H100's compile times (35-44 s for
# a 12- or 16-block model, ~10 s of it fixed; docs/results.md) plus its steps; as --cpu-smoke, its time measured on
# 2 AMD EPYC cores (OMP_NUM_THREADS=1) with room to spare. --deadline-s starts no section whose budget would carry
# the check past the deadline. On the H200 part 1 adds up to 265 s, part 2 to 255 s, and the imports take ~10 s.
PLAN: dict[str, tuple[int, float, float]] = {  # section: (part, H200 budget s, CPU smoke budget s)
    "env": (0, 15, 3),
    "fp8": (1, 100, 6),  # three compiles of 4 blocks at 1B's width
    "fp8_ddp": (1, 50, 4),  # three compiles of 2 blocks at speedrun-gpu's width
    "speedrun": (1, 100, 150),  # a process: two static 12-block compiles, 13 steps (the smoke compiles too)
    "muon": (2, 30, 3),
    "tasks": (2, 75, 3),  # 40,168 requests at 1B: its goal is under 60 s
    "fsdp": (2, 80, 3),  # a 12-block compile (ddp) and a one-block one (fsdp compiles per block), 170m
    "decode_fp8": (2, 20, 4),
    "sample": (2, 20, 2),
    "harness": (2, 15, 3),
}
QUICK_SECTIONS = tuple(PLAN)
SHIPPED = REPO / "bench" / "results" / "gpu_check_h100_shipped.json"  # fp8's reference row, never its baseline
TOY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=128",
       "--model.vocab_size=512", "--train.seq_len=64", "--train.micro_batch_size=2", "--train.global_batch_tokens=256",
       "--runtime.threads=1"]
TWO_LAYERS = ["--config", "configs/speedrun-gpu.yaml", "--model.n_layers=2"]
# The speedrun's stages (steps): its batch ramp compressed, a seq_len change at step 7 and a return at step 10.
SPEEDRUN_STEPS = 13
MUON_MARGIN = 1.05  # batching loses at a shape only when slower than one at a time by more than timing noise


def sizes(smoke: bool) -> dict[str, Any]:
    """Each section's shapes: the smallest that exercise the GPU path, or toys for --cpu-smoke (in its
    check_precision: fp32 where this CPU would emulate bf16)."""
    if not smoke:
        return {
            # 4 blocks: their FP8 share of the FLOPs is below the 16-block model's (the LM head stays in bf16), so
            # the speed-up measured here is the lower one; fp8_flops_share says by how much.
            "fp8": dict(args=["--config", "configs/1b.yaml", "--model.n_layers=4", "--train.compile=true"],
                        micro=(4, 4096), accum=1, steps=10),
            "muon": dict(configs={"speedrun-gpu": ["--config", "configs/speedrun-gpu.yaml"],
                                  "1b": ["--config", "configs/1b.yaml"]}, repeats=10),
            "decode": dict(args=TWO_LAYERS, batch=4, prompt=64, new=32),
            "sample": dict(config="configs/1b.yaml", batch=4, prompt=128, new=64),
            "harness": dict(args=TWO_LAYERS, requests=64),
            "tasks": dict(config="configs/1b.yaml", items=10042, context=70, ending=30, batch=64),
            "fp8_ddp": dict(args=[*TWO_LAYERS, "--train.seq_len=1024", "--train.micro_batch_size=4",
                                  "--train.global_batch_tokens=8192", "--train.compile=true"], micro=(4, 1024),
                            accum=2, steps=3),
            # Compiled, as the config sets. The loss in chunks: under fsdp only the blocks are compiled, and the
            # eager loss needs the chunks for memory (the whole-model compile fuses it; ddp chunks too, to compare).
            "fsdp": dict(args=["--config", "configs/170m-1gpu.yaml", "--train.loss_chunk_tokens=8192"],
                         micro=(8, 2048), accum=2, steps=5),
            "speedrun": dict(args=["--config", "configs/speedrun-gpu.yaml", "--data.packing=bos_bestfit",
                                   "--train.batch_schedule=0:262144,4:393216,10:524288",
                                   "--train.seq_len_schedule=0:2048,7:1024,10:2048"], vocab=50304, tokens=12_000_000,
                             doc_tokens=(200, 4000)),
            "timeout": 300,
        }
    toy = [*TOY, f"--train.precision={check_precision(torch.device('cpu'))}"]
    toy_two = ["--config", "configs/speedrun-gpu.yaml", *toy]
    return {
        # Eager on CPU (compiled it is the GPU's question); every block Linear, since a toy's are below the filter.
        "fp8": dict(args=["--config", "configs/1b.yaml", *toy, "--train.compile=false", "--train.fp8_filter=all"],
                    micro=(2, 64), accum=1, steps=4),
        "muon": dict(configs={"toy": toy_two}, repeats=3),
        "decode": dict(args=toy_two, batch=2, prompt=8, new=8),
        "sample": dict(config=None, batch=2, prompt=8, new=8),
        "harness": dict(args=[*toy_two, "--model.vocab_size=257"], requests=8),
        "tasks": dict(config=None, items=20, context=20, ending=8, batch=16),
        "fp8_ddp": dict(args=[*toy_two, "--train.compile=false"], micro=(2, 32), accum=2, steps=2),
        # Eager on CPU: two more inductor compiles would add tens of seconds to the suite, and fsdp's per-block
        # compile is tested on 2 gloo ranks (tests/e2e/test_ddp.py).
        "fsdp": dict(args=["--config", "configs/170m-1gpu.yaml", *toy, "--train.compile=false"], micro=(2, 32),
                     accum=2, steps=1),
        # One layer: the stages' shapes and recompiles are the check, and a second layer adds ~1 s to its two compiles.
        "speedrun": dict(args=["--config", "configs/speedrun-gpu.yaml", *toy, "--model.n_layers=1",
                               "--data.packing=bos_bestfit",
                               "--train.batch_schedule=0:256,4:384,10:512",
                               "--train.seq_len_schedule=0:64,7:32,10:64"], vocab=512, tokens=60_000,
                         doc_tokens=(10, 100)),
        "timeout": 240,
    }


def jobs(device: torch.device, smoke: bool, work: Path, sections: list[str], why_not: str) -> dict[str, Callable]:
    """Every quick section in PLAN order as a callable for _gpu.run_sections: the chosen ones run, each other one
    returns its skip, `why_not` (the report names every section)."""
    size = sizes(smoke)
    every: dict[str, Callable[[], dict[str, Any]]] = {
        "env": lambda: check_env(device, smoke),
        "fp8": lambda: check_fp8(device, size["fp8"]),
        "fp8_ddp": lambda: check_fp8_ddp(device, size["fp8_ddp"]),
        "speedrun": lambda: check_speedrun_stages(size["speedrun"], work, size["timeout"]),
        "muon": lambda: check_muon(device, size["muon"]),
        "tasks": lambda: tasks_section(device, size["tasks"]),
        "fsdp": lambda: check_fsdp(device, size["fsdp"]),
        "decode_fp8": lambda: check_decode_fp8(device, size["decode"]),
        "sample": lambda: {**check_sample(device, size["sample"]), "precision": "fp32 (TF32 matmuls on a GPU)"},
        "harness": lambda: check_harness(device, size["harness"]),
    }
    return {name: every[name] if name in sections else (lambda: {"skipped": why_not}) for name in QUICK_SECTIONS}


def each_line(device: torch.device, out: dict[str, Any], lines: dict[str, Callable[[], dict]]) -> dict[str, Any]:
    """A section's lines (runs it compares), each on its own: one that raises is recorded with its error and the
    others still run."""
    for name, line in lines.items():
        try:
            out[name] = line()
        except Exception:  # noqa: BLE001 - the failure is the finding; the other lines still run
            out[name] = {"error": traceback.format_exc()[-2000:]}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def config(args: list[str]) -> Config:
    """A config from command-line style arguments (`--config FILE` first)."""
    return load_config(REPO / args[1], parse_overrides(args[2:]))


def skip_reason(module: str, what: str) -> Optional[str]:
    """Why a section cannot run here (a package it needs is absent), printed, or None."""
    if importlib.util.find_spec(module) is not None:
        return None
    reason = f"{module} is not importable: {what}"
    print(f"gpu_check: skipped: {reason}", flush=True)
    return reason


CARRY = "carry its wheel (docs/development.md, 'When a GPU is available')"


# ---------------------------------------------------------------- muon


def check_muon(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """BatchedMuon (every shape batched) against torch's Muon on each config's hidden matrices, then per shape
    batched against one at a time, and the cut-off this device wants (runtime's muon_batch_max_numel)."""
    out: dict[str, Any] = {}
    per_shape: dict[tuple[int, int], dict[str, float]] = {}
    for name, args in spec["configs"].items():
        m = config(args).model
        shapes = [tuple(lin.weight.shape) for lin in meta_model(m).layers.modules() if isinstance(lin, torch.nn.Linear)]
        whole = time_muon(shapes, device, spec["repeats"], {"torch": None, "batched": None})
        out[name] = {"matrices": len(shapes), **whole, "batched_over_torch": whole["batched_ms"] / whole["torch_ms"]}
        for shape in sorted(set(shapes)):
            same = [s for s in shapes if s == shape]
            t = time_muon(same, device, spec["repeats"], {"alone": 0, "batched": None})
            per_shape[shape] = {"count": len(same), "numel": shape[0] * shape[1], **t,
                                "batched_over_alone": t["batched_ms"] / t["alone_ms"]}
    out["per_shape"] = {f"{a}x{b}": r for (a, b), r in sorted(per_shape.items(), key=lambda kv: kv[1]["numel"])}
    out["cut_off"] = cut_off(list(per_shape.values()))
    first = next(iter(spec["configs"]))
    out["goal"] = goal(out[first]["batched_over_torch"], "<=", 0.5, f"BatchedMuon / torch Muon time on {first}")
    return out


def time_muon(shapes: list[tuple[int, int]], device: torch.device, repeats: int,
              variants: dict[str, Optional[int]]) -> dict[str, float]:
    """Median ms per optimizer step of each variant (torch's Muon for "torch", else BatchedMuon with that cut-off),
    stepping the same random gradients, alternating after a warm-up step. The matrices come from the device's own
    generator: 1B's are 4 G numbers, ~20 s on one host thread."""
    g = torch.Generator(device).manual_seed(0)
    start = [torch.randn(s, device=device, generator=g) for s in shapes]
    grads = [torch.randn(s, device=device, generator=g) for s in shapes]
    kw = dict(lr=0.01, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    steps: dict[str, Callable[[], Any]] = {}
    for name, limit in variants.items():
        params = [p.clone().requires_grad_() for p in start]
        for p, grad in zip(params, grads):
            p.grad = grad
        opt = (torch.optim.Muon(params, **kw) if name == "torch" else  # bf16 Newton-Schulz, as torch's Muon's
               BatchedMuon(params, **kw, batch_max_numel=limit, ns_dtype=torch.bfloat16))
        opt.step()  # warm-up: momentum buffers, kernels
        steps[name] = opt.step
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {f"{name}_ms": statistics.median(ts) for name, ts in times.items()}


def cut_off(rows: list[dict[str, float]]) -> dict[str, Any]:
    """The largest matrix size up to which batching never lost, by more than MUON_MARGIN (None: it won or tied at
    every size measured)."""
    rows = sorted(rows, key=lambda r: r["numel"])
    losing = [r["numel"] for r in rows if r["batched_over_alone"] > MUON_MARGIN]
    if not losing:
        return {"muon_batch_max_numel": None, "why": f"batched was within {MUON_MARGIN}x or faster at every shape"}
    below = [r["numel"] for r in rows if r["numel"] < losing[0]]
    return {"muon_batch_max_numel": below[-1] if below else 0,
            "why": f"batched was over {MUON_MARGIN}x slower from {losing[0]:,} elements"}


def goal(value: Optional[float], op: str, target: float, what: str) -> dict[str, Any]:
    """One of the issue's goals: the figure, the bound and whether it was met (None: not measured)."""
    met = None if value is None else (value <= target if op == "<=" else value >= target)
    return {"what": what, "value": value, "goal": f"{op} {target}", "met": met}


# ---------------------------------------------------------------- decoding and the harness model


def check_decode_fp8(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """An FP8-converted model (every block Linear, fp32 weights as at the end of a run) decoding greedily with the
    KV cache, per recipe: the cached logits against one full forward, judged against FP8's own rounding (the full
    forward's logits in FP8 against the same weights unconverted): tensorwise scales by the whole input's largest
    value, so a one-token step rounds otherwise than the full forward, and only a wrong cache exceeds twice that."""
    if reason := skip_reason("torchao", CARRY):
        return {"skipped": reason}
    cfg = config([*spec["args"], "--train.fp8_filter=all"])
    rt = Runtime(device.type, device, 0, 0, 1, 1, cfg.train.precision)
    out: dict[str, Any] = {}
    for recipe in ("tensorwise", "rowwise"):
        cfg.train.fp8 = recipe
        torch.manual_seed(0)
        model = build_model(cfg.model, device).eval()
        plain = copy.deepcopy(model)
        row = {"fp8_linears": fp8.convert(model, cfg, rt), **sample_check(model, spec)}
        row["fp8_vs_plain_max_abs"] = fp8_rounding(model, plain, spec)
        bound = max(LOGIT_TOLERANCE * row["max_abs_logit"], 2 * row["fp8_vs_plain_max_abs"])
        row["logits_agree"] = row["max_abs_logit_diff"] <= bound
        out[recipe] = row
    return out


@torch.no_grad()
def fp8_rounding(model: torch.nn.Module, plain: torch.nn.Module, spec: dict[str, Any]) -> float:
    """The largest |logit| difference, over one full forward of a random prompt, between the FP8 model and the same
    weights unconverted: how far FP8's rounding alone moves the logits."""
    g = torch.Generator().manual_seed(1)
    device = next(model.parameters()).device
    ids = torch.randint(0, model.embed.num_embeddings, (spec["batch"], spec["prompt"]), generator=g).to(device)
    return float((model(ids).float() - plain(ids).float()).abs().max())


def check_harness(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's `nanopt` model built from a live model on this device (as training's task scorer builds it): its
    loglikelihoods against nanopt.evals.scoring one request at a time, and one greedy generate_until."""
    if reason := skip_reason("lm_eval", f"the harness model needs lm-eval: {CARRY}"):
        return {"skipped": reason}
    from lm_eval.api.instance import Instance

    torch.manual_seed(0)
    cfg = config([*spec["args"], "--model.vocab_size=257"])
    model = build_model(cfg.model, device).eval()
    rt = Runtime(device.type, device, 0, 0, 1, 1, cfg.train.precision)
    lm = lm_class()(model=model, tokenizer="byte", rt=rt, batch_size=16)
    rng = np.random.default_rng(0)
    words = ["the", "a", "model", "trains", "fast", "on", "one", "GPU", "and", "loss", "falls"]
    pairs = [(" ".join(rng.choice(words, 12)), " " + " ".join(rng.choice(words, 3))) for _ in range(spec["requests"])]
    t0 = time.perf_counter()
    got = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i)
                            for i, p in enumerate(pairs)])
    seconds = time.perf_counter() - t0
    tok = get_tokenizer("byte")
    alone = [continuation_scores(model, [([tok.bos_id] + tok.encode(c), tok.encode(x))], rt, 1)[0][0]
             for c, x in pairs[:8]]
    text, = lm.generate_until([Instance(request_type="generate_until", doc={}, idx=0,
                                        arguments=(pairs[0][0], {"until": [], "max_gen_toks": 8}))])
    return {"requests": len(pairs), "seconds": seconds, "generated_chars": len(text),
            "harness_vs_scoring_max_abs": max(abs(a - s) for a, (s, _) in zip(alone, got))}


def tasks_section(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """_gpu.check_tasks with its goal (meant for 10,042 x 4 requests at 1B on one H100)."""
    out = check_tasks(device, spec)
    out["goal"] = goal(out["seconds"], "<=", out["goal_s"], f"seconds for {out['requests']:,} requests")
    return out


# ---------------------------------------------------------------- FP8 under nanopt's DDP path


def check_fp8_ddp(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """Rowwise FP8 (every block Linear) compiled, through train.step_model at world 1 in a real process group: under
    DDP split at its buckets (optimize_ddp, pytorch/pytorch#158936 reports it failing), under DDP as one graph
    (train.compile_ddp_split's default when train.fp8 is on), and unwrapped; each line on its own. Graphs, graph
    breaks, and each DDP line's loss against the unwrapped one after the same steps."""
    if reason := skip_reason("torchao", CARRY):
        return {"skipped": reason}
    (b, t), accum = spec["micro"], spec["accum"]
    fp8_args = [*spec["args"], "--train.fp8=rowwise", "--train.fp8_filter=all"]
    batches = random_batches(config(fp8_args).model.vocab_size, (b, t), accum)
    out: dict[str, Any] = {"micro_batch": [b, t], "accum": accum,
                           "default_splits": train.ddp_split(config(fp8_args).train)}

    def line(runtime: type, split: str) -> Callable[[], dict[str, Any]]:
        cfg = config([*fp8_args, f"--train.compile_ddp_split={split}"])
        rt = runtime(device.type, device, 0, 0, 1, 1, cfg.train.precision)
        return lambda: time_train_step(cfg, rt, batches, spec["steps"])

    with process_group(device):
        each_line(device, out, {"ddp_split": line(WorldOfOne, "true"), "ddp_one_graph": line(WorldOfOne, "false"),
                                "unwrapped": line(Runtime, "null")})
    base = out["unwrapped"].get("loss")
    out["works_with"] = [k for k in ("ddp_split", "ddp_one_graph") if "error" not in out[k]]
    out["loss_diff"] = {k: abs(out[k]["loss"] - base) for k in out["works_with"] if base is not None}
    return out


# ---------------------------------------------------------------- FSDP at world size 1


def check_fsdp(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """nanopt's FSDP path at world size 1 (fully_shard on a one-rank mesh, so each all-gather and reduce-scatter is
    a copy: what is left is FSDP's own overhead) against its DDP path at world size 1, in one process group, on the
    same batches from the same weights, each line on its own: tokens/s of each, their ratio, and the loss
    difference after the same steps (0 up to the reduction's rounding: fp32 gradients either way)."""
    (b, t), accum = spec["micro"], spec["accum"]
    out: dict[str, Any] = {"micro_batch": [b, t], "accum": accum}

    def line(parallel: str) -> Callable[[], dict[str, Any]]:
        cfg = config([*spec["args"], f"--runtime.parallel={parallel}"])
        rt = WorldOfOne(device.type, device, 0, 0, 1, 1, cfg.train.precision)
        return lambda: time_train_step(cfg, rt, random_batches(cfg.model.vocab_size, (b, t), accum), spec["steps"])

    with process_group(device):
        each_line(device, out, {"ddp": line("ddp"), "fsdp": line("fsdp")})
    ratio = None
    if "error" not in out["ddp"] and "error" not in out["fsdp"]:
        ratio = out["fsdp_over_ddp"] = out["fsdp"]["tokens_per_s"] / out["ddp"]["tokens_per_s"]
        out["loss_diff"] = abs(out["fsdp"]["loss"] - out["ddp"]["loss"])
    how = "compiled" if config(spec["args"]).train.compile else "eager"
    out["goal"] = goal(ratio, ">=", 0.95, f"FSDP / DDP tokens/s at world size 1 ({how})")
    return out


# ---------------------------------------------------------------- the speedrun recipe's stages


def write_documents(directory: Path, vocab: int, tokens: int, bos: int, lengths: tuple[int, int]) -> Path:
    """train and val shards of random ids cut into documents (each starts with BOS, `lengths` tokens long), so
    that bos_bestfit packing has documents to fit: speed and shapes do not need language."""
    rng = np.random.default_rng(0)
    for split, n in (("train", tokens), ("val", max(tokens // 20, 40_000))):
        ids = rng.integers(0, vocab - 1, n)
        ids[ids >= bos] += 1  # no BOS inside a document
        starts = np.cumsum(rng.integers(*lengths, n // lengths[0]))
        ids[np.concatenate([[0], starts[starts < n]])] = bos
        shards.write_shard(directory / f"{split}_000000.bin", ids, vocab)
    return directory


def check_speedrun_stages(spec: dict[str, Any], work: Path, timeout: float) -> dict[str, Any]:
    """A real run of the recipe through its stages, dynamo's recompiles logged (TORCH_LOGS=recompiles) in order
    with the step lines: per stage, its shape, recompiles, first step's time and median tokens/s after it."""
    data = write_documents(work / "documents", spec["vocab"], spec["tokens"], get_tokenizer("byte").bos_id,
                           spec["doc_tokens"])
    run_dir = work / "speedrun-stages"
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [*spec["args"], *QUIET, f"--data.source={data}", f"--train.max_steps={SPEEDRUN_STEPS}",
            "--checkpoint.every=0"]
    res = nanopt_run(args, run_dir, timeout, env={"TORCH_LOGS": "recompiles"}, full_log=True)
    plan = build_plan(config([*spec["args"], f"--train.max_steps={SPEEDRUN_STEPS}"]).train, 1)
    stages = stage_table(res["log"], res["records"], [(s.first_step, s.batch_tokens, s.seq_len) for s in plan.stages])
    out: dict[str, Any] = {"rc": res["rc"], "wall_s": res["wall_s"], "stages": stages,
                           "log_tail": res["log_tail"] if res["rc"] != 0 else "",
                           "packing_cropped_share": next((r.get("cropped_share") for r in reversed(res["records"])
                                                          if "cropped_share" in r), None)}
    first, last = stages[0]["tokens_per_s"], stages[-1]["tokens_per_s"]
    out["goals"] = [goal(last / first if first and last else None, ">=", 0.95,
                         "last stage's tokens/s over the first's (same seq_len, 2x the batch)"),
                    goal(sum(s["recompiles"] for s in stages if not s["new_shape"]), "<=", 0,
                         "recompiles at stages that bring no new seq_len")]
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def stage_table(log: list[str], records: list[dict[str, Any]], stages: list[tuple[int, int, int]]) -> list[dict]:
    """Per stage (start step, batch tokens, seq_len): recompiles logged while it ran (a recompile is logged before
    the step that pays it, after the stage's own log line), its first step's ms, the median tokens/s after it."""
    recompiles = [0] * len(stages)
    current = 0
    for line in log:
        if m := re.search(r"stage (\d+) from step", line):
            current = int(m.group(1)) - 1
        elif "Recompiling function" in line:
            recompiles[current] += 1
    seen: set[int] = set()
    table = []
    for i, (start, batch, seq_len) in enumerate(stages):
        end = stages[i + 1][0] if i + 1 < len(stages) else SPEEDRUN_STEPS
        mine = [r for r in records if "tokens_per_s" in r and start < r["step"] <= end]
        timed = [r["tokens_per_s"] for r in mine if r["step"] > max(start + 1, 1)]
        table.append({"start": start, "batch_tokens": batch, "seq_len": seq_len, "new_shape": seq_len not in seen,
                      "recompiles": recompiles[i], "first_step_ms": mine[0]["step_ms"] if mine else None,
                      "tokens_per_s": statistics.median(timed) if timed else None, "steps_timed": len(timed)})
        seen.add(seq_len)
    return table


# ---------------------------------------------------------------- the headline: FP8 against bf16, same device


def check_fp8(device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """bf16, then FP8 tensorwise and rowwise (train.fp8, its auto filter on a GPU), each through nanopt's own step
    (time_train_step: the model seeded the same, converted, train.step_model) on the same batches, each line on
    its own: step ms, FP8's speed-up over bf16 (bf16 ms / FP8 ms) and the loss gap after the same steps, beside the
    share of this model's FLOPs FP8 covers (the LM head stays in bf16). The shipped H100 row is a reference only."""
    if reason := skip_reason("torchao", CARRY):
        return {"skipped": reason}
    (b, t), accum = spec["micro"], spec["accum"]
    base_name = config(spec["args"]).train.precision  # bf16; a CPU smoke's fp32 where bf16 is emulated
    cfgs = {name: config([*spec["args"], f"--train.fp8={recipe}"])
            for name, recipe in ((base_name, "none"), ("tensorwise", "tensorwise"), ("rowwise", "rowwise"))}
    batches = random_batches(cfgs[base_name].model.vocab_size, (b, t), accum)
    rt = Runtime(device.type, device, 0, 0, 1, 1, base_name)
    out: dict[str, Any] = {"args": spec["args"], "micro_batch": [b, t], "accum": accum, "steps": spec["steps"],
                           "precision": base_name}
    each_line(device, out, {name: (lambda c=c: time_train_step(c, rt, batches, spec["steps"]))
                            for name, c in cfgs.items()})
    base = out[base_name]
    for name in ("tensorwise", "rowwise"):
        r, c = out[name], cfgs[name]
        r["fp8_flops_share"] = fp8.flops_share(meta_model(c.model), c.train, t, c.mfu.causal_halving)
        if "error" not in r and "error" not in base:
            r["speedup"], r["loss_gap"] = base["step_ms"] / r["step_ms"], abs(r["loss"] - base["loss"])
    ref = json.loads(SHIPPED.read_text())["1b"]["default"]
    out["reference"] = {"what": "not a baseline: configs/1b.yaml whole (16 blocks), bf16, on one H100 SXM, "
                        "2026-11-23, older code", "source": str(SHIPPED.relative_to(REPO)),
                        **{k: ref.get(k) for k in ("step_ms", "tokens_per_s", "mfu")}}
    tw = out["tensorwise"]
    out["goals"] = [goal(tw.get("speedup"), ">=", 1.15,
                         f"{base_name} / FP8 tensorwise step ms, {spec['args'][1]} width"),
                    goal(tw.get("loss_gap"), "<=", 0.01,
                         f"|FP8 tensorwise - {base_name}| loss after {spec['steps'] + 2} steps (nats)")]
    return out


# ---------------------------------------------------------------- report


def markdown(results: dict[str, Any]) -> str:
    """Every section, run or skipped and why, then the goals' verdicts (the device call's reply shows the end of the
    output)."""
    lines = [f"# nanopt quick GPU check, {results['date']}", "", f"command: `{results['command']}`", ""]
    if results.get("smoke"):
        lines += [f"CPU smoke in {results.get('precision', 'bf16')}: toy sizes that check the code paths; its "
                  "figures and goals mean nothing.", ""]
    if isinstance(results.get("env"), dict) and "skipped" not in results["env"] and "error" not in results["env"]:
        lines += md_env(results["env"]) + [""]
    lines += ["## Sections", "", "| section | part | budget s | seconds | result |", "|---|---|---|---|---|"]
    for name in QUICK_SECTIONS:
        if name in results:
            part, *budget = PLAN[name]
            seconds = results.get("section_seconds", {}).get(name)
            lines.append(f"| {name} | {part or 'both'} | {budget[1 if results.get('smoke') else 0]:.0f} | "
                         f"{_fmt(seconds, '.0f')} | {summary_line(name, results[name])} |")
    lines += ["", "## Goals", ""]
    for r in results.values():
        for g in (r.get("goals") or ([r["goal"]] if "goal" in r else [])) if isinstance(r, dict) else []:
            verdict = {True: "met", False: "NOT MET", None: "not measured"}[g["met"]]
            lines.append(f"- {g['what']}: {_fmt(g['value'], '.3f')} (goal {g['goal']}): **{verdict}**")
    return "\n".join(lines)


def summary_line(name: str, r: dict[str, Any]) -> str:
    """A section's result in one table cell."""
    if "error" in r:
        return "FAILED: " + last_line(r["error"])
    if r.get("skipped") == "deadline":
        return f"skipped: deadline (its {r['budget_s']:.0f} s from {r['at_s']:.0f} s pass {r['deadline_s']:.0f} s)"
    if "skipped" in r:
        return "skipped: " + r["skipped"]
    return SUMMARY.get(name, lambda r: "ok")(r)


def last_line(error: str) -> str:
    return error.strip().splitlines()[-1][:200]


def each(r: dict[str, Any], names: tuple[str, ...], fmt: Callable[[dict[str, Any]], str]) -> str:
    """A section's lines in one cell: each line's figures, or its error."""
    return "; ".join(f"{k}: " + (fmt(r[k]) if "error" not in r[k] else "FAILED " + last_line(r[k]["error"]))
                     for k in names if k in r)


def _speedrun_line(r: dict[str, Any]) -> str:
    stages = "; ".join(f"{s['batch_tokens']:,}@{s['seq_len']}: {_fmt(s['tokens_per_s'], ',.0f')} tok/s, "
                       f"{s['recompiles']} recompiles" for s in r["stages"])
    return f"rc {r['rc']}; {stages}"


def _muon_line(r: dict[str, Any]) -> str:
    ratios = ", ".join(f"{k} {v['batched_over_torch']:.2f}" for k, v in r.items()
                       if isinstance(v, dict) and "batched_over_torch" in v)
    return f"batched / torch time: {ratios}; cut-off {r['cut_off']['muon_batch_max_numel']} ({r['cut_off']['why']})"


def _step(v: dict[str, Any]) -> str:
    return f"{v['step_ms']:,.0f} ms/step, loss {v['loss']:.4f}, {v['graphs']} graphs, {v['graph_breaks']} breaks"


SUMMARY: dict[str, Callable[[dict[str, Any]], str]] = {
    "fp8": lambda r: each(r, (r["precision"], "tensorwise", "rowwise"), lambda v: _step(v) + (
        f", {v['speedup']:.3f}x {r['precision']}, {v['fp8_flops_share']:.0%} of FLOPs in FP8" if "speedup" in v
        else "")) + (
        f"; reference only ({r['reference']['what']}): {r['reference']['step_ms']:,.0f} ms/step"),
    "fp8_ddp": lambda r: each(r, ("ddp_split", "ddp_one_graph", "unwrapped"), _step) + (
        f"; loss diff {', '.join(f'{k} {v:.1e}' for k, v in r['loss_diff'].items()) or 'n/a'}"),
    "fsdp": lambda r: each(r, ("ddp", "fsdp"), lambda v: f"{v['tokens_per_s']:,.0f} tok/s, " + _step(v)) + (
        f"; FSDP / DDP {r['fsdp_over_ddp']:.3f}, loss diff {r['loss_diff']:.1e}" if "fsdp_over_ddp" in r else ""),
    "speedrun": _speedrun_line,
    "muon": _muon_line,
    "tasks": lambda r: f"{r['requests']:,} requests in {r['seconds']:.1f} s (goal < {r['goal_s']} s)",
    "decode_fp8": lambda r: "; ".join(f"{k}: {v['fp8_linears']} FP8 Linears, logits agree {v['logits_agree']} "
                                      f"(max diff {v['max_abs_logit_diff']:.1e}), {v['cached_tokens_per_s']:,.0f} tok/s"
                                      for k, v in r.items() if isinstance(v, dict) and "logits_agree" in v),
    "sample": lambda r: (f"logits agree {r['logits_agree']} (max diff {r['max_abs_logit_diff']:.1e} of "
                         f"{r['max_abs_logit']:.1f}); same greedy tokens {r['greedy_tokens_equal']}; "
                         f"{r['cached_tokens_per_s']:,.0f} tok/s cached"),
    "harness": lambda r: f"{r['requests']} requests in {r['seconds']:.1f} s; vs scoring max diff "
                         f"{r['harness_vs_scoring_max_abs']:.1e}",
}
