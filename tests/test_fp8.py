"""train.fp8: torchao's float8 on the block Linears only, the same state_dict as bf16, the FLOPs share, the device's
say. Runs on CPU (emulated): e2e/test_fp8_run.py; FP8 speed needs an H100: bench/gpu_check.py --sections fp8."""
from __future__ import annotations

import itertools
import json
import sys

import pytest
import torch
import torch.nn as nn
from conftest import REPO, small_overrides

from nanopt.config import ConfigError, ModelConfig, TrainConfig, load_config, parse_overrides
from nanopt.distributed.runtime import Backend, Runtime
from nanopt.main import run
from nanopt.recipe import fp8
from nanopt.recipe.mfu import meta_model, param_counts, token_flops
from nanopt.recipe.model import build_model

pytest.importorskip("torchao.float8", reason="the fp8 extra (torchao) is not installed")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_linear_utils import _auto_filter_for_recipe  # noqa: E402

TOY = ModelConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)


def cpu(backend: Backend | None = None) -> Runtime:
    return Runtime("cpu", torch.device("cpu"), 0, 0, 1, 1, "fp32", backend)


def fp8_config(recipe: str = "tensorwise", *extra: str):
    return load_config(None, parse_overrides(small_overrides() + [f"--train.fp8={recipe}", "--train.fp8_filter=all",
                                                                  *extra]))


def converted(model_cfg: ModelConfig = TOY, recipe: str = "tensorwise") -> nn.Module:
    torch.manual_seed(0)
    model, cfg = build_model(model_cfg), fp8_config(recipe)
    cfg.model = model_cfg
    fp8.convert(model, cfg, cpu())
    return model


def warned(caplog, cfg, rt: Runtime) -> tuple[int, str]:
    caplog.clear()
    with caplog.at_level("WARNING", logger="nanopt"):
        return fp8.convert(build_model(TOY), cfg, rt), caplog.text


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_block_linears_go_fp8_the_state_dict_is_unchanged_and_the_model_computes_close_to_plain(recipe):
    torch.manual_seed(0)
    plain, model = build_model(TOY), converted(TOY, recipe)
    swapped = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    blocks = {name for name, m in plain.named_modules() if isinstance(m, nn.Linear) and name.startswith("layers.")}
    assert swapped == blocks and len(blocks) == 2 * 7  # wq, wk, wv, wo, w1, w3, w2 of each layer
    assert type(model.lm_head) is nn.Linear and type(model.embed) is nn.Embedding
    assert model.lm_head.weight is model.embed.weight  # still tied
    # Same keys, same values: checkpoints of FP8 and bf16 runs load into each other, strictly.
    assert list(model.state_dict()) == list(plain.state_dict())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in plain.state_dict().items())
    plain.load_state_dict(model.state_dict())
    model.load_state_dict(plain.state_dict())
    idx = torch.randint(0, TOY.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    ref, got = plain(idx, idx), model(idx, idx)
    assert got.item() == pytest.approx(ref.item(), rel=1e-2) and got.item() != ref.item()  # FP8 rounding, not bf16
    ref.backward()
    got.backward()
    for a, b in zip(plain.parameters(), model.parameters()):  # e5m2 gradients carry 2 mantissa bits: ~10% apart
        assert (a.grad - b.grad).norm() <= 0.2 * a.grad.norm()
        assert torch.nn.functional.cosine_similarity(a.grad.flatten(), b.grad.flatten(), dim=0) > 0.99


def test_the_share_counts_the_linears_converted_by_hand_and_auto_agrees_with_torchaos_own_filter():
    odd = ModelConfig(**{**vars(TOY), "ffn_dim": 40})
    model = converted(odd)
    assert not any(isinstance(m, Float8Linear) for m in model.layers[0].mlp.modules())  # 40 is no multiple of 16
    assert all(isinstance(getattr(model.layers[0].attention, n), Float8Linear) for n in ("wq", "wk", "wv", "wo"))
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, Float8Linear))
    assert fp8.flops_share(meta_model(odd), fp8_config().train, 32) == pytest.approx(
        6 * weights / token_flops(meta_model(odd), 32).model)
    cfg = load_config(REPO / "configs" / "1b.yaml")
    m = meta_model(cfg.model)
    # Every block Linear of Llama-3.2-1B (dims 2048, 512, 8192) runs in FP8: 6 x 973,078,528 of 8.22 GFLOP/token.
    assert param_counts(m).block_matmuls == 973_078_528
    assert fp8.flops_share(m, TrainConfig(fp8="tensorwise", fp8_filter="all"), 4096) == pytest.approx(
        6 * 973_078_528 / 8_220_192_768)  # 71.0%
    # auto: torchao's H100 thresholds keep wk and wv (2048 -> 512) in bf16, 3.4% of the block matmuls
    assert fp8.flops_share(m, TrainConfig(fp8="tensorwise"), 4096) == pytest.approx(
        6 * (973_078_528 - 16 * 2 * 2048 * 512) / 8_220_192_768)
    assert fp8.summary(cfg, 4096) == {"fp8": "none", "fp8_filter": None, "fp8_matmul_flops_share": 0.0}
    # speedrun-gpu's 768-wide blocks: only the up-projection gains (tensorwise); checked against torchao's own auto
    # filter on a grid, so a torchao that moves its thresholds fails here.
    m = load_config(REPO / "configs" / "speedrun-gpu.yaml").model
    shapes = {name: (lin.in_features, lin.out_features) for name, lin in meta_model(m).layers[0].named_modules()
              if isinstance(lin, nn.Linear)}
    assert {name for name, (i, o) in shapes.items() if fp8.converts("tensorwise", "auto", i, o)} == {"mlp.w1"}
    assert not any(fp8.converts("rowwise", "auto", i, o) for i, o in shapes.values())
    dims = [64, 512, 768, 1000, 1024, 1040, 2048, 3072, 4096, 4112, 8192, 14336]
    for recipe in ("tensorwise", "rowwise"):
        theirs = _auto_filter_for_recipe(recipe, filter_fqns=[])
        for k, n in itertools.product(dims, dims):
            linear = nn.Linear(k, n, bias=False, device="meta")
            assert fp8.converts(recipe, "auto", k, n) == theirs(linear, "layers.0.x"), (recipe, k, n)


def test_convert_warns_of_a_small_model_and_of_eager_fp8_and_refuses_without_fp8(caplog, monkeypatch):
    cfg = fp8_config()
    cfg.train.fp8_filter = "auto"
    native = cpu(backend=type("Native", (Backend,), {"fp8": "native"})(torch.device("cpu")))
    n, text = warned(caplog, cfg, cpu())  # converts nothing, and says how to force it
    assert n == 0 and "no block Linear of this model is large enough" in text and "fp8_filter=all" in text
    n, text = warned(caplog, fp8_config(), native)
    assert n > 0 and "train.compile is false: eager FP8" in text
    assert "eager FP8" not in warned(caplog, fp8_config("tensorwise", "--train.compile=true"), native)[1]
    without = cpu(backend=Backend(torch.device("cpu")))
    with pytest.raises(ConfigError, match=r"`train.fp8` is 'rowwise'.*--train.fp8=none"):
        fp8.convert(build_model(TOY), fp8_config("rowwise"), without)
    assert cpu().backend.fp8 == "emulated" and Backend.fp8 is None
    fp8.convert(build_model(TOY), fp8_config("none"), without)  # none: nothing asked
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # makes the import raise ImportError
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[fp8\]'"):
        fp8.convert(build_model(TOY), fp8_config(), cpu())


@pytest.mark.parametrize("keys", [{"train.micro_batch_size": 3, "train.seq_len": 30},
                                  {"train.seq_len_schedule": "0:16,2:30", "train.micro_batch_size": 1}])
def test_a_micro_batch_that_fp8s_weight_gradient_cannot_take_is_refused_on_every_device(keys):
    """torch._scaled_mm contracts the weight gradient over the micro-batch's tokens, in multiples of 16 only."""
    with pytest.raises(ConfigError, match=r"`train.fp8` is 'tensorwise'.*not a multiple of 16.*train.micro_batch_size"):
        load_config(None, parse_overrides(small_overrides(**keys) + ["--train.fp8=tensorwise"]))
    load_config(None, parse_overrides(small_overrides(**keys)))  # fine without FP8


def test_emulation_warns_once_and_mfu_is_labelled_bf16_equivalent(tmp_path, capsys):
    assert run(small_overrides(**{"run.dir": tmp_path, "train.fp8": "tensorwise", "train.precision": "bf16",
                                  "train.max_steps": 3, "train.fp8_filter": "all"})) == 0
    out = capsys.readouterr().out
    assert out.count("fp8: emulated on cpu") == 1 and "mfu: bf16-equivalent" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["fp8"] == "tensorwise" and summary["mfu_basis"] == "bf16-equivalent"
    cfg = fp8_config()
    assert summary["fp8_matmul_flops_share"] == pytest.approx(fp8.flops_share(meta_model(cfg.model), cfg.train, 32))
