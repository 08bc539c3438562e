"""Hugging Face conversion (nanopt/hf.py): exports load in transformers and transformers' models in nanopt with matching
logits, the tokenizer's files go along, a damaged directory is one paragraph. Trained runs: e2e/test_eval_and_export."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import fork_ranks, hf_logits, hf_tokenizer, stub_runtime, transformers_model
from safetensors.torch import load_file, save_file

from nanopt.config import ModelConfig, load_config, parse_overrides
from nanopt.distributed import parallel
from nanopt.errors import ConfigError
from nanopt.hf import export_model, init_from, load_hf
from nanopt.recipe.model import build_model

# ---------------------------------------------------------------- Hugging Face export / import

PARITY = {
    "gqa-tied": dict(n_heads=4, n_kv_heads=2, tie_embeddings=True),
    "mqa-untied-llama3": dict(n_heads=4, n_kv_heads=1, tie_embeddings=False, rope_scaling="llama3",
                              rope_factor=8.0, rope_original_max_seq_len=16, rope_theta=500000.0),
    "gqa-tied-llama3": dict(n_heads=8, n_kv_heads=2, tie_embeddings=True, rope_scaling="llama3", rope_factor=4.0,
                            rope_low_freq_factor=2.0, rope_high_freq_factor=8.0, rope_original_max_seq_len=32),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY))
def test_export_loads_in_transformers_with_matching_logits(name, tmp_path):
    torch.manual_seed(len(name))
    cfg = ModelConfig(vocab_size=101, dim=64, n_layers=2, ffn_dim=96, max_seq_len=64, init_std=0.1, **PARITY[name])
    model = build_model(cfg).eval()
    export_model(model, tmp_path, tokenizer="")
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["tie_word_embeddings"] == cfg.tie_embeddings and hf_cfg["head_dim"] == 64 // cfg.n_heads
    if cfg.rope_scaling == "llama3":
        assert hf_cfg["rope_scaling"] == {"rope_type": "llama3", "factor": cfg.rope_factor,
                                          "low_freq_factor": cfg.rope_low_freq_factor,
                                          "high_freq_factor": cfg.rope_high_freq_factor,
                                          "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    idx = torch.randint(0, 101, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(idx), hf_logits(tmp_path, idx)
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert ours.abs().max().item() > 0.5  # the logits carry signal, not all ~0
    if cfg.rope_scaling == "llama3":  # and the scaling is exercised: plain RoPE gives other logits
        cfg.rope_scaling = "none"
        plain = build_model(cfg).eval()
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (plain(idx) - theirs).abs().max().item() > 1e-3


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_transformers_saved_model_loads_into_nanopt_with_matching_logits(tied, tmp_path):
    from nanopt import load_model

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 500000.0}
    model = load_model(directory := transformers_model(tmp_path, tied, rope_parameters=rope))
    assert not model.training and model.cfg.rope_scaling == "llama3" and model.cfg.tie_embeddings == tied
    idx = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(idx) - hf_logits(directory, idx)).abs().max().item() <= 1e-4


def test_export_includes_hugging_face_tokenizer_files(tmp_path):
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained(str(hf_tokenizer(tmp_path / "tok")))
    model = build_model(ModelConfig(vocab_size=len(original), dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                    ffn_dim=64, max_seq_len=16))
    export_model(model, tmp_path / "hf", tokenizer=str(tmp_path / "tok"))
    copied = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert copied.encode("Elementary, my dear") == original.encode("Elementary, my dear")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (original.bos_token_id, original.eos_token_id)


# ---------------------------------------------------------------- a damaged Hugging Face directory
def _edit_config(d: Path, **changes) -> None:
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))


def _index_instead(d: Path, text: str) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(text)


def _extra_weight(d: Path) -> None:  # a Llama variant's weight (qk-norm) that nanopt's plain Llama has no name for
    weights = load_file(d / "model.safetensors")
    save_file({**weights, "model.layers.0.self_attn.q_norm.weight": torch.ones(8)}, d / "model.safetensors")


# (case id, what to do to an export, words the message must contain)
DAMAGED_HF = [
    ("config_a_list", lambda d: (d / "config.json").write_text("[1]"), ["config.json is not a JSON object"]),
    ("hidden_size_text", lambda d: _edit_config(d, hidden_size="x"), ["config.json", "`model.dim`", "'x'"]),
    ("heads_zero", lambda d: _edit_config(d, num_attention_heads=0), ["config.json", "`model.n_heads`", "got 0"]),
    ("head_dim_other", lambda d: _edit_config(d, head_dim=4), ["config.json", "head_dim 4"]),
    ("eps_text", lambda d: _edit_config(d, rms_norm_eps="x"), ["config.json", "model.norm_eps"]),
    ("theta_negative", lambda d: _edit_config(d, rope_theta=-1, rope_parameters=None), ["config.json", "rope_theta"]),
    ("kv_heads_not_dividing", lambda d: _edit_config(d, num_key_value_heads=3), ["config.json", "n_kv_heads"]),
    ("rope_a_list", lambda d: _edit_config(d, rope_parameters=[1]), ["config.json", "not an object"]),
    ("weights_not_safetensors", lambda d: (d / "model.safetensors").write_bytes(b"hello"),
     ["model.safetensors cannot be read as model weights"]),
    ("index_without_map", lambda d: _index_instead(d, '{"x": 1}'), ["index.json has no `weight_map`"]),
    ("index_to_missing_shard", lambda d: _index_instead(d, '{"weight_map": {"embed_tokens": "gone.safetensors"}}'),
     ["gone.safetensors cannot be read"]),
    ("a_foreign_weight", _extra_weight, ["no nanopt name for Hugging Face weight 'model.layers.0.self_attn.q_norm",
                                         "only plain Llama weights"]),
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    export_model(build_model(INIT), out := tmp_path_factory.mktemp("hf") / "hf")
    load_hf(out)  # whole, it loads
    return out


@pytest.mark.parametrize("case, damage, words", DAMAGED_HF, ids=[c[0] for c in DAMAGED_HF])
def test_a_damaged_hugging_face_directory_is_one_paragraph_naming_the_file(case, damage, words, exported, tmp_path):
    """Before, a config.json of another shape or type, or weights that are no safetensors file, were a traceback."""
    damage(shutil.copytree(exported, tmp_path / "hf"))
    with pytest.raises(ConfigError) as raised:
        load_hf(tmp_path / "hf")
    assert all(word in str(raised.value) for word in words), raised.value


# ---------------------------------------------------------------- train.init_from into a sharded model
INIT = ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _init_from_worker(rank: int, world: int, store: str, exported: str, out: str) -> None:
    """One gloo rank: a tied model under fsdp and an untied one under hsdp 2x2, each from its own seed, initialised
    from the export; saves the gathered weights."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rt, got = stub_runtime("cpu", rank, world), {}
    for tie, args in ((True, ["--runtime.parallel=fsdp"]),
                      (False, ["--runtime.parallel=hsdp", "--runtime.shard_group_size=2"])):
        torch.manual_seed(rank)  # every rank different: whatever matches came from the files
        model = build_model(replace(INIT, tie_embeddings=tie))
        parallel.shard(model, load_config(None, parse_overrides(["--train.precision=fp32", *args])), rt)
        init_from(model, f"hf:{exported}/{tie}")
        got[tie] = {name: parallel.whole(p.detach()) for name, p in model.named_parameters()}
    torch.save(got, Path(out) / f"{rank}.pt")
    torch.distributed.destroy_process_group()


def test_init_from_loads_an_export_into_fsdp_and_hsdp_shards_as_one_process_loads_it(tmp_path):
    """train.init_from=hf:DIR under fsdp (tied) and hsdp 2x2 (untied) on 4 forked ranks: each rank keeps its shard of
    the bf16 export (converted to fp32), and the gathered model is the one a single process loads."""
    import torch.distributed.fsdp  # noqa: F401 (here, not in each of the 4 forks: seconds of import)

    expected = {}
    for tie in (True, False):
        torch.manual_seed(0)
        export_model(build_model(replace(INIT, tie_embeddings=tie)), tmp_path / str(tie), dtype=torch.bfloat16)
        one = build_model(replace(INIT, tie_embeddings=tie))
        init_from(one, f"hf:{tmp_path / str(tie)}")
        expected[tie] = dict(one.named_parameters())
    fork_ranks(_init_from_worker, 4, (4, str(tmp_path / "store"), str(tmp_path), str(tmp_path)), timeout=120)
    for rank in range(4):
        got = torch.load(tmp_path / f"{rank}.pt")
        for tie in (True, False):
            assert got[tie].keys() == expected[tie].keys()
            for name, p in expected[tie].items():
                assert torch.equal(got[tie][name], p.detach()), (rank, tie, name)
