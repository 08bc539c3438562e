"""attention.choose(): flash-attn when asked for (or, with `auto`, where gpu_check measured it faster) and it can run,
otherwise SDPA with the reason logged; flash numerics on CUDA."""
from __future__ import annotations

import importlib.util
import logging
import sys

import pytest
import torch

from nanopt.recipe import attention
from nanopt.recipe.attention import choose, flash_unavailable_reason, sdpa


@pytest.mark.parametrize("name, level, said", [
    ("auto", logging.INFO, "auto chose sdpa because flash-attn needs a CUDA device (this run is on cpu)"),
    ("flash", logging.WARNING, "flash requested but flash-attn needs a CUDA device")])
def test_on_cpu_flash_falls_back_to_sdpa_and_logs_why(name, level, said, caplog):
    with caplog.at_level(logging.INFO, logger="nanopt"):
        assert choose(name, "cpu") == ("sdpa", sdpa)
    [record] = [r for r in caplog.records if said in r.getMessage()]
    assert record.levelno == level  # asked for flash by name: a warning; `auto`'s choice: information


def test_on_cuda_without_the_package_the_reason_names_the_install(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` raise ImportError
    assert "install the `gpu` extra" in flash_unavailable_reason("cuda")
    with caplog.at_level(logging.INFO, logger="nanopt"):
        assert choose("auto", "cuda")[0] == "sdpa"
    assert "flash-attn is not importable" in caplog.text


def test_with_the_package_auto_picks_flash_only_on_a_gpu_where_gpu_check_measured_it_faster(monkeypatch, caplog):
    fake = type(sys)("flash_attn")  # only its importability is consulted by choose(); nothing is called
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    assert flash_unavailable_reason("cuda") is None
    h100 = "NVIDIA H100 80GB HBM3"
    assert attention.FLASH_MEASURED_FASTER == {}  # never measured: auto keeps SDPA (cuDNN on an H100)
    with caplog.at_level(logging.INFO, logger="nanopt"):
        assert choose("auto", "cuda", "bf16", h100) == ("sdpa", sdpa)
    assert f"has not measured flash-attn faster than SDPA on {h100}" in caplog.text
    assert choose("flash", "cuda", "bf16", h100) == ("flash", attention.flash)  # asked for: granted
    assert choose("sdpa", "cuda") == ("sdpa", sdpa)  # an explicit choice is never overridden
    monkeypatch.setitem(attention.FLASH_MEASURED_FASTER, "h100-sxm", "bench/results/a_future_run.json")
    assert choose("auto", "cuda", "bf16", h100) == ("flash", attention.flash)
    assert choose("auto", "cuda", "bf16-pure", h100) == ("flash", attention.flash)
    assert choose("auto", "cuda", "bf16", "NVIDIA A100-SXM4-80GB") == ("sdpa", sdpa)  # another GPU: not measured


@pytest.mark.parametrize("flash_attn", [type(sys)("flash_attn"), None], ids=["installed", "absent"])
def test_fp32_on_cuda_keeps_sdpa_and_repeats_kv_heads_so_it_keeps_a_fused_kernel(flash_attn, monkeypatch, caplog):
    # bench/gpu_check.py on an H100 (torch 2.11): fp32 with enable_gqa -> MATH kernel, 8.1 GiB for one 1B layer's
    # scores; K/V repeated -> EFFICIENT_ATTENTION, 0.25 GiB. Elsewhere enable_gqa stays (no copies of K/V).
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn)
    if flash_attn is not None:  # flash-attn rejects fp32
        assert "fp16/bf16 only" in flash_unavailable_reason("cuda", "fp32")
    with caplog.at_level(logging.INFO, logger="nanopt"):
        for name in ("sdpa", "auto", "flash"):
            assert choose(name, "cuda", "fp32") == ("sdpa (K/V repeated)", attention.sdpa_repeat_kv)
    assert "fp32 or enable_gqa, not both" in caplog.text
    assert flash_attn is None or "train.precision is fp32" in caplog.text
    for device, precision in (("cuda", "bf16"), ("cpu", "fp32"), ("cpu", "bf16")):
        assert choose("sdpa", device, precision) == ("sdpa", sdpa)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_sdpa_with_repeated_kv_heads_equals_sdpa_with_enable_gqa(kv_heads):
    g = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(2, 4, 16, 8, generator=g, requires_grad=True)  # B Hq T D
    k, v = (torch.randn(2, kv_heads, 16, 8, generator=g, requires_grad=True) for _ in range(2))  # B Hkv T D
    out, ref = attention.sdpa_repeat_kv(q, k, v), sdpa(q, k, v)
    torch.testing.assert_close(out, ref)
    for got, want in zip(*(torch.autograd.grad(o.square().sum(), (q, k, v)) for o in (out, ref))):
        torch.testing.assert_close(got, want)


HAVE_FLASH = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


@pytest.mark.skipif(not HAVE_FLASH, reason="needs a CUDA GPU with the flash-attn package (pip install -e '.[gpu]'); "
                    "this machine has neither")
@pytest.mark.parametrize("kv_heads,tq,tk", [(8, 256, 256), (2, 256, 256), (2, 1, 300), (2, 17, 300)])
def test_flash_matches_sdpa_on_cuda(kv_heads, tq, tk):
    """Same outputs as SDPA in bf16, for MHA, GQA, one-token decoding and a chunk of new tokens after a cache."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, tq, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, kv_heads, tk, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref, out = sdpa(q.float(), k.float(), v.float(), tk - tq), attention.flash(q, k, v, tk - tq)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_flash_wrapper_hands_flash_attn_one_half_dtype_and_returns_the_callers(monkeypatch):
    """CPU twin of the flash path: a stand-in flash_attn_func enforcing flash-attn's input rules (B T H D, one half
    dtype), computing with SDPA."""
    seen = []

    def flash_attn_func(q, k, v, causal):
        assert causal and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
        seen.append(q.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)  # B T H D, like flash-attn

    fake = type(sys)("flash_attn")
    fake.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)  # B H T D, GQA
    out = attention.flash(q, k, v)  # fp32 in (sampling outside autocast): computed in bf16, fp32 out
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert torch.allclose(out, sdpa(q, k, v), atol=3e-2)
    out = attention.flash(q.bfloat16(), k.bfloat16(), v.bfloat16())  # the training path: untouched bf16
    assert seen[-1] == torch.bfloat16 and out.dtype == torch.bfloat16
