"""To and from Hugging Face transformers' LlamaForCausalLM: config.json + safetensors (+ tokenizer files). nanopt's
Llama already uses Hugging Face's rotate-half RoPE layout, so conversion is renaming only (no q/k permutation).
`nanopt export` writes a directory transformers loads; `train.init_from=hf:DIR` and `load_model(DIR)` read one back."""
from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nanopt import rundirs, schema
from nanopt.config import Config, ModelConfig, config_from_dict, model_from_dict
from nanopt.data.tokenizer import get_tokenizer
from nanopt.distributed import parallel
from nanopt.errors import ConfigError
from nanopt.io import as_disk_full, disk_full, fsync, read_json, refuse_link, write_json, writing
from nanopt.recipe.model import Llama, build_model

log = logging.getLogger("nanopt")

# nanopt name -> Hugging Face name, within layer i (layers.{i}. -> model.layers.{i}.) and at the top level.
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight", "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}
# Buffers some transformers versions saved; they follow from the config.
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
# Architecture keys that must agree between a run's config and a Hugging Face directory it starts from.
_ARCH_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "norm_eps", "rope_theta",
              "rope_scaling", "tie_embeddings")
# nanopt's model keys under config.json's names, one table both ways (hf_config, model_config_from_hf); the llama3
# factors under rope_parameters' names; transformers' LlamaConfig defaults, for keys a config.json leaves out.
_KEYS = {"vocab_size": "vocab_size", "dim": "hidden_size", "ffn_dim": "intermediate_size", "n_layers":
         "num_hidden_layers", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "max_seq_len":
         "max_position_embeddings", "norm_eps": "rms_norm_eps", "init_std": "initializer_range",
         "tie_embeddings": "tie_word_embeddings"}
_LLAMA3_KEYS = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor", "rope_high_freq_factor":
                "high_freq_factor", "rope_original_max_seq_len": "original_max_position_embeddings"}
_HF_DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
                "tie_word_embeddings": False, "rope_theta": 10000.0}
# nanopt's opt-in architecture options and the value that means off: LlamaForCausalLM has none of them.
_OPTIONS_OFF: dict[str, Any] = {"qk_norm": False, "mlp": "swiglu", "logit_softcap": 0.0, "value_embeddings": False,
                                "residual_scalars": False, "parametrization": "sp"}
# A model's files in a Hugging Face directory: what export_model writes (config.json, model.safetensors, nanopt.json
# and the tokenizer's files, whose names vary with the tokenizer's kind and transformers' version), and what
# transformers' save_pretrained writes instead or beside them. Left beside another model's, any of them makes a
# directory that loads as a model it is not, so an export replaces all of them or refuses.
MODEL_FILES = frozenset({
    "config.json", "model.safetensors", "nanopt.json", "generation_config.json", "model.safetensors.index.json",
    "pytorch_model.bin", "pytorch_model.bin.index.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json", "tokenizer.model",
    "spiece.model", "vocab.json", "vocab.txt", "merges.txt"})
_WEIGHT_SHARD = re.compile(r"^(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)$")
# nanopt.json, beside an export's config.json: what nanopt reads back of the run (its config).
NANOPT_JSON = schema.Field(dict, fields={"config": schema.Field(dict, required=True)})


def _value(v: Any) -> str:
    """A value as a --section.key=value override writes it: true, relu2, 30.0."""
    return json.dumps(v).strip('"')


def _options_on(m: ModelConfig) -> Optional[tuple[str, str]]:
    """None for a plain Llama, else what is set and the overrides that turn it off, for error messages."""
    on = [k for k, off in _OPTIONS_OFF.items() if getattr(m, k) != off]
    return (", ".join(f"model.{k}={_value(getattr(m, k))}" for k in on),
            " ".join(f"--model.{k}={_value(_OPTIONS_OFF[k])}" for k in on)) if on else None


def check_exportable(m: ModelConfig) -> None:
    """ConfigError for an option LlamaForCausalLM cannot represent (it would compute something else, or fail)."""
    if options := _options_on(m):
        text, offs = options
        raise ConfigError(f"this model cannot be exported to Hugging Face: it sets {text}, which transformers' "
                          f"LlamaForCausalLM cannot represent. To export, train with them off ({offs}); otherwise "
                          f"use the nanopt checkpoint directly (`nanopt sample`, `nanopt eval`, `nanopt.load_model`).")


def _hf_name(name: str) -> str:
    """A plain Llama's weight under its Hugging Face name; KeyError for one it has no name for."""
    layer = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    return f"model.layers.{layer[1]}.{_LAYER_NAMES[layer[2]]}" if layer else _TOP_NAMES[name]


def hf_config(m: ModelConfig, bos_id: Optional[int], eos_id: Optional[int], dtype: str = "float32") -> dict[str, Any]:
    """config.json for LlamaForCausalLM. Both spellings of RoPE settings are written: `rope_theta` +
    `rope_scaling` (transformers 4.x) and `rope_parameters` (transformers 5.x)."""
    llama3 = m.rope_scaling == "llama3"
    rope = {"rope_type": "llama3", **{hf: getattr(m, k) for k, hf in _LLAMA3_KEYS.items()}} if llama3 else \
        {"rope_type": "default"}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **{hf: getattr(m, k) for k, hf in _KEYS.items()},
        "head_dim": m.head_dim, "hidden_act": "silu", "max_position_embeddings": m.max_seq_len or 2048,
        "rope_theta": m.rope_theta, "rope_scaling": rope if llama3 else None,
        "rope_parameters": {**rope, "rope_theta": m.rope_theta}, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "pretraining_tp": 1, "use_cache": True, "bos_token_id": bos_id,
        "eos_token_id": eos_id, "pad_token_id": None, "torch_dtype": dtype,
    }


def model_config_from_hf(hf: Any, where: Path) -> ModelConfig:
    """A ModelConfig from a Hugging Face Llama config.json, checked as a config file's model keys are."""
    if not isinstance(hf, dict):
        raise ConfigError(f"{where}/config.json is not a JSON object; a Hugging Face model's config.json maps "
                          f"hidden_size, num_attention_heads, ... to their values.")
    archs = hf.get("architectures") or []
    if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise ConfigError(f"{where}/config.json describes a {hf.get('model_type') or archs!r} model; nanopt reads "
                          f"Llama models only (model_type: llama).")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError(f"{where}/config.json uses hidden_act={hf.get('hidden_act')!r}, attention_bias="
                          f"{hf.get('attention_bias')}, mlp_bias={hf.get('mlp_bias')}; nanopt's Llama is SwiGLU "
                          f"(silu) without biases.")
    # A missing key or a null is transformers' LlamaConfig default.
    hf = {**_HF_DEFAULTS, "num_key_value_heads": hf.get("num_attention_heads"),
          **{k: v for k, v in hf.items() if v is not None}}
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}/config.json: `rope_parameters` / `rope_scaling` is {rope!r}, not an object.")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"{where}/config.json uses RoPE scaling {rope_type!r}; nanopt implements `default` and "
                          f"`llama3` only.")
    model = {k: hf.get(name) for k, name in _KEYS.items()}
    model.update(rope_theta=rope.get("rope_theta", hf["rope_theta"]), tie_embeddings=bool(model["tie_embeddings"]))
    if rope_type == "llama3":
        model.update(rope_scaling="llama3", **{k: rope.get(name) for k, name in _LLAMA3_KEYS.items()})
    m = model_from_dict(model, f"{where}/config.json (read as nanopt's model section)")
    if hf.get("head_dim", m.head_dim) != m.head_dim:
        raise ConfigError(f"{where}/config.json has head_dim {hf['head_dim']!r} with {m.n_heads} heads and "
                          f"hidden_size {m.dim}; nanopt needs head_dim = hidden_size / num_attention_heads.")
    return m


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor in a Hugging Face directory: model.safetensors, sharded safetensors, or pytorch_model.bin."""
    files = [directory / n for n in ("model.safetensors", "pytorch_model.bin") if (directory / n).is_file()][:1]
    index = directory / "model.safetensors.index.json"
    if index.is_file() and not (directory / "model.safetensors").is_file():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and "/" not in v and v
                                                       for v in weight_map.values()):  # a shard inside directory
            raise ConfigError(f"{index} has no `weight_map` of tensor names to shard file names in {directory}; "
                              f"the file is damaged.")
        files = [directory / shard for shard in sorted(set(weight_map.values()))]
    elif not files:
        raise ConfigError(f"{directory} has a config.json but no weights (model.safetensors, "
                          f"model.safetensors.index.json or pytorch_model.bin).")
    return {name: t for path in files for name, t in _read_weights(path).items()}


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (or a pytorch_model.bin's, weights only); ConfigError naming it if it is none."""
    try:
        weights = (load_file(str(path)) if path.suffix == ".safetensors" else
                   torch.load(path, map_location="cpu", weights_only=True))
    except (OSError, SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError, KeyError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as model weights ({e.__class__.__name__}: {e}); the file is "
                          f"damaged or missing: save the model again (save_pretrained, or nanopt export).") from None
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise ConfigError(f"{path} holds no mapping of tensor names to tensors; save the model again.")
    return weights


def load_hf_weights(model: Llama, directory: Path) -> None:
    """Copy a Hugging Face directory's weights into `model`, converting dtype; a sharded model keeps each rank's
    shard (every rank calls it)."""
    names = {_hf_name(name): name for name in model.state_dict()}  # theirs -> ours
    theirs = {name: t for name, t in read_hf_weights(directory).items() if not _HF_IGNORED.search(name)}
    if unknown := next((name for name in theirs if name not in names), None):
        raise ConfigError(f"{directory}: no nanopt name for Hugging Face weight {unknown!r}; only plain Llama "
                          f"weights can be imported.")
    tied = {"lm_head.weight"} if model.cfg.tie_embeddings else set()  # its weight is the embedding's
    ours = {names[name]: t for name, t in theirs.items() if names[name] not in tied}  # transformers may store it too
    try:
        missing, unexpected = parallel.load_weights(model, ours)
    except RuntimeError as e:  # shape mismatch
        raise ConfigError(f"the weights in {directory} do not fit the model: {e}") from None
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ConfigError(f"the weights in {directory} do not match a Llama of its config.json: missing "
                          f"{missing[:5]}, unexpected {unexpected[:5]}.")


def load_hf(directory: str | Path, device: str | torch.device = "cpu") -> tuple[Llama, Config]:
    """(model in eval mode, config) from a Hugging Face Llama directory: nanopt's own config when nanopt exported it
    (nanopt.json), else the defaults; the model section from config.json, data.tokenizer the directory when it holds
    tokenizer files ("" if none)."""
    directory = Path(directory)
    mcfg = model_config_from_hf(read_json(directory / "config.json"), directory)
    extra = directory / "nanopt.json"
    saved = schema.read(extra, NANOPT_JSON, "Export the run again (nanopt export).")
    cfg = Config() if saved is None else config_from_dict(saved["config"], str(extra))
    cfg.model = mcfg
    if any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        cfg.data.tokenizer = str(directory)
    elif saved is None:
        cfg.data.tokenizer = ""
    model = build_model(mcfg, device)
    load_hf_weights(model, directory)
    model.eval()
    return model, cfg


def init_from(model: Llama, spec: str) -> None:
    """`train.init_from=hf:DIR`: DIR's weights into the fresh model, once the run's architecture matches DIR's."""
    directory = Path(spec[3:])
    if not (directory / "config.json").is_file():
        raise ConfigError(f"`train.init_from` is {spec!r} but {directory}/config.json does not exist; point it at a "
                          f"directory written by `nanopt export` or transformers' save_pretrained.")
    theirs = model_config_from_hf(read_json(directory / "config.json"), directory)
    ours = model.cfg
    if options := _options_on(ours):  # a plain Llama has no weights for them, or they mean something else
        text, offs = options
        raise ConfigError(f"`train.init_from` {directory} holds a plain Llama (transformers' LlamaForCausalLM), but "
                          f"the run's model config sets {text}, which that architecture does not have; "
                          f"start from it with them off ({offs}) or train from scratch (train.init_from=\"\").")
    # The llama3 factors only matter when both sides use llama3 scaling.
    keys = _ARCH_KEYS + (tuple(_LLAMA3_KEYS) if ours.rope_scaling == theirs.rope_scaling == "llama3" else ())
    if differ := [k for k in keys if getattr(ours, k) != getattr(theirs, k)]:
        fixes = " ".join(f"--model.{k}={_value(getattr(theirs, k))}" for k in differ)
        raise ConfigError(f"`train.init_from` {directory} has a different architecture from the run's model config "
                          f"({', '.join(f'model.{k}: {getattr(ours, k)} vs {getattr(theirs, k)}' for k in differ)}); "
                          f"set them to match: {fixes}")
    load_hf_weights(model, directory)
    log.info("initialised the model from %s", directory)


def is_model_file(name: str) -> bool:
    return name in MODEL_FILES or bool(_WEIGHT_SHARD.match(name))


def model_files(directory: Path) -> list[str]:
    """The names in `directory` that are a model's files (links included: they are refused, never followed)."""
    return sorted(e.name for e in os.scandir(directory) if is_model_file(e.name)) if directory.is_dir() else []


def check_export_target(out: str | Path, force: bool = False) -> None:
    """ConfigError (exit 2) before anything is loaded or written, when `out` cannot take an export: it or a folder
    above it is a file; it is a nanopt checkpoint; a model file there is a symbolic link (never written through or
    removed blind); or, without `force`, it holds another model's files, which an export would mix with its own."""
    out = Path(out)
    rundirs.refuse_inside_checkpoints(out)
    if not (blocker := next(p for p in (out, *out.parents) if os.path.lexists(p))).is_dir():  # a file, a dangling link
        what = "a symbolic link to nothing" if blocker.is_symlink() and not blocker.exists() else "a file"
        below = "" if blocker == out else f", so --out {out} below it cannot be a directory"
        raise ConfigError(f"{blocker} is {what}{below}; `nanopt export --out` names a directory to write the model's "
                          f"files into (config.json, model.safetensors, ...). Choose an --out that is a directory or "
                          f"does not exist yet; nothing was written.")
    if any((out / name).exists() for name in (rundirs.COMPLETE_FILE, rundirs.STATE_FILE)):
        raise ConfigError(f"{out} is a nanopt checkpoint directory; an export there would replace its "
                          f"{rundirs.MODEL_FILE}. Export to a directory of its own: --out {out.parent / 'hf'}.")
    present = model_files(out)
    for name in present:
        refuse_link(out / name)
    if present and not force:
        raise ConfigError(f"{out} already holds another model's files ({', '.join(present)}); exporting there would "
                          f"leave them beside the new weights, a directory that loads as a model it is not. Export "
                          f"to a new directory, or add --force to replace that model: those files are removed or "
                          f"replaced by the new export's, and the directory's other files are kept.")


def export_model(model: Llama, out: str | Path, tokenizer: str = "byte", nanopt_cfg: Optional[Config] = None,
                 dtype: torch.dtype = torch.float32, meta: Optional[dict[str, Any]] = None,
                 force: bool = False) -> Path:
    """Write `model` as a Hugging Face LlamaForCausalLM directory (tokenizer files too for an HF tokenizer), or raise
    ConfigError before writing anything. The files are staged in a hidden folder inside `out` and moved in at the
    end: `out` holds the whole new model or, after a failure (a full disk: DiskFull), what it held before."""
    check_exportable(model.cfg)
    out = Path(out)
    check_export_target(out, force)
    out.mkdir(parents=True, exist_ok=True)
    tok = get_tokenizer(tokenizer) if tokenizer else None
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out))  # a new folder: no link of anyone's inside
    try:
        _write_files(staging, model, tok, nanopt_cfg, dtype, meta)
        _install(staging, out, force)
    except Exception as e:
        if (full := as_disk_full(e, out)) is None:
            raise
        shutil.rmtree(staging, ignore_errors=True)  # first, so the free space named is what a second try has
        # The staged file's path as `out` will hold it: the name a user looks for.
        raise disk_full(out / full.path.relative_to(staging) if full.path.is_relative_to(staging) else full.path) from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _write_files(staging: Path, model: Llama, tok: Any, nanopt_cfg: Optional[Config], dtype: torch.dtype,
                 meta: Optional[dict[str, Any]]) -> None:
    """Every file of the export, into `staging`, each on disk (fsync) before any is moved into place."""
    if tok is not None and hasattr(tok, "hf"):
        with writing(staging):
            tok.hf.save_pretrained(str(staging))
    bos, eos = (tok.bos_id, tok.eos_id) if tok is not None else (None, None)
    tied = model.cfg.tie_embeddings  # a tied head is stored once, as the embedding
    state = {_hf_name(name): t.detach().to("cpu", dtype).contiguous() for name, t in model.state_dict().items()
             if not (tied and name == "lm_head.weight")}
    with writing(staging / "model.safetensors"):
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
    write_json(staging / "config.json", hf_config(model.cfg, bos, eos, str(dtype).removeprefix("torch.")))
    if nanopt_cfg is not None:
        # Not read by transformers: lets nanopt recover the tokenizer and sequence length it trained with.
        write_json(staging / "nanopt.json", {"config": nanopt_cfg.to_dict(), **(meta or {})})
    for entry in os.scandir(staging):
        fsync(Path(entry.path))


def _install(staging: Path, out: Path, force: bool) -> None:
    """Move the staged files into `out`, which never holds two models' files at once: the old config.json goes first
    (without one a directory is no model), the new one last. Renames and removals only: nothing written via a link."""
    new = sorted(os.listdir(staging), key=lambda name: name == "config.json")
    # A file the tokenizer wrote that is not on MODEL_FILES but has a user's file's name: that is the user's.
    taken = [name for name in new if not is_model_file(name) and os.path.lexists(out / name)]
    for name in taken:
        refuse_link(out / name)
    if taken and not force:
        raise ConfigError(f"{out} holds {', '.join(taken)}, which the export writes too (the tokenizer's files); "
                          f"export to a new directory, or add --force to replace them with the new export's.")
    for name in ["config.json", *(name for name in model_files(out) if name not in new)]:
        (out / name).unlink(missing_ok=True)
    for name in new:
        os.replace(staging / name, out / name)
    fsync(out)
