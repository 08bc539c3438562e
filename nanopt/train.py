"""The training loop: accumulate (no_sync) -> clip -> step -> schedule -> eval -> log -> checkpoint."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from nanopt import checkpoint, data, evaluation, faults, mfu, profiling, runtime
from nanopt.attention import choose
from nanopt.config import Config, ConfigError, to_yaml
from nanopt.generate import sample_text
from nanopt.metrics import MetricsLogger, format_duration, step_line, write_json
from nanopt.model import build_model
from nanopt.optim import build_optimizer, lr_at, set_lr
from nanopt.runtime import Runtime
from nanopt.tokenizer import get_tokenizer

log = logging.getLogger("nanopt")


TrainingError = faults.TrainingError  # defined with the other faults; importable from here as before


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]], rt: Runtime, grad_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this rank's micro-batches. Returns (mean loss, grad norm), on device.

    Each micro-batch loss is divided by the number of micro-steps so the summed gradient is the mean;
    DDP all-reduces only on the last micro-step (no_sync elsewhere). Nothing here waits for the device.
    """
    accum = len(micro_batches)
    loss_sum = torch.zeros((), device=rt.device)
    for i, (x, y) in enumerate(micro_batches):
        x = x.to(rt.device, non_blocking=True)
        y = y.to(rt.device, non_blocking=True)
        last = i == accum - 1
        sync = contextlib.nullcontext() if last or not isinstance(model, DDP) else model.no_sync()
        with sync:
            with rt.autocast(), profiling.label(profiling.FORWARD):
                loss = model(x, y) / accum
            with profiling.label(profiling.BACKWARD):
                loss.backward()
        loss_sum += loss.detach()
    with profiling.label(profiling.OPTIMIZER):
        if grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        else:
            grad_norm = torch.zeros((), device=rt.device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], token_bytes: torch.Tensor, rt: Runtime,
) -> tuple[float, float]:
    """(mean loss in nats per token, bits per byte) over the fixed validation set, summed over ranks."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=rt.device)  # nats, tokens, bytes
    for x, y in batches:
        x, y = rt.batch_to_device(x), rt.batch_to_device(y)
        with rt.autocast():
            loss = model(x, y)
        n = y.numel()
        totals[0] += loss.double() * n
        totals[1] += n
        totals[2] += token_bytes[y].sum()
        rt.mark_step()  # XLA: one graph per batch (the same one every time), not one growing graph
    model.train()
    rt.all_reduce_sum(totals)
    nats, tokens, nbytes = totals.tolist()
    return nats / max(tokens, 1), nats / math.log(2) / max(nbytes, 1)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes, in a fixed order (once, at the end of a run)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class RunState:
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    train_seconds: float = 0.0  # wall time inside train steps only (no eval, checkpoint, logging)
    best_val_loss: Optional[float] = None
    extra: dict[str, Any] = field(default_factory=dict)


def _data_dir(cfg: Config, rt: Runtime) -> Path:
    if cfg.data.source == "embedded":
        # Rank 0 builds the cache; the others wait and then read it.
        if rt.is_main:
            directory = data.embedded_shards(cfg.data.tokenizer)
        rt.barrier()
        if not rt.is_main:
            directory = data.embedded_shards(cfg.data.tokenizer)
        return directory
    directory = Path(cfg.data.dir or cfg.data.source)
    if not directory.is_dir():
        raise ConfigError(
            f"`data.source` is {cfg.data.source!r} but {directory} is not a directory of token shards; "
            f"use `data.source: embedded` or run `nanopt prepare --config ...` first."
        )
    return directory


def _open_split(directory: Path, split: str, cfg: Config) -> data.TokenWindows:
    paths = data.split_paths(directory, split)
    if not paths:
        raise ConfigError(f"no `{split}_*.bin` token shards in {directory}; run `nanopt prepare` for this config.")
    try:
        windows = data.TokenWindows(paths, cfg.train.seq_len, verify=cfg.data.verify_checksum)
    except data.ShardError as e:
        raise ConfigError(str(e)) from None
    if windows.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the shards in {directory} use a vocabulary of {windows.vocab_size} ids but `model.vocab_size` is "
            f"{cfg.model.vocab_size}; set `model.vocab_size` to at least {windows.vocab_size}."
        )
    return windows


def train(cfg: Config, rt: Runtime) -> dict[str, Any]:
    """Run (or resume) training as configured; returns the summary written to summary.json."""
    run_dir = cfg.run_dir
    t = cfg.train
    accum = t.grad_accum_steps
    seed_everything(cfg.run.seed)

    directory = _data_dir(cfg, rt)
    train_windows = _open_split(directory, "train", cfg)
    val_windows = _open_split(directory, "val", cfg)
    loader = data.Loader(train_windows, t.micro_batch_size, rt.rank, rt.world_size, accum, cfg.run.seed)
    val_batches = data.eval_batches(val_windows, t.micro_batch_size, cfg.eval.batches, rt.rank, rt.world_size,
                                     cfg.eval.seed)
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    token_bytes = torch.tensor(
        tokenizer.token_bytes() + [0] * (cfg.model.vocab_size - tokenizer.vocab_size), device=rt.device
    )

    model = build_model(cfg.model, rt.device, init_device=rt.init_device)  # XLA: initialised with the host RNG
    if rt.param_dtype != torch.float32:
        model.to(rt.param_dtype)
    model.loss_chunk_tokens = t.loss_chunk_tokens
    attention_name, kernel = choose(cfg.model.attention, rt.kind, t.precision)
    model.set_attention(kernel)
    optimizer = build_optimizer(model, t, rt.kind)
    state = RunState()

    # Exact resume: model, optimizer, loader position, every rank's RNGs and the run state (README:
    # "Resume, preemption and faults"); refuses a changed config or data, skips corrupt checkpoints.
    ckpt = checkpoint.Checkpointer(cfg, rt, data.split_paths(directory, "train"))
    saved = ckpt.restore(model, optimizer, loader)
    if saved is not None:
        state = RunState(**saved["run_state"])
        state.extra.pop("last_eval_step", None)  # this session holds no eval result yet: a re-run re-evaluates
        state.extra["target"] = saved.get("target")  # the speedrun clock survives a resume
    elif t.init_from:  # a fresh run warm-started from a Hugging Face directory (a resume keeps its own weights)
        from nanopt.export import init_from
        init_from(model, t.init_from)

    train_model: torch.nn.Module = model
    if t.compile:
        train_model = torch.compile(model)
    if rt.distributed:
        # The only buffers are the RoPE tables, computed identically on every rank: nothing to broadcast
        # before each forward (DDP's default would send them from rank 0 every micro-step).
        train_model = DDP(train_model, device_ids=runtime.ddp_device_ids(rt),
                          gradient_as_bucket_view=True, broadcast_buffers=False)
    step_fn = rt.compile_step(train_step, optimizer)  # XLA: the whole step as one graph, compiled once

    metrics = MetricsLogger(
        run_dir, enabled=rt.is_main, tensorboard=cfg.log.tensorboard,
        wandb_cfg={"project": cfg.log.wandb_project, "name": cfg.run.name, "config": cfg.to_dict()}
        if cfg.log.wandb else None,
    )
    tokens_per_step = t.global_batch_tokens
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        log.info(
            "model: %s parameters | attention %s | %s on %s x%d (%s) | %d tokens/step = %d micro-batch x %d seq x %d ranks x %d accum",
            f"{model.num_params():,}", attention_name, t.precision, rt.kind, rt.world_size, rt.hardware_name(),
            tokens_per_step, t.micro_batch_size, t.seq_len, rt.world_size, accum,
        )
    mfu_meter = mfu.meter_for_run(cfg, rt, state.step)  # every rank: on CPU it measures the peak once

    def save_checkpoint() -> Path:
        guard.check(state.step, ckpt.latest, model)  # never write a diverged model over the last good one
        return ckpt.save(
            state.step, model, optimizer, loader,
            {"run_state": dataclasses.asdict(state), "tokens_seen": state.tokens_seen,
             "train_seconds": state.train_seconds, "best_val_loss": state.best_val_loss,
             "target": state.extra.get("target")},
        )

    def run_eval() -> dict[str, float]:
        val_loss, val_bpb = evaluate(model, val_batches, token_bytes, rt)
        if state.best_val_loss is None or val_loss < state.best_val_loss:
            state.best_val_loss = val_loss
        evaluation.check_target(cfg, state, val_loss, rt)
        state.extra["last_eval_step"] = state.step
        metrics.log(state.step, {"val_loss": val_loss, "val_bpb": val_bpb, "tokens_seen": state.tokens_seen})
        if rt.is_main:
            log.info("step %6d | val loss %.4f | val bpb %.4f", state.step, val_loss, val_bpb)
        return {"val_loss": val_loss, "val_bpb": val_bpb}

    start_step = state.step
    guard = faults.FiniteGuard(rt, start_step)  # NaN/inf loss on any rank -> TrainingError, no per-step sync
    stop = faults.StopSignal(rt)  # SIGTERM/SIGINT on any rank -> all ranks checkpoint after the same step
    if start_step == 0 and cfg.eval.every:
        run_eval()
    window_start_time, window_start_step = None, start_step
    wall_start = time.perf_counter()
    last_eval: dict[str, float] = {}
    profiler = profiling.start(cfg, rt, start_step, metrics)  # a no-op nullcontext unless profile.enabled
    while state.step < t.max_steps:
        step = state.step
        set_lr(optimizer, lr_at(step, t))
        t0 = time.perf_counter()
        with profiling.label(profiling.DATA):
            micro_batches = loader.micro_batches()
        loss, grad_norm = step_fn(train_model, optimizer, micro_batches, rt, t.grad_clip)
        guard.update(loss)
        faults.fault_hook("kill-in-step", step + 1, rt.rank)
        state.step += 1
        state.tokens_seen += tokens_per_step
        profiler.step()
        is_log_step = state.step % cfg.log.every == 0 or state.step == t.max_steps or state.step == start_step + 1
        if is_log_step:
            guard.check(state.step, ckpt.latest)
            # The one host sync per logging window: average the loss over ranks and read it.
            rt.all_reduce_sum(loss)
            loss_value = loss.item() / rt.world_size
            rt.sync()
        if not is_log_step and evaluation.pause_follows(cfg, state.step):
            rt.sync()  # charge this step's queued device work to training, not to the eval/checkpoint after it
        step_seconds = time.perf_counter() - t0
        state.train_seconds += step_seconds
        if window_start_time is None:
            # Skip the first step (allocation, compilation) in the speed average.
            window_start_time, window_start_step = time.perf_counter(), state.step
        if is_log_step:
            now = time.perf_counter()
            steps_in_window = state.step - window_start_step
            if steps_in_window > 0:
                step_s = (now - window_start_time) / steps_in_window
            else:
                step_s = step_seconds
            values = {
                "loss": loss_value, "lr": optimizer.param_groups[0]["lr"], "grad_norm": float(grad_norm),
                "tokens_per_s": tokens_per_step / step_s, "step_ms": 1000 * step_s,
                **mfu_meter.update(state.step, steps_in_window, step_s), "peak_memory_gib": mfu.peak_memory_gib(rt),
                "tokens_seen": state.tokens_seen, "eta_s": step_s * (t.max_steps - state.step),
            }
            metrics.log(state.step, values)
            if rt.is_main:
                log.info(step_line(state.step, t.max_steps, values))
            window_start_time, window_start_step = time.perf_counter(), state.step
        if cfg.eval.every and state.step % cfg.eval.every == 0 and state.step != t.max_steps:
            last_eval = run_eval()
            window_start_time, window_start_step = time.perf_counter(), state.step
            if t.stop_at_target and state.extra.get("target"):
                break
        if cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0 and state.step != t.max_steps:
            save_checkpoint()
            window_start_time, window_start_step = time.perf_counter(), state.step
        faults.fault_hook("pause", state.step, rt.rank, run_dir)
        if stop.should_stop() and state.step < t.max_steps:
            saved_to = save_checkpoint()  # first: the grace period may end during the trace export
            profiler.stop()  # a preempted run still writes the trace it has
            ckpt.close()
            metrics.close()
            raise faults.Preempted(stop.signame, state.step, saved_to)

    profiler.stop()
    if state.extra.get("last_eval_step") != state.step:
        last_eval = run_eval()
    test_eval = evaluation.test_at_end(cfg, rt, model, directory, token_bytes, metrics, state.step)
    save_checkpoint()
    ckpt.close()  # wait for the copy to checkpoint.mirror
    summary = {
        "run": cfg.run.name, "steps": state.step, "tokens_seen": state.tokens_seen,
        "train_seconds": state.train_seconds, "wall_seconds_this_session": time.perf_counter() - wall_start,
        "final_val_loss": last_eval.get("val_loss"), "final_val_bpb": last_eval.get("val_bpb"),
        "best_val_loss": state.best_val_loss, "world_size": rt.world_size, "device": rt.kind,
        "hardware": rt.hardware_name(), "params": model.num_params(), **mfu_meter.summary(),
        # One digest per rank: DDP replicas that drifted apart would show different values here.
        "weights_sha256_per_rank": rt.gather_objects(weights_digest(model)),
        **test_eval, **evaluation.target_summary(cfg, state),
    }
    if rt.is_main:
        write_json(run_dir / "summary.json", summary)
        if cfg.sample.num_samples:
            samples = sample_text(
                model, tokenizer, cfg.sample.prompt, cfg.sample.num_samples, cfg.sample.max_new_tokens,
                cfg.sample.temperature, cfg.sample.top_k, cfg.run.seed, rt.device,
            )
            print(f"\n--- {len(samples)} samples from step {state.step}, prompt {cfg.sample.prompt!r} ---")
            for s in samples:
                print(s.strip())
                print("---")
            metrics.text("samples", "\n\n---\n\n".join(samples), state.step)
        log.info("done: %d steps, %s tokens in %s of training; run directory %s",
                 state.step, f"{state.tokens_seen:,}", format_duration(state.train_seconds), run_dir)
    metrics.close()
    return summary
