"""Sampling: the KV cache changes nothing but speed; seeds reproduce; the window slides past the context;
`nanopt sample` prints continuations of the prompt."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanopt.cli import run
from nanopt.config import Config, ModelConfig
from nanopt.evals.generate import generate, sample_text
from nanopt.recipe.attention import eager, sdpa
from nanopt.recipe.model import build_model
from nanopt.training import checkpoint

CONFIGS = {
    "gqa-tied": dict(n_heads=4, n_kv_heads=2, tie_embeddings=True),
    "mqa-untied-llama3": dict(n_heads=4, n_kv_heads=1, tie_embeddings=False, rope_scaling="llama3",
                              rope_factor=8.0, rope_original_max_seq_len=16, rope_theta=500000.0),
    "mha-untied": dict(n_heads=2, n_kv_heads=2, tie_embeddings=False),
}


def small_model(vocab: int = 61, max_seq_len: int = 64, seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, dim=32, n_layers=2, ffn_dim=64, max_seq_len=max_seq_len, init_std=0.2,
                      **{"n_heads": 4, "n_kv_heads": 2, **kw})
    return build_model(cfg).eval()


@pytest.mark.parametrize("kernel", [sdpa, eager], ids=["sdpa", "eager"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_kv_cache_greedy_equals_full_recomputation(name, kernel):
    model = small_model(**CONFIGS[name])
    model.set_attention(kernel)
    prompt = torch.randint(0, 61, (3, 7), generator=torch.Generator().manual_seed(1))
    cached = generate(model, prompt, 40, temperature=0.0, use_cache=True)
    full = generate(model, prompt, 40, temperature=0.0, use_cache=False)
    assert cached.shape == (3, 47) and torch.equal(cached[:, :7], prompt) and torch.equal(cached, full)
    # The continuation is not degenerate (a constant stream would hide a broken cache).
    assert len(set(cached[:, 7:].flatten().tolist())) > 3


def test_sampling_is_seeded_top_k_one_is_greedy_and_sample_text_slides_past_the_context():
    model = small_model()
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(2))

    def run(seed: int, **kw) -> torch.Tensor:
        return generate(model, prompt, 30, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(run(7, temperature=1.0, top_k=10), run(7, temperature=1.0, top_k=10))
    assert not torch.equal(run(7, temperature=1.0), run(8, temperature=1.0))
    assert torch.equal(run(7, temperature=1.0, top_k=1), generate(model, prompt, 30, temperature=0.0))
    # sample_text slides the window past the model's context
    letters = SimpleNamespace(name="letters", vocab_size=26, bos_id=None, eos_id=None,  # decoded length == ids
                              encode=lambda text: [ord(c) - 97 for c in text],
                              decode=lambda ids: "".join(chr(97 + i) for i in ids))
    model = small_model(vocab=26, max_seq_len=16)
    texts = sample_text(model, letters, "elementarymydear", 2, 45, 0.9, 0, seed=3, device=torch.device("cpu"))
    assert len(texts) == 2  # the whole prompt is kept, even at the context limit
    assert all(text.startswith("elementarymydear") and len(text) == 16 + 45 for text in texts), texts


def test_sample_cli_prints_seeded_continuations(tmp_path, capsys):
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    cfg.train.seq_len = 64  # a checkpoint's config is validated like a YAML one: max_seq_len >= seq_len
    ckpt = checkpoint.save(tmp_path / "run" / "checkpoints", 3, checkpoint.model_state(build_model(cfg.model)),
                           {"config": cfg.to_dict()}, keep=1)

    def sample(*extra: str) -> str:
        capsys.readouterr()
        assert run(["sample", str(tmp_path / "run"), "--prompt", "Elementary, my dear", "-n", "2", "--max-new-tokens",
                    "12", *extra]) == 0
        return capsys.readouterr().out

    first, again = sample("--seed", "5"), sample("--seed", "5")
    assert first == again and sample("--seed", "6") != first and str(ckpt) in first
    assert first.count("Elementary, my dear") == 3  # the header line and two samples
    # Each flag is bounded by its sample.* key's rules, and 0 samples or tokens asks for nothing.
    for flag, value, words in [("--max-new-tokens", "0", "positive"), ("--temperature", "1e-320", ">= 0.0001"),
                               ("--max-new-tokens", str(2**64), "[0, 2^16]"), ("-n", str(2**64), "[0, 1024]")]:
        assert run(["sample", str(tmp_path / "run"), flag, value]) == 2
        assert words in capsys.readouterr().err
