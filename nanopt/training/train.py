"""Training: train() sets up a Trainer, whose train() loops over train_step, then finish(); each component
decides for itself whether it acts at a step."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import random
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from nanopt import hf, rundirs
from nanopt.config import Config, TrainConfig, resume_changes, to_yaml
from nanopt.data import shards
from nanopt.data.tokenizer import Tokenizer, get_tokenizer
from nanopt.distributed import parallel
from nanopt.distributed.runtime import Runtime, bf16_slowdown
from nanopt.errors import ConfigError, DiskFull, Preempted
from nanopt.evals.generate import sample_text
from nanopt.evals.tasks import TaskScorer
from nanopt.io import is_int, is_number, write_json, write_text
from nanopt.lab import plots
from nanopt.lock import DirLock
from nanopt.recipe import fp8, mfu
from nanopt.recipe.attention import choose
from nanopt.recipe.model import build_model
from nanopt.recipe.optim import apply_schedule, build_optimizer, lr_multiplier
from nanopt.training import faults, loader as data, packing, profiling
from nanopt.training.checkpoint import Checkpointer
from nanopt.training.ema import EMA
from nanopt.training.metrics import (MetricsLogger, format_duration, peak_memory, peak_memory_per_rank, step_line,
                                     summary_line)
from nanopt.training.plan import Plan, Stage, build_plan
from nanopt.training.validation import Batches, SpeedrunClock, evaluate, split_batches, token_bytes_table

log = logging.getLogger("nanopt")


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Batches, rt: Runtime,
               grad_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this rank's micro-batches: (mean loss, grad norm), on device, never waited for.
    Gradients are reduced across ranks on the last micro-step only (parallel.accumulating)."""
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
        grad_norm = parallel.clip_grad_norm(model, grad_clip) if grad_clip > 0 else torch.zeros((), device=rt.device)
        optimizer.step()
        # Under DDP the gradients are views of its buckets (gradient_as_bucket_view): zeroing them in place keeps
        # them there. Set to None, the next no_sync micro-steps would allocate a second set beside the buckets
        # and the last micro-step copy it in (tests/test_train.py measures it).
        optimizer.zero_grad(set_to_none=not parallel.grads_in_buckets(model))
    return loss_sum, grad_norm


def train(cfg: Config, rt: Runtime) -> dict[str, Any]:
    """Run (or resume) training; returns summary.json's contents (a finished run's, untouched). However the run
    ends, checkpointer, logs and the run directory's lock are closed."""
    rundirs.refuse_inside_checkpoints(cfg.run_dir, "--run.dir")  # another run would prune this one away
    with contextlib.ExitStack() as closing:  # closed last to first: checkpointer, metrics, the lock
        # Rank 0 locks the run directory for the whole torchrun; every rank raises when another process holds it.
        if (lock := rt.on_main(lambda: DirLock(cfg.run_dir).acquire(), (ConfigError, DiskFull))) is not None:
            closing.callback(lock.release)
        # checkpoint.resume=false asks for a fresh run: the checkpointer refuses a directory that is not empty.
        done = rt.gather_objects(finished_summary(cfg) if rt.is_main and cfg.checkpoint.resume else None)[0]
        if done is not None:
            return done
        metrics = MetricsLogger(cfg.run_dir, enabled=rt.is_main, tensorboard=cfg.log.tensorboard,
                                wandb_cfg={"project": cfg.log.wandb_project, "name": cfg.run.name,
                                           "config": cfg.to_dict()} if cfg.log.wandb else None)
        closing.callback(metrics.close)
        trainer = Trainer(cfg, rt, metrics)
        closing.callback(trainer.ckpt.close)  # mirror copies waited for, on a failure too
        return trainer.train()


class Trainer:
    """One session of a run: __init__ sets up (resumed from the newest checkpoint), train() loops, finish() ends.
    `model` is what is saved, evaluated and sampled; `train_model` what the step calls (compiled, under DDP)."""

    def __init__(self, cfg: Config, rt: Runtime, metrics: MetricsLogger):
        t = cfg.train
        self.cfg, self.rt, self.metrics = cfg, rt, metrics
        self.stop = faults.StopSignal(rt, cfg.run.time_limit_s)  # first: the time limit counts set-up too
        init_seed, data_seed = cfg.run.seeds
        random.seed(init_seed)
        np.random.seed(init_seed % 2**32)
        torch.manual_seed(init_seed)
        directory = data.data_dir(cfg, rt)
        # One checksum pass per node (its ranks read the same files); the others wait for its verdict.
        train_windows, val_windows = [data.open_split(directory, split, cfg, rt.local_rank == 0)
                                      for split in ("train", "val")]
        rt.barrier()
        self.tokenizer = get_tokenizer(cfg.data.tokenizer)
        self.plan = build_plan(t, rt.world_size)
        first = self.plan.stages[0]
        # Validation always reads windows, so val loss compares across data.packing.
        args = (t.micro_batch_size, rt.rank, rt.world_size, first.accum, data_seed)
        self.loader = data.Loader(train_windows, *args) if cfg.data.packing == "windows" else packing.PackedLoader(
            packing.Documents(train_windows.shards, self.tokenizer.bos_id, train_windows.infos), *args, t.seq_len,
            cfg.data.pack_buffer)
        attention_name, kernel = choose(cfg.model.attention, rt.kind, t.precision, rt.hardware_name())
        model = build_model(cfg.model, rt.device, kernel=kernel, loss_chunk_tokens=t.loss_chunk_tokens,
                            dtype=rt.param_dtype, init_device=rt.backend.init_device)  # XLA: the host RNG's init
        model.recompute_blocks = t.recompute  # train.recompute: each block's activations again in backward
        fp8.convert(model, cfg, rt)  # train.fp8: block Linears in FP8, before the optimizer, compile and DDP see them
        parallel.shard(model, cfg, rt)  # runtime.parallel=fsdp: sharded in place, before the optimizer takes the params
        self.model, self.optimizer = model, build_optimizer(model, t, rt, cfg.optim)
        self.state, clock, self.ema = RunState(), SpeedrunClock.for_config(cfg), EMA.for_config(cfg, model)
        self.states = {"run_state": self.state, "loader": self.loader, "speedrun": clock}  # saved besides weights
        # Exact resume (checkpoint.py): refuses a changed config or data, skips damaged checkpoints.
        self.ckpt = Checkpointer(cfg, rt, shards.split_paths(directory, "train"))
        saved = self.ckpt.restore(model, self.optimizer, self.states, self.ema)
        if saved is None and t.init_from:  # a fresh run warm-started from Hugging Face weights (a resume keeps its own)
            hf.init_from(model, t.init_from)
        if self.ema is not None:
            self.ema.begin(self.state.step)  # train.ema_start 0: the average starts from the initial weights
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
            log.warning("train.precision is %s, but %s has no bf16 hardware: torch emulates bf16, and a %d-wide "
                        "matmul (model.dim) measured %.0fx slower in bf16 than in fp32 here. Set "
                        "--train.precision=fp32 to train at this CPU's speed.", t.precision, rt.hardware_name(),
                        cfg.model.dim, bf16_slowdown(cfg.model.dim, rt.device))
        self.guard = faults.FiniteGuard(rt, self.state.step)  # a NaN/inf loss on any rank, with no per-step sync
        self.logger = StepLogger(cfg, rt, metrics, self.guard, self.state.step, self.plan)
        self.train_model = step_model(model, t, rt, self.plan)
        # XLA: the whole step as one graph, compiled once per step shape (a schedule's stages may each bring one).
        self.train_step = rt.backend.compile_step(train_step, self.optimizer, shapes=len(self.plan.stages))
        self.evaluator = Validator(cfg, rt, model, directory, val_windows, self.tokenizer, metrics, clock, self.ema)
        self.tasks = TaskScorer(cfg, rt, model, self.tokenizer)
        self.started = time.perf_counter()  # this session's loop starts

    def train(self) -> dict[str, Any]:
        """Steps until max_steps, the speedrun target (stop_at_target), or a stop signal (checkpoint, Preempted);
        then finish(). Training time runs from the data to the logger's sync."""
        cfg, rt, state, t = self.cfg, self.rt, self.state, self.cfg.train
        with profiling.profiler(cfg, rt, state.step, self.metrics) as profiler:  # a no-op unless profile.enabled
            if state.step == 0 and self.evaluator.due(0):
                self.evaluator.run(state)
            while state.step < t.max_steps:
                stage = self.plan.at(state.step, state.tokens_seen)
                if stage != self.logger.stage:
                    self.logger.enter(stage, state.step)
                apply_schedule(self.optimizer, lr_multiplier(state.step, t) * stage.lr_factor)
                t0 = time.perf_counter()
                with profiling.label(profiling.DATA):
                    micro_batches = self.loader.micro_batches(stage.accum, stage.seq_len)
                loss, grad_norm = self.train_step(self.train_model, self.optimizer, micro_batches, rt, t.grad_clip)
                if self.ema is not None:
                    with profiling.label(profiling.OPTIMIZER):
                        self.ema.update(state.step + 1)  # on the device's queue like the step: training time
                self.guard.update(loss)
                faults.fault_hook("kill-in-step", state.step + 1, rt.rank)
                state.step += 1
                state.tokens_seen += stage.batch_tokens
                loss_value = self.logger.end_step(state.step, loss, self.ckpt.latest, self.pause_follows(state.step))
                seconds = time.perf_counter() - t0
                state.train_seconds += seconds
                if loss_value is not None:
                    self.logger.log(state, loss_value, self.optimizer.param_groups[0]["lr"], grad_norm, seconds,
                                    self.loader.metrics())
                profiler.step()
                if self.evaluator.due(state.step):
                    self.evaluator.run(state)
                    if t.stop_at_target and self.evaluator.clock.reached:
                        break
                scoring = self.tasks.due(state.step)
                if scoring or self.ckpt.should_save(state.step):
                    self.save()  # before scoring: a scoring failure or a kill during it costs no trained step
                if scoring:
                    self.tasks.run(state.step, self.evaluator.weights())
                if self.pause_follows(state.step):
                    self.logger.reopen(state.step)  # the pause is not billed to the next window's steps
                faults.fault_hook("pause", state.step, rt.rank, cfg.run_dir)
                if self.stop.should_stop() and state.step < t.max_steps:
                    raise Preempted(self.stop.signame, state.step, self.save())
        return self.finish()

    def finish(self) -> dict[str, Any]:
        """Final evaluation (val, then test), the last checkpoint, summary.json and samples."""
        cfg, rt, state, evaluator, clock = self.cfg, self.rt, self.state, self.evaluator, self.evaluator.clock
        if evaluator.last_step != state.step:
            evaluator.run(state)
        test_eval = evaluator.test(state.step)
        self.save()  # before scoring, which may fail (recorded) or be killed: the last step is kept either way
        if self.tasks.spec and self.tasks.last_step != state.step:
            self.tasks.run(state.step, evaluator.weights())
        self.ckpt.close()  # wait for the copy to checkpoint.mirror
        summary = {
            "run": cfg.run.name, "steps": state.step, "tokens_seen": state.tokens_seen,
            "train_seconds": state.train_seconds, "wall_seconds_this_session": time.perf_counter() - self.started,
            "final_val_loss": evaluator.last.get("val_loss"), "final_val_bpb": evaluator.last.get("val_bpb"),
            "best_val_loss": state.best_val_loss, "best_val_bpb": state.best_val_bpb,
            "world_size": rt.world_size, "device": rt.kind,
            "hardware": rt.hardware_name(), "params": self.model.num_params(), **self.logger.meter.summary(),
            **fp8.summary(cfg, (self.logger.stage or self.plan.at(state.step, state.tokens_seen)).seq_len),
            "packing_cropped_share": self.loader.metrics().get("cropped_share"),  # null under windows
            # One digest per rank: DDP replicas that drifted apart would show different values here.
            "weights_sha256_per_rank": rt.gather_objects(weights_digest(self.model)),
            **peak_memory_per_rank(rt.peak_memory_by_rank()),
            **test_eval, **clock.summary(), "tasks_seconds": self.tasks.seconds if self.tasks.spec else None,
            "stopped_at_target": state.step < cfg.train.max_steps and cfg.train.stop_at_target and clock.reached,
            "eval_weights": "ema" if evaluator.ema is not None and evaluator.ema.started else "model",
        }
        if rt.is_main:
            write_json(cfg.run_dir / rundirs.SUMMARY_FILE, summary)
            if cfg.log.curves:
                plots.curves_quietly(cfg.run_dir)  # curves.png; a log line, never an error, when it cannot be drawn
        self.print_samples()
        if rt.is_main:
            log.info("done: %d steps, %s tokens in %s of training; run directory %s", state.step,
                     f"{state.tokens_seen:,}", format_duration(state.train_seconds), cfg.run_dir)
            if missed := clock.missed(state.step, state.best_val_loss, state.best_val_bpb):
                log.info("%s", missed)
        return summary

    def pause_follows(self, step: int) -> bool:
        """Whether a pause (evaluation, scoring, checkpoint, the end) follows this step: its device work is then
        waited for inside the training clock."""
        return (step >= self.cfg.train.max_steps or self.evaluator.due(step) or self.tasks.due(step)
                or self.ckpt.should_save(step))

    def save(self) -> Path:
        """Checkpoint now (every rank), never a diverged model over the last good one."""
        self.guard.check(self.state.step, self.ckpt.latest, self.model)
        return self.ckpt.save(self.state.step, self.model, self.optimizer, self.states, self.ema)

    def print_samples(self) -> None:
        s = self.cfg.sample
        # A sharded model's forward gathers from every rank, so all sample together (one seed: the same tokens).
        if not s.num_samples or not (self.rt.is_main or parallel.is_sharded(self.model)):
            return
        with self.evaluator.weights() as weights:
            samples = sample_text(self.model, self.tokenizer, s.prompt, s.num_samples, s.max_new_tokens,
                                  s.temperature, s.top_k, self.cfg.run.seed, self.rt.device)
        if not self.rt.is_main:
            return
        of = f" ({weights} weights)" if self.evaluator.ema is not None else ""
        print(f"\n--- {len(samples)} samples from step {self.state.step}{of}, prompt {s.prompt!r} ---")
        print("".join(f"{text.strip()}\n---\n" for text in samples), end="")
        self.metrics.text("samples", "\n\n---\n\n".join(samples), self.state.step)


@dataclasses.dataclass
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
            # A damaged state.json (checkpoint.py names the file). Counters are integers; seconds and losses numbers,
            # the losses (default None) null before a first evaluation.
            kind = "an integer" if f.type == "int" else "a number" + (" or null" if f.default is None else "")
            if not (is_int(value) if f.type == "int" else is_number(value) or value is None is f.default):
                raise TypeError(f"`{f.name}` is {value!r}, not {kind}")
            setattr(self, f.name, value)


class StepLogger:
    """On a session's first step, every `log.every` steps and the last: the window's one host sync, then one
    console line and one metrics record."""

    def __init__(self, cfg: Config, rt: Runtime, metrics: MetricsLogger, guard: faults.FiniteGuard,
                 start_step: int, plan: Plan):
        self.cfg, self.rt, self.metrics, self.guard, self.plan = cfg, rt, metrics, guard, plan
        self.start_step, self.meter = start_step, mfu.meter_for_run(cfg, rt, start_step)  # all ranks: CPU peak once
        self.stage: Optional[Stage] = None  # the stage the loop is in, None before a session's first step
        # The speed window (when, after which step): opened after a session's or stage's first step (compilation
        # left out) and again after a pause, which is then not billed to the steps after it.
        self.opened: Optional[tuple[float, int]] = None

    def enter(self, stage: Stage, step: int) -> None:
        """A new stage: the meter counts its tokens and FLOPs, in a fresh window (a recompile left out)."""
        self.stage, self.opened = stage, None
        self.meter.set_stage(stage.batch_tokens, stage.seq_len)  # FLOPs/token at this seq_len too
        if self.rt.is_main and len(self.plan.stages) > 1:
            log.info("stage %d from step %d: %s tokens/step, seq %d, accum %d, lr x%.2f", stage.number, step,
                     f"{stage.batch_tokens:,}", stage.seq_len, stage.accum, stage.lr_factor)

    def due(self, step: int) -> bool:
        return step % self.cfg.log.every == 0 or step == self.cfg.train.max_steps or step == self.start_step + 1

    def end_step(self, step: int, loss: torch.Tensor, last_good: Optional[Path], pause: bool) -> Optional[float]:
        """On a logging step the window's host sync (NaN check, the loss averaged over ranks, returned); before a
        pause a plain sync, so the queued work is billed to training; None on other steps, which do not wait."""
        value = None
        if self.due(step):
            self.guard.check(step, last_good)
            self.rt.all_reduce_sum(loss)
            value = loss.item() / self.rt.world_size
        if value is not None or pause:
            self.rt.sync()
        if self.opened is None:
            self.reopen(step)
        return value

    def reopen(self, step: int) -> None:
        self.opened = (time.perf_counter(), step)

    def log(self, state: RunState, loss: float, lr: float, grad_norm: torch.Tensor, step_seconds: float,
            extra: dict[str, float]) -> None:
        t, tokens = self.cfg.train, self.stage.batch_tokens
        (opened_at, opened_step), now = self.opened, time.perf_counter()
        steps = state.step - opened_step  # 0: the window's opening step, timed alone (step_seconds)
        step_s = (now - opened_at) / steps if steps > 0 else step_seconds
        self.opened = (now, state.step)
        values = {
            "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
            "tokens_per_s": tokens / step_s, "step_ms": 1000 * step_s,
            **self.meter.update(state.step, steps, step_s),
            **peak_memory(self.rt.peak_memory_by_rank()),
            "tokens_seen": state.tokens_seen,
            "eta_s": step_s * self.plan.tokens_left(state.step) / tokens, **extra,
        }
        self.metrics.log(state.step, values)
        if self.rt.is_main:
            log.info(step_line(state.step, t.max_steps, values, self.meter.basis, self.rt.world_size))


class Validator:
    """Validation every `eval.every` steps, at step 0 (eval.at_start) and at the end: loss, bpb, best loss, the
    speedrun clock; of the averaged weights under eval.weights=ema."""

    def __init__(self, cfg: Config, rt: Runtime, model: torch.nn.Module, directory: Path, windows: data.TokenWindows,
                 tokenizer: Tokenizer, metrics: MetricsLogger, clock: SpeedrunClock, ema: Optional[EMA] = None):
        self.cfg, self.rt, self.model, self.directory, self.metrics = cfg, rt, model, directory, metrics
        self.clock, self.ema = clock, ema if cfg.eval.weights == "ema" else None
        self.batches = data.eval_batches(windows, cfg.train.micro_batch_size, cfg.eval.batches, rt.rank,
                                         rt.world_size, cfg.eval.seed)
        self.token_bytes = token_bytes_table(tokenizer, cfg.model.vocab_size, rt.device)
        self.last: dict[str, float] = {}
        self.last_step: Optional[int] = None  # this session's last evaluation

    def due(self, step: int) -> bool:
        every = self.cfg.eval.every
        return bool(every) and (self.cfg.eval.at_start if step == 0 else
                                step % every == 0 and step != self.cfg.train.max_steps)

    def run(self, state: RunState) -> None:
        val_loss, val_bpb = self._measure("val", self.batches, state.step, tokens_seen=state.tokens_seen,
                                          train_seconds=state.train_seconds)
        if state.best_val_loss is None or val_loss < state.best_val_loss:
            state.best_val_loss = val_loss
        if state.best_val_bpb is None or val_bpb < state.best_val_bpb:
            state.best_val_bpb = val_bpb
        self.clock.observe(val_loss, val_bpb, state.step, state.tokens_seen, state.train_seconds, self.rt)
        self.last, self.last_step = {"val_loss": val_loss, "val_bpb": val_bpb}, state.step

    def test(self, step: int) -> dict[str, float]:
        """The test split's loss and bpb ({} when off or without test shards)."""
        e = self.cfg.eval
        batches = split_batches(self.cfg, self.rt, self.directory, "test", e.batches) if e.test_at_end else None
        if batches is None:
            return {}
        loss, bpb = self._measure("test", batches, step)
        return {"test_loss": loss, "test_bpb": bpb}

    def weights(self) -> contextlib.AbstractContextManager[str]:
        """The weights evaluations use, in the model for the duration; yields their name."""
        return self.ema.swapped() if self.ema is not None else contextlib.nullcontext("model")

    def _measure(self, split: str, batches: Batches, step: int, **extra: Any) -> tuple[float, float]:
        with self.weights() as weights:
            loss, bpb = evaluate(self.model, batches, self.token_bytes, self.rt)
        self.metrics.log(step, {f"{split}_loss": loss, f"{split}_bpb": bpb, **extra, "weights": weights})
        if self.rt.is_main:
            of = f" ({weights} weights)" if self.ema is not None else ""
            log.info("step %6d | %s loss %.4f | %s bpb %.4f%s", step, split, loss, split, bpb, of)
        return loss, bpb


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes (this rank's shards of a sharded model), in a fixed order."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(parallel.local_tensor(p).detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def step_model(model: torch.nn.Module, t: TrainConfig, rt: Runtime, plan: Plan) -> torch.nn.Module:
    """The model train_step calls: compiled under train.compile, then wrapped for DDP (parallel.wrap)."""
    return parallel.wrap(compiled(model, t, plan, rt.distributed) if t.compile else model, rt)


def ddp_split(t: TrainConfig) -> bool:
    """Whether a model compiled under DDP is split at DDP's buckets (train.compile_ddp_split; null: unless train.fp8
    is on, since FP8 + compile + the split fails upstream: pytorch/pytorch#158936, pytorch/ao#2586)."""
    return t.fp8 == "none" if t.compile_ddp_split is None else t.compile_ddp_split


def compiled(model: torch.nn.Module, t: TrainConfig, plan: Plan, ddp: bool = False) -> torch.nn.Module:
    """torch.compile for train.compile: the whole model, or each block when sharded (compile_blocks). Static shapes
    under a seq_len schedule: dynamo would recompile a second length with T dynamic, and every later stage would run
    that slower graph. Under DDP (`ddp`), ddp_split chooses whether the graph is split at DDP's buckets."""
    torch._dynamo.config.optimize_ddp = ddp_split(t)
    if ddp and not ddp_split(t) and t.compile_ddp_split is None and not parallel.is_sharded(model):
        log.info("compile: one graph under DDP, its all-reduces not overlapping the backward: train.fp8 is on, and "
                 "FP8 + compile + DDP's graph split fails upstream (pytorch/pytorch#158936); "
                 "--train.compile_ddp_split=true splits it anyway")
    lengths = len({s.seq_len for s in plan.stages})
    static: dict[str, Any] = {"dynamic": False} if lengths > 1 else {}
    # Dynamo's recompile limit must not send a late stage to eager: two graphs per length for torch 2.9's frame
    # around an FSDP-managed block, whose guards tell the first block (input x0 itself) from the others.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * lengths)
    if parallel.is_sharded(model):
        compile_blocks(model, **static)
        return model
    return torch.compile(model, **static)


def compile_blocks(model: torch.nn.Module, **options: Any) -> None:
    """A sharded model compiled per block (torchtitan's apply_compile). FSDP2's hooks around each block (all-gather,
    reshard, the gradient reduce-scatter) are not traced by dynamo, so a whole-model graph would break at every
    block anyway; the blocks share one compiled code (dynamo guards on structure, not identity), so compile time
    does not grow with depth. Kept in Llama.training_blocks, which only the training forward calls, not in the
    module tree: compiled modules there would rename the state_dict keys (`_orig_mod.`), and validation, task
    scoring and KV-cache decoding would each compile shapes of their own and hit the recompile limit."""
    model.training_blocks = [torch.compile(block, **options) for block in model.layers]


def finished_summary(cfg: Config) -> Optional[dict[str, Any]]:
    """This run's summary when it is already finished (a re-run changes nothing and says how to go on); a config
    change it would silently ignore is refused. On the main rank."""
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
    longer = ("--train.stop_at_target=false continues it to train.max_steps" if summary.get("stopped_at_target")
              else "a longer run: raise train.max_steps")
    log.info("%s is finished; nothing to train (%s; another run: set run.dir). %s", cfg.run_dir, longer,
             summary_line(summary))
    return summary
