"""Training: setup -> loop -> finish. The step is train_step; in the loop each component (logger, evaluator,
checkpointer, profiler, stop signal) decides for itself whether it acts at this step."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from nanopt import data, faults, fp8, hf, mfu, packing, parallel, plots, profiling, rundirs, shards
from nanopt.attention import choose
from nanopt.checkpoint import Checkpointer
from nanopt.config import Config, TrainConfig, resume_changes, to_yaml
from nanopt.ema import EMA
from nanopt.errors import ConfigError, DiskFull, Preempted
from nanopt.evaluation import Batches, SpeedrunClock, evaluate, split_batches, token_bytes_table
from nanopt.generate import sample_text
from nanopt.harness import TaskScorer
from nanopt.io import is_int, is_number, write_json, write_text
from nanopt.lock import DirLock
from nanopt.metrics import MetricsLogger, format_duration, step_line
from nanopt.model import build_model
from nanopt.optim import apply_schedule, build_optimizer, lr_multiplier
from nanopt.plan import Plan, Stage, build_plan
from nanopt.runtime import Runtime, bf16_slowdown
from nanopt.tokenizer import Tokenizer, get_tokenizer

log = logging.getLogger("nanopt")


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches, rt: Runtime,
               grad_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this rank's micro-batches: (mean loss, grad norm), on device. Each loss is divided
    by the micro-steps so the summed gradient is the mean; gradients are reduced across ranks only on the last
    micro-step (parallel.accumulating: DDP's no_sync, FSDP's set_requires_gradient_sync). Nothing here waits for
    the device."""
    accum = len(micro_batches)
    loss_sum = torch.zeros((), device=rt.device)
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)  # B T each
        last = i == accum - 1
        with parallel.accumulating(model, last):
            with rt.autocast(), profiling.label(profiling.FORWARD):
                loss = model(x, y) / accum
            with profiling.label(profiling.BACKWARD):
                loss.backward()
        loss_sum += loss.detach()
    with profiling.label(profiling.OPTIMIZER):
        if grad_clip > 0:
            grad_norm = parallel.clip_grad_norm(model, grad_clip)  # the whole gradient's norm, sharded or not
        else:
            grad_norm = torch.zeros((), device=rt.device)
        optimizer.step()
        # Under DDP the gradients are views of its buckets (gradient_as_bucket_view): zeroing them in place keeps
        # them there. Set to None, the next no_sync micro-steps would allocate a second set beside the buckets
        # and the last micro-step copy it in (tests/test_train.py measures it).
        optimizer.zero_grad(set_to_none=not parallel.grads_in_buckets(model))
    return loss_sum, grad_norm


@dataclass
class RunState:
    """The run's counters; saved in every checkpoint."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    train_seconds: float = 0.0  # wall time inside train steps only (no eval, checkpoint, logging)
    best_val_loss: Optional[float] = None
    best_val_bpb: Optional[float] = None  # absent from older checkpoints: None until the next evaluation

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            value = state.get(f.name, f.default)
            check, kind = _COUNTER_TYPES[f.type]
            if not check(value):  # a damaged state.json: checkpoint.py names the file
                raise TypeError(f"`{f.name}` is {value!r}, not {kind}")
            setattr(self, f.name, value)


# RunState's field types (annotations are strings here) -> (what a saved value must pass, its name in an error).
_COUNTER_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (is_int, "an integer"), "float": (is_number, "a number"),
    "Optional[float]": (lambda v: v is None or is_number(v), "a number or null")}


class SpeedWindow:
    """Steps and wall time since the window opened, for tokens/s and MFU. The first step after (re)starting
    is left out (allocation, compilation); a pause (evaluation, checkpoint) reopens it, so it is not billed."""

    def __init__(self, step: int):
        self.start_time: Optional[float] = None
        self.start_step = step

    def stepped(self, step: int) -> None:
        if self.start_time is None:
            self.reopen(step)

    def reopen(self, step: int) -> None:
        self.start_time, self.start_step = time.perf_counter(), step

    def close(self, step: int, fallback_s: float) -> tuple[int, float]:
        """(steps in the window, seconds per step), and reopen."""
        steps = step - self.start_step
        step_s = (time.perf_counter() - self.start_time) / steps if steps > 0 else fallback_s
        self.reopen(step)
        return steps, step_s


class StepLogger:
    """On the first step of a session, every `log.every` steps and the last: the one host sync of the
    logging window (loss averaged over ranks, NaN check), then one console line and one metrics record."""

    def __init__(self, cfg: Config, rt: Runtime, metrics: MetricsLogger, meter: mfu.MFUMeter,
                 guard: faults.FiniteGuard, start_step: int, plan: Plan):
        self.cfg, self.rt, self.metrics, self.meter, self.guard = cfg, rt, metrics, meter, guard
        self.start_step, self.window, self.plan = start_step, SpeedWindow(start_step), plan
        self.stage: Optional[Stage] = None  # the stage the loop is in, None before a session's first step

    def enter(self, stage: Stage, step: int) -> None:
        """A new stage (or a session's first): the meter counts its tokens and FLOPs; a fresh window, so none
        spans two stages and a recompile for a new seq_len is left out like the first step's compilation."""
        self.stage, self.window = stage, SpeedWindow(step)
        self.meter.set_stage(stage.batch_tokens, stage.seq_len)  # FLOPs/token at this seq_len too
        if self.rt.is_main and len(self.plan.stages) > 1:
            log.info("stage %d from step %d: %s tokens/step, seq %d, accum %d, lr x%.2f", stage.number, step,
                     f"{stage.batch_tokens:,}", stage.seq_len, stage.accum, stage.lr_factor)

    def due(self, step: int) -> bool:
        return step % self.cfg.log.every == 0 or step == self.cfg.train.max_steps or step == self.start_step + 1

    def read_loss(self, step: int, loss: torch.Tensor, last_good: Optional[Path]) -> float:
        self.guard.check(step, last_good)
        self.rt.all_reduce_sum(loss)
        value = loss.item() / self.rt.world_size
        self.rt.sync()
        return value

    def log(self, state: RunState, loss: float, lr: float, grad_norm: torch.Tensor, step_seconds: float,
            extra: dict[str, float]) -> None:
        t, tokens = self.cfg.train, self.stage.batch_tokens
        steps, step_s = self.window.close(state.step, step_seconds)
        values = {
            "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
            "tokens_per_s": tokens / step_s, "step_ms": 1000 * step_s,
            **self.meter.update(state.step, steps, step_s),
            **peak_memory(self.rt),
            "tokens_seen": state.tokens_seen,
            "eta_s": step_s * self.plan.tokens_left(state.step) / tokens, **extra,
        }
        self.metrics.log(state.step, values)
        if self.rt.is_main:
            log.info(step_line(state.step, t.max_steps, values, self.meter.basis, self.rt.world_size))


def _gib(n: Optional[int]) -> Optional[float]:
    return None if n is None else n / 2**30


def peak_memory(rt: Runtime) -> dict[str, Any]:
    """The busiest rank's peak memory (allocated; reserved where the device has a caching allocator) and which
    rank that is: under fsdp ranks differ (rank 0 holds a gathered checkpoint's CPU copy), so rank 0 alone would
    not say whether any device is close to full. Every rank calls it (one small all_reduce)."""
    allocated, reserved = rt.peak_memory_by_rank()
    busiest = None if allocated is None else max(range(len(allocated)), key=allocated.__getitem__)
    return {"peak_memory_gib": None if busiest is None else _gib(allocated[busiest]), "peak_memory_rank": busiest,
            "peak_reserved_gib": None if reserved is None else _gib(max(reserved))}


class Validator:
    """Validation every `eval.every` steps (and at step 0 unless eval.at_start is off, and at the end): loss, bpb,
    best loss, speedrun clock. Of the averaged weights under eval.weights=ema (swapped in for the measurement; each
    record says which)."""

    def __init__(self, cfg: Config, rt: Runtime, model: torch.nn.Module, batches: Batches,
                 token_bytes: torch.Tensor, metrics: MetricsLogger, clock: SpeedrunClock, ema: Optional[EMA] = None):
        self.cfg, self.rt, self.model, self.batches = cfg, rt, model, batches
        self.token_bytes, self.metrics, self.clock = token_bytes, metrics, clock
        self.ema = ema if cfg.eval.weights == "ema" else None
        self.last: dict[str, float] = {}
        self.last_step: Optional[int] = None  # this session's last evaluation

    def due(self, step: int) -> bool:
        every = self.cfg.eval.every
        if step == 0:  # before the first step: the initial weights, unless eval.at_start is off
            return bool(every) and self.cfg.eval.at_start
        return bool(every) and step % every == 0 and step != self.cfg.train.max_steps

    def run(self, state: RunState) -> dict[str, float]:
        val_loss, val_bpb = self._measure("val", self.batches, state.step, tokens_seen=state.tokens_seen,
                                          train_seconds=state.train_seconds)
        if state.best_val_loss is None or val_loss < state.best_val_loss:
            state.best_val_loss = val_loss
        if state.best_val_bpb is None or val_bpb < state.best_val_bpb:
            state.best_val_bpb = val_bpb
        self.clock.observe(val_loss, val_bpb, state.step, state.tokens_seen, state.train_seconds, self.rt)
        self.last, self.last_step = {"val_loss": val_loss, "val_bpb": val_bpb}, state.step
        return self.last

    def test(self, directory: Path, step: int) -> dict[str, float]:
        """The test split's loss and bpb after the final step ({} when off or when there are no test shards)."""
        test_at_end = self.cfg.eval.test_at_end
        batches = split_batches(self.cfg, self.rt, directory, "test", self.cfg.eval.batches) if test_at_end else None
        if batches is None:
            return {}
        loss, bpb = self._measure("test", batches, step)
        return {"test_loss": loss, "test_bpb": bpb}

    def weights_name(self) -> str:
        """The name of the weights evaluations use now: "ema" once the average has started, else "model"."""
        return "ema" if self.ema is not None and self.ema.started else "model"

    def weights(self) -> contextlib.AbstractContextManager[str]:
        """The weights evaluations use, in the model for the duration; yields their name ("model" or "ema")."""
        return self.ema.swapped() if self.ema is not None else contextlib.nullcontext("model")

    def _measure(self, split: str, batches: Batches, step: int, **extra: Any) -> tuple[float, float]:
        with self.weights() as weights:
            loss, bpb = evaluate(self.model, batches, self.token_bytes, self.rt)
        self.metrics.log(step, {f"{split}_loss": loss, f"{split}_bpb": bpb, **extra, "weights": weights})
        if self.rt.is_main:
            of = f" ({weights} weights)" if self.ema is not None else ""
            log.info("step %6d | %s loss %.4f | %s bpb %.4f%s", step, split, loss, split, bpb, of)
        return loss, bpb


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def peak_memory_per_rank(rt: Runtime) -> dict[str, Optional[list[float]]]:
    """summary.json's peak memory of every rank over the whole session (GiB, rank order; null where unknown)."""
    allocated, reserved = rt.peak_memory_by_rank()
    return {"peak_memory_gib_per_rank": None if allocated is None else [_gib(n) for n in allocated],
            "peak_reserved_gib_per_rank": None if reserved is None else [_gib(n) for n in reserved]}


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes, in a fixed order (once, at the end of a run); of a sharded model,
    over this rank's shards."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(parallel.local_tensor(p).detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class Session:
    """Everything setup() builds for the loop."""

    cfg: Config
    rt: Runtime
    directory: Path  # the data
    tokenizer: Tokenizer
    model: torch.nn.Module  # not DDP-wrapped (sharded in place under fsdp): what is saved, evaluated and sampled
    optimizer: torch.optim.Optimizer
    step_fn: Callable  # train_step, wrapped for the device and DDP (see _wrap)
    loader: data.Loader | packing.PackedLoader
    state: RunState
    clock: SpeedrunClock
    ckpt: Checkpointer
    metrics: MetricsLogger
    meter: mfu.MFUMeter
    evaluator: Validator
    tasks: TaskScorer
    logger: StepLogger
    guard: faults.FiniteGuard
    stop: faults.StopSignal
    started: float  # time.perf_counter() at the start of this session's loop
    plan: Plan
    ema: Optional[EMA] = None  # the averaged weights (train.ema_decay), None when off

    def pause_follows(self, step: int) -> bool:
        """Whether the evaluator or the checkpointer acts right after this step (the end of the run included):
        the step's device work must then be waited for inside the training clock, or the pause is billed it."""
        return (step >= self.cfg.train.max_steps or self.evaluator.due(step) or self.tasks.due(step)
                or self.ckpt.should_save(step))

    def save(self) -> Path:
        """Checkpoint now (every rank), never a diverged model over the last good one."""
        self.guard.check(self.state.step, self.ckpt.latest, self.model)
        states = {"run_state": self.state, "loader": self.loader, "speedrun": self.clock}
        return self.ckpt.save(self.state.step, self.model, self.optimizer, states, self.ema)

    def close(self) -> None:
        """What both a finished and a failed run close: mirror copies waited for, logs flushed and closed."""
        try:
            self.ckpt.close()
        finally:
            self.metrics.close()


def ddp_split(t: TrainConfig) -> bool:
    """Whether a model compiled under DDP is split at DDP's buckets (train.compile_ddp_split; null: unless train.fp8
    is on, since FP8 + compile + the split fails upstream: pytorch/pytorch#158936, pytorch/ao#2586)."""
    return t.fp8 == "none" if t.compile_ddp_split is None else t.compile_ddp_split


def compiled(model: torch.nn.Module, t: TrainConfig, plan: Plan, ddp: bool = False) -> torch.nn.Module:
    """torch.compile for train.compile: the model the train step calls. Unsharded (ddp, or one process), the whole
    model; sharded (fsdp, hsdp), each block (compile_blocks) and the model itself is returned. Shapes are static
    when a seq_len schedule is set: under dynamo's default a second sequence length recompiles the graph with T
    dynamic, and every later stage then runs that slower dynamic-shape graph; static, each length gets its own
    graph, once. Under DDP (`ddp`: the model will be wrapped), ddp_split chooses whether the graph is split at
    DDP's buckets (the all-reduces overlap the backward)."""
    torch._dynamo.config.optimize_ddp = ddp_split(t)
    if ddp and not ddp_split(t) and t.compile_ddp_split is None and not parallel.is_sharded(model):
        log.info("compile: one graph under DDP, its all-reduces not overlapping the backward: train.fp8 is on, and "
                 "FP8 + compile + DDP's graph split fails upstream (pytorch/pytorch#158936); "
                 "--train.compile_ddp_split=true splits it anyway")
    lengths = {s.seq_len for s in plan.stages}
    static: dict[str, Any] = {}
    if len(lengths) > 1:
        # One graph per length per compiled frame: dynamo's limit on them must not send a late stage to eager. Two
        # per length for torch 2.9's frame around an FSDP-managed block (compile_blocks): its guards tell the first
        # block, whose input is the embedding x0 itself, from the others.
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 2 * len(lengths))
        static = {"dynamic": False}
    if parallel.is_sharded(model):
        compile_blocks(model, **static)
        return model
    return torch.compile(model, **static)


def compile_blocks(model: torch.nn.Module, **options: Any) -> None:
    """A sharded model compiled per block, as torch's guidance for FSDP2 has it (torchtitan's apply_compile): each
    block's forward is one graph, FSDP2's hooks around it (the all-gather before, the reshard after, the gradient
    reduce-scatter in backward) stay eager, where torch runs them (dynamo does not trace them), so a whole-model
    graph would break at every block anyway. The blocks share one compiled code: dynamo inlines nn modules and
    guards on their structure, not their identity, so compile time does not grow with depth.
    Compiled callables only the training forward uses (Llama.training_blocks), after fully_shard, rather than
    torchtitan's compiled blocks swapped into the module tree or an in-place block.compile(): those change the
    state_dict keys (`_orig_mod.`) or compile every call of the block, so validation, task scoring and KV-cache
    decoding (T=1, a growing start_pos, cache arguments) would each compile shapes of their own, hit dynamo's
    recompile limit and warn; here they run the eager blocks, as the unsharded path runs the eager model."""
    model.training_blocks = [torch.compile(block, **options) for block in model.layers]


def _wrap(cfg: Config, rt: Runtime, model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: Plan) -> Callable:
    """train_step bound to the model as the device wants it: compiled, under DDP (parallel.wrap), or one XLA
    graph."""
    train_model = parallel.wrap(compiled(model, cfg.train, plan, rt.distributed) if cfg.train.compile else model, rt)
    # XLA: the whole step as one graph, compiled once per step shape (a schedule's stages may each bring one)
    step_fn = rt.backend.compile_step(train_step, optimizer, shapes=len(plan.stages))
    return lambda batches: step_fn(train_model, optimizer, batches, rt, cfg.train.grad_clip)


def setup(cfg: Config, rt: Runtime, metrics: MetricsLogger) -> Session:
    """Data, model, optimizer, and the loop's components; resumed from the newest checkpoint when there is one."""
    t = cfg.train
    stop = faults.StopSignal(rt, cfg.run.time_limit_s)  # first: the time limit counts set-up too
    init_seed, data_seed = cfg.run.seeds
    seed_everything(init_seed)
    directory = data.data_dir(cfg, rt)
    # One checksum pass per node (its ranks read the same files), and only over shards new since the last one;
    # the node's other ranks wait for its verdict.
    verify = rt.local_rank == 0
    train_windows, val_windows = [data.open_split(directory, split, cfg, verify) for split in ("train", "val")]
    rt.barrier()
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    plan = build_plan(t, rt.world_size)
    first = plan.stages[0]
    loader = build_loader(cfg, rt, train_windows, tokenizer.bos_id, data_seed, first.accum)  # each step asks its own
    val_batches = data.eval_batches(val_windows, t.micro_batch_size, cfg.eval.batches, rt.rank, rt.world_size,
                                    cfg.eval.seed)
    attention_name, kernel = choose(cfg.model.attention, rt.kind, t.precision, rt.hardware_name())
    model = build_model(cfg.model, rt.device, kernel=kernel, loss_chunk_tokens=t.loss_chunk_tokens,
                        dtype=rt.param_dtype, init_device=rt.backend.init_device)  # XLA: initialised with the host RNG
    model.recompute_blocks = t.recompute  # train.recompute: each block's activations again in backward
    fp8.convert(model, cfg, rt)  # train.fp8: the block Linears in FP8, before the optimizer, compile and DDP see them
    parallel.shard(model, cfg, rt)  # runtime.parallel=fsdp: sharded in place, before the optimizer takes the params
    optimizer = build_optimizer(model, t, rt.kind, cfg.optim, rt.backend.muon_batch_max_numel, rt.process_group,
                                rt.reduced_dtype(cfg.optim.muon_dtype))
    state, clock, ema = RunState(), SpeedrunClock.for_config(cfg), EMA.for_config(cfg, model)
    # Exact resume (checkpoint.py): refuses a changed config or data, skips damaged checkpoints.
    ckpt = Checkpointer(cfg, rt, shards.split_paths(directory, "train"))
    saved = ckpt.restore(model, optimizer, {"run_state": state, "loader": loader, "speedrun": clock}, ema)
    if saved is None and t.init_from:  # a fresh run warm-started from Hugging Face weights (a resume keeps its own)
        hf.init_from(model, t.init_from)
    if ema is not None:
        ema.begin(state.step)  # train.ema_start 0: the average starts from the initial weights
    metrics.open(saved["step"] if saved else 0)  # a resume drops the records past its step
    if rt.is_main:
        write_text(cfg.run_dir / rundirs.CONFIG_FILE, to_yaml(cfg))
        log.info("model: %s parameters | attention %s | %s on %s x%d (%s) | %d tokens/step = %d micro-batch x %d "
                 "seq x %d ranks x %d accum", f"{model.num_params():,}", attention_name, t.precision, rt.kind,
                 rt.world_size, rt.hardware_name(), first.batch_tokens, t.micro_batch_size, first.seq_len,
                 rt.world_size, first.accum)
    if rt.is_main and t.precision == "bf16-pure":
        log.warning("train.precision is bf16-pure: the weights and AdamW's state are bf16, so an update smaller "
                    "than ~2^-9 of a weight rounds away (decoupled weight decay of lr x wd = %.1e per step does "
                    "nothing, and late small updates are lost). Use bf16 (autocast, fp32 weights) unless memory "
                    "forces this.", t.lr * t.weight_decay)
    if rt.is_main and t.precision != "fp32" and not rt.backend.native_bf16:  # the user's choice stands, but is told
        log.warning("train.precision is %s, but %s has no bf16 hardware: torch emulates bf16, and a %d-wide matmul "
                    "(model.dim) measured %.0fx slower in bf16 than in fp32 here. Set --train.precision=fp32 to "
                    "train at this CPU's speed.", t.precision, rt.hardware_name(), cfg.model.dim,
                    bf16_slowdown(cfg.model.dim, rt.device))
    meter = mfu.meter_for_run(cfg, rt, state.step)  # every rank: on CPU it measures the peak once
    guard = faults.FiniteGuard(rt, state.step)  # NaN/inf loss on any rank -> TrainingError, no per-step sync
    token_bytes = token_bytes_table(tokenizer, cfg.model.vocab_size, rt.device)
    return Session(cfg, rt, directory, tokenizer, model, optimizer, _wrap(cfg, rt, model, optimizer, plan), loader,
               state, clock, ckpt, metrics, meter,
               Validator(cfg, rt, model, val_batches, token_bytes, metrics, clock, ema),
               TaskScorer(cfg, rt, model, tokenizer), StepLogger(cfg, rt, metrics, meter, guard, state.step, plan),
               guard, stop, time.perf_counter(), plan, ema)


def build_loader(cfg: Config, rt: Runtime, windows: data.TokenWindows, bos: Optional[int],
                 seed: int, accum: int) -> data.Loader | packing.PackedLoader:
    """The training rows as data.packing cuts them (validation always reads windows, so val loss compares)."""
    t = cfg.train
    args = (t.micro_batch_size, rt.rank, rt.world_size, accum, seed)
    if cfg.data.packing == "windows":
        return data.Loader(windows, *args)
    documents = packing.Documents(windows.shards, bos, windows.infos)  # the BOS index is cached by the shards' contents
    return packing.PackedLoader(documents, *args, t.seq_len, cfg.data.pack_buffer)


def one_step(run: Session) -> None:
    """Stage, lr, data, the step, then the bookkeeping that needs the step's result: counters, the logger's
    host sync on logging steps, and training time (device work included) up to here."""
    cfg, rt, state = run.cfg, run.rt, run.state
    stage = run.plan.at(state.step, state.tokens_seen)
    if stage != run.logger.stage:
        run.logger.enter(stage, state.step)
    apply_schedule(run.optimizer, lr_multiplier(state.step, cfg.train) * stage.lr_factor)
    t0 = time.perf_counter()
    with profiling.label(profiling.DATA):
        micro_batches = run.loader.micro_batches(stage.accum, stage.seq_len)
    loss, grad_norm = run.step_fn(micro_batches)
    if run.ema is not None:
        with profiling.label(profiling.OPTIMIZER):
            run.ema.update(state.step + 1)  # on the device's queue like the step: training time
    run.guard.update(loss)
    faults.fault_hook("kill-in-step", state.step + 1, rt.rank)
    state.step += 1
    state.tokens_seen += stage.batch_tokens
    logging_step = run.logger.due(state.step)
    if logging_step:
        loss_value = run.logger.read_loss(state.step, loss, run.ckpt.latest)
    elif run.pause_follows(state.step):
        rt.sync()  # charge this step's queued device work to training, not to the eval/checkpoint after it
    seconds = time.perf_counter() - t0
    state.train_seconds += seconds
    run.logger.window.stepped(state.step)
    if logging_step:
        run.logger.log(state, loss_value, run.optimizer.param_groups[0]["lr"], grad_norm, seconds,
                       run.loader.metrics())


def loop(run: Session, profiler: profiling.Off | profiling.Profile) -> None:
    """Steps until max_steps, the speedrun target (stop_at_target), or a stop signal or the time limit
    (checkpoint, Preempted)."""
    cfg, state = run.cfg, run.state
    if state.step == 0 and run.evaluator.due(0):
        run.evaluator.run(state)
    while state.step < cfg.train.max_steps:
        one_step(run)
        profiler.step()
        if run.evaluator.due(state.step):
            run.evaluator.run(state)
            if cfg.train.stop_at_target and run.clock.reached:
                break
        scoring = run.tasks.due(state.step)
        if scoring or run.ckpt.should_save(state.step):
            run.save()  # before scoring: a scoring failure or a kill during it costs no trained step
        if scoring:
            run.tasks.run(state.step, run.evaluator.weights())
        if run.pause_follows(state.step):
            run.logger.window.reopen(state.step)  # the pause is not billed to the next window's steps
        faults.fault_hook("pause", state.step, run.rt.rank, cfg.run_dir)
        if run.stop.should_stop() and state.step < cfg.train.max_steps:
            raise Preempted(run.stop.signame, state.step, run.save())


def finish(run: Session) -> dict[str, Any]:
    """Final evaluation (val, then test), the last checkpoint, summary.json and samples."""
    cfg, rt, state, model = run.cfg, run.rt, run.state, run.model
    if run.evaluator.last_step != state.step:
        run.evaluator.run(state)
    test_eval = run.evaluator.test(run.directory, state.step)
    run.save()  # before scoring, which may fail (recorded) or be killed: the last step is kept either way
    if run.tasks.spec and run.tasks.last_step != state.step:
        run.tasks.run(state.step, run.evaluator.weights())
    run.ckpt.close()  # wait for the copy to checkpoint.mirror
    last = run.evaluator.last
    summary = {
        "run": cfg.run.name, "steps": state.step, "tokens_seen": state.tokens_seen,
        "train_seconds": state.train_seconds, "wall_seconds_this_session": time.perf_counter() - run.started,
        "final_val_loss": last.get("val_loss"), "final_val_bpb": last.get("val_bpb"),
        "best_val_loss": state.best_val_loss, "best_val_bpb": state.best_val_bpb,
        "world_size": rt.world_size, "device": rt.kind,
        "hardware": rt.hardware_name(), "params": model.num_params(), **run.meter.summary(),
        **fp8.summary(cfg, (run.logger.stage or run.plan.at(state.step, state.tokens_seen)).seq_len),
        "packing_cropped_share": run.loader.metrics().get("cropped_share"),  # null under windows
        # One digest per rank: DDP replicas that drifted apart would show different values here.
        "weights_sha256_per_rank": rt.gather_objects(weights_digest(model)),
        **peak_memory_per_rank(rt),
        **test_eval, **run.clock.summary(), "tasks_seconds": run.tasks.seconds if run.tasks.spec else None,
        # What makes the run finished (rundirs.finished) when it ends before max_steps.
        "stopped_at_target": state.step < cfg.train.max_steps and cfg.train.stop_at_target and run.clock.reached,
        # Which weights the final validation and test used, as swapped in (eval.weights=ema before the average
        # started, or a run stopped at its target first: the model's).
        "eval_weights": run.evaluator.weights_name(),
    }
    if rt.is_main:
        write_json(cfg.run_dir / rundirs.SUMMARY_FILE, summary)
        if cfg.log.curves:
            plots.curves_quietly(cfg.run_dir)  # curves.png; a log line, never an error, when it cannot be drawn
    _print_samples(run)
    if rt.is_main:
        log.info("done: %d steps, %s tokens in %s of training; run directory %s", state.step,
                 f"{state.tokens_seen:,}", format_duration(state.train_seconds), cfg.run_dir)
        if missed := run.clock.missed(state.step, state.best_val_loss, state.best_val_bpb):
            log.info("%s", missed)
    return summary


def _print_samples(run: Session) -> None:
    s = run.cfg.sample
    # A sharded model's forward gathers from every rank, so all sample together (one seed: the same tokens).
    if not s.num_samples or not (run.rt.is_main or parallel.is_sharded(run.model)):
        return
    with run.evaluator.weights() as weights:
        samples = sample_text(run.model, run.tokenizer, s.prompt, s.num_samples, s.max_new_tokens, s.temperature,
                              s.top_k, run.cfg.run.seed, run.rt.device)
    if not run.rt.is_main:
        return
    of = f" ({weights} weights)" if run.evaluator.ema is not None else ""
    print(f"\n--- {len(samples)} samples from step {run.state.step}{of}, prompt {s.prompt!r} ---")
    print("".join(f"{text.strip()}\n---\n" for text in samples), end="")
    run.metrics.text("samples", "\n\n---\n\n".join(samples), run.state.step)


def own_run_dir(cfg: Config, rt: Runtime) -> Optional[DirLock]:
    """The run directory's lock, taken by rank 0 for the whole torchrun (its ranks are one writer); every rank
    raises ConfigError naming the holder when another process writes the directory."""
    return rt.on_main(lambda: DirLock(cfg.run_dir).acquire(), (ConfigError, DiskFull))  # a full disk: exit 1


def finished_summary(cfg: Config) -> Optional[dict[str, Any]]:
    """The summary of this run when it is already finished (rundirs.finished), after checking that the
    finished run is this config's: a re-run of its command changes nothing; a change it would silently ignore
    (one that changes results or what the run measures: data, target, profiling, tasks) is refused."""
    summary = rundirs.finished(cfg.run_dir, cfg.train.max_steps, cfg.train.stop_at_target)
    if summary is None:
        return None
    if changes := resume_changes(rundirs.read_config(cfg.run_dir) or {}, cfg, finished=True):
        more = (f" `--train.stop_at_target=false` continues the run (it stopped at its target at step "
                f"{summary.get('steps')}) to train.max_steps." if summary.get("stopped_at_target") else
                " A larger `train.max_steps` continues the run.")
        raise ConfigError(f"{cfg.run_dir} holds a finished run of another config ({'; '.join(changes)}; \"in the "
                          f"checkpoint\" = its config.yaml), and a finished run is not trained again. Set `run.name` "
                          f"(or `run.dir`) to a new directory for this one, run the config it used, or accept the "
                          f"change with `--checkpoint.allow_changes=KEY[,KEY...]` (then nothing is trained: the "
                          f"finished run's summary is printed).{more}")
    return summary


def summary_line(summary: dict[str, Any]) -> str:
    """A finished run's summary.json in one line."""
    parts = [f"{summary.get('steps')} steps"]
    if isinstance(summary.get("tokens_seen"), int):
        parts.append(f"{summary['tokens_seen']:,} tokens")
    if isinstance(summary.get("train_seconds"), (int, float)):
        parts.append(f"{format_duration(summary['train_seconds'])} of training")
    for key in ("final_val_loss", "final_val_bpb"):
        if isinstance(summary.get(key), (int, float)):
            parts.append(f"{key} {summary[key]:.4f}")
    if summary.get("stopped_at_target"):
        parts.append(f"stopped at its target at step {summary.get('step_to_target')}")
    elif summary.get("target_reached") is False:
        parts.append("target not reached")
    return "summary: " + ", ".join(parts)


def train(cfg: Config, rt: Runtime) -> dict[str, Any]:
    """Run (or resume) training; returns summary.json's contents. A finished run is not trained further: its
    summary is returned and nothing written. However the run ends, profiler, checkpointer (mirror copies),
    logs and the run directory's lock are closed the same way."""
    rundirs.refuse_inside_checkpoints(cfg.run_dir, "--run.dir")  # another run would prune this one away
    lock = own_run_dir(cfg, rt)
    try:
        # checkpoint.resume=false asks for a fresh run: the checkpointer refuses a directory that is not empty.
        done = finished_summary(cfg) if rt.is_main and cfg.checkpoint.resume else None
        done = rt.gather_objects(done)[0]
        if done is not None:
            if rt.is_main:
                longer = ("--train.stop_at_target=false continues it to train.max_steps" if
                          done.get("stopped_at_target") else "a longer run: raise train.max_steps")
                log.info("%s is finished; nothing to train (%s; another run: set run.dir). %s", cfg.run_dir, longer,
                         summary_line(done))
            return done
        return _train(cfg, rt)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: Config, rt: Runtime) -> dict[str, Any]:
    metrics = MetricsLogger(cfg.run_dir, enabled=rt.is_main, tensorboard=cfg.log.tensorboard,
                            wandb_cfg={"project": cfg.log.wandb_project, "name": cfg.run.name,
                                       "config": cfg.to_dict()} if cfg.log.wandb else None)
    run = None
    try:
        run = setup(cfg, rt, metrics)
        with profiling.profiler(cfg, rt, run.state.step, metrics) as profiler:  # a no-op unless profile.enabled
            loop(run, profiler)
        return finish(run)
    finally:
        (run if run is not None else metrics).close()  # a run closes its metrics too
