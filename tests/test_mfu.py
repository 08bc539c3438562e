"""MFU: FLOPs per token by hand and by FlopCounterMode, peaks and detection, the meter, the estimator."""
from __future__ import annotations

import functools
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO
from torch.utils.flop_counter import FlopCounterMode

import nanopt.recipe.model
from nanopt import cli
from nanopt.config import ConfigError, ModelConfig, load_config
from nanopt.distributed import hardware
from nanopt.distributed.memory import Training, activation_bytes_per_token, device_memory
from nanopt.distributed.runtime import Backend, Runtime
from nanopt.recipe import mfu
from nanopt.recipe.attention import eager
from nanopt.recipe.model import Block, build_model, residual_linear

# ---------------------------------------------------------------- FLOPs per token, by hand
def shipped(name: str, *overrides: tuple[str, object]):
    return load_config(REPO / "configs" / f"{name}.yaml", list(overrides))


def counts_of(m: ModelConfig) -> mfu.ParamCounts:
    return mfu.param_counts(mfu.meta_model(m))


def model_flops(m: ModelConfig, seq_len: int, causal_halving: bool = True) -> int:
    return mfu.token_flops(mfu.meta_model(m), seq_len, causal_halving).model


def six_n(m: ModelConfig) -> int:
    return mfu.token_flops(mfu.meta_model(m), 1).six_n


def recompute_flops(m: ModelConfig, micro_batch_tokens: int, loss_chunk_tokens: int, seq_len: int = 1,
                    blocks: bool = False, causal_halving: bool = True) -> int:
    """What HFU adds to MFU: the FLOPs per token nanopt computes twice."""
    f = mfu.token_flops(mfu.meta_model(m), seq_len, causal_halving, micro_batch_tokens // seq_len, loss_chunk_tokens,
                        blocks)
    return f.hardware - f.model


def flops_seen(step) -> int:
    """The FLOPs FlopCounterMode sees step() run."""
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def test_llama_3_2_1b_6n_is_six_times_its_parameter_count_and_hfu_counts_recomputation_on_top():
    m = shipped("1b").model
    counts = counts_of(m)
    # Tied embeddings: the LM head matmul is counted, the lookup is not -> N is exactly the parameter count.
    assert counts.total == counts.n_6n == 1_235_814_400
    assert six_n(m) == 6 * 1_235_814_400
    # Attention at seq 4096: 12 · L · T · (n_heads · head_dim) = 12 · 16 · 4096 · 2048, halved when causal.
    assert model_flops(m, 4096, causal_halving=False) - six_n(m) == 1_610_612_736
    assert model_flops(m, 4096, causal_halving=True) - six_n(m) == 805_306_368
    assert (fpt := model_flops(m, 4096)) == 7_414_886_400 + 805_306_368
    # 1b.yaml: micro-batch 4 × 4096 = 16,384 positions, chunks of 8192 -> the LM head forward runs twice.
    hw = fpt + recompute_flops(m, 4 * 4096, 8192)
    assert hw - fpt == 2 * 128_256 * 2048
    assert recompute_flops(m, 4 * 4096, 0) == 0  # chunking off: nothing recomputed
    per_token = functools.partial(mfu.token_flops, mfu.meta_model(m), micro_batch_size=4, loss_chunk_tokens=8192)
    meter = mfu.MFUMeter(per_token, 4096, tokens_per_step=2**20, peak_flops=989.4e12, world_size=8, warmup_steps=0)
    out = meter.update(step=5, window_steps=1, step_seconds=2.5)
    assert out["hfu"] == pytest.approx(out["mfu"] * hw / fpt) and out["hfu"] > out["mfu"]
    assert meter.summary()["flops_per_token_hardware"] == hw


def test_tiny_config_by_hand_tied_and_untied():
    m = shipped("tiny").model  # vocab 257, dim 256, 4 layers, 8/4 heads, ffn 768
    # Per layer: wq 256·256 + wk,wv 2·256·128 + wo 256·256 = 196,608; SwiGLU 3·256·768 = 589,824.
    blocks = 4 * (196_608 + 589_824)  # 3,145,728
    norms = 256 * (2 * 4 + 1)  # 2,304
    head = 257 * 256  # 65,792
    assert counts_of(m).total == blocks + norms + head == 3_213_824
    assert six_n(m) == 6 * 3_213_824 == 19_282_944
    # seq 256: 12 · 4 · 256 · 256 = 3,145,728 in full, 1,572,864 causal.
    assert model_flops(m, 256, causal_halving=False) == 19_282_944 + 3_145_728
    assert model_flops(m, 256) == 19_282_944 + 1_572_864

    m.tie_embeddings = False  # a separate head adds parameters, not FLOPs: the head matmul was already counted
    assert counts_of(m).total == 3_213_824 + 65_792
    assert six_n(m) == 19_282_944


def test_flop_counter_agrees_and_backward_is_twice_forward():
    m = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(m)
    # The eager kernel does its T×T products with matmuls FlopCounterMode sees (the CPU sdpa kernel has no
    # FLOP formula); like every dense kernel it computes the full square, so compare with causal_halving=False.
    model.set_attention(eager)
    B, T = 3, 16
    idx = torch.randint(0, m.vocab_size, (B, T))
    with FlopCounterMode(display=False) as forward_counter:
        loss = model(idx, idx)
    forward, backward = forward_counter.get_total_flops(), flops_seen(loss.backward)
    norms = counts_of(m).norms  # elementwise gains: in N by convention, not matmul FLOPs
    expected_training = (model_flops(m, T, causal_halving=False) - 6 * norms) * B * T
    assert forward == expected_training // 3
    assert (forward + backward) / forward == pytest.approx(3.0, rel=0.01)
    assert forward + backward == pytest.approx(model_flops(m, T, causal_halving=False) * B * T, rel=0.01)
    assert recompute_flops(m, B * T, model.loss_chunk_tokens) == 0  # 48 positions: one chunk

    # A chunked loss recomputes each chunk's logits in backward: HFU counts that work, MFU does not.
    model.zero_grad(set_to_none=True)
    model.loss_chunk_tokens = 16  # 48 positions -> 3 chunks
    chunked = flops_seen(lambda: model(idx, idx).backward())
    extra = recompute_flops(m, B * T, 16)
    assert extra == 2 * m.vocab_size * m.dim
    assert chunked - (forward + backward) == extra * B * T

    # train.recompute runs every block's forward again in backward: HFU counts it too (the counter leaves out the
    # blocks' norm gains, elementwise, as above).
    model.zero_grad(set_to_none=True)
    model.recompute_blocks = True
    again = flops_seen(lambda: model(idx, idx).backward()) - chunked
    blocks = recompute_flops(m, B * T, 16, T, blocks=True, causal_halving=False) - extra
    block_norms = norms - m.dim  # two per block; the final norm is not recomputed
    assert again == (blocks - 2 * block_norms) * B * T


# ---------------------------------------------------------------- peaks and detection
def test_peak_table_holds_dense_spec_sheet_numbers_and_memory():
    expected_bf16 = {"h100-sxm": 989.5, "h100-pcie": 756.5, "h100-nvl": 835.5, "h200": 989.5, "a100": 312.0,
                     "l4": 121.0, "b200": 2250.0, "tpu-v4": 275.0, "tpu-v5e": 197.0, "tpu-v5p": 459.0,
                     "tpu-v6e": 918.0}
    for key, tflops in expected_bf16.items():
        assert hardware.table_peak(key, "bf16") == pytest.approx(tflops * 1e12)
        assert hardware.PEAKS[key].source.startswith("https://")
    assert hardware.table_peak("h100-sxm", "fp32") == pytest.approx(494.7e12)  # fp32 runs use TF32 tensor cores
    assert hardware.table_peak("a100", "fp32") == pytest.approx(156e12)
    assert hardware.table_peak("tpu-v5e", "fp32") is None
    assert hardware.table_peak("a100-40gb", "bf16") == hardware.table_peak("a100", "bf16")
    memory_gb = {"h100-sxm": 80, "h100-pcie": 80, "h100-nvl": 94, "h200": 141, "h200-nvl": 141, "a100": 80,
                 "a100-40gb": 40, "l4": 24, "b200": 180, "tpu-v4": 32, "tpu-v5e": 16, "tpu-v5p": 95, "tpu-v6e": 32}
    assert {key: peak.memory_gb for key, peak in hardware.PEAKS.items()} == memory_gb
    assert hardware.PEAKS["h100-sxm"].memory_bytes == 80 * 10**9  # GB as the sheet writes it, under 80 GiB


DETECTED = {  # name (, power limit) -> key; None: unknown, never a guess
    "NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H100 NVL": "h100-nvl",
    ("NVIDIA H100", 700.0): "h100-sxm", ("NVIDIA H100", 350.0): "h100-pcie", "NVIDIA H100": None,
    "NVIDIA H200": "h200", "NVIDIA H200 NVL": "h200-nvl", "NVIDIA GH200 480GB": None, "NVIDIA A100-SXM4-80GB": "a100",
    "NVIDIA A100 80GB PCIe": "a100", "NVIDIA A100-SXM4-40GB": "a100-40gb", "NVIDIA A100-PCIE-40GB": "a100-40gb",
    "NVIDIA L4": "l4", "NVIDIA L40S": None, "NVIDIA B200": "b200", "NVIDIA GB200": None,
    "NVIDIA GeForce RTX 4090": None,
    "TPU v4": "tpu-v4", "TPU v5 lite": "tpu-v5e", "TPU v5e": "tpu-v5e", "TPU v5": "tpu-v5p", "TPU v5p": "tpu-v5p",
    "TPU v6 lite": "tpu-v6e", "TPU v3": None,
    # torch_xla's accelerator types, as nanopt/distributed/xla.py reports them
    "TPU v4-8": "tpu-v4", "TPU v5litepod-16": "tpu-v5e", "TPU v5p-8": "tpu-v5p", "TPU v6e-8": "tpu-v6e", "TPU": None,
}


@pytest.mark.parametrize("name", DETECTED, ids=str)
def test_detect_hardware(name):
    assert hardware.detect_hardware(*(name if isinstance(name, tuple) else (name, None))) == DETECTED[name]


def named_device(name: str, watts=None, world_size: int = 1) -> Runtime:
    """A device that reports a given accelerator name and power limit; its tensors live on the CPU."""
    backend = Backend(torch.device("cpu"))
    backend.hardware_name, backend.power_limit_watts = (lambda: name), (lambda: watts)
    return Runtime("cuda", torch.device("cpu"), 0, 0, world_size, world_size, "bf16", backend)


def test_unknown_accelerator_gives_null_mfu_and_one_warning(caplog):
    cfg = load_config(None, [])
    rt = named_device("NVIDIA Z100 Hypothetical")
    with caplog.at_level(logging.WARNING, logger="nanopt"):
        meters = [mfu.meter_for_run(cfg, rt) for _ in range(2)]
    warnings = [r for r in caplog.records if "unknown accelerator" in r.getMessage()]
    assert len(warnings) == 1 and "--mfu.hardware" in warnings[0].getMessage()
    values = meters[1].update(step=20, window_steps=10, step_seconds=0.5)
    assert values["mfu"] is None and values["mfu_6n"] is None
    assert values["tflops_per_device"] > 0  # achieved FLOP/s is still known


def test_power_limit_and_override_choose_the_peak():
    cfg = load_config(None, [("train.precision", "bf16")])
    assert mfu.run_peak(cfg, named_device("NVIDIA H100", 700.0))[0] == pytest.approx(989.5e12)
    assert mfu.run_peak(cfg, named_device("NVIDIA H100", 350.0))[0] == pytest.approx(756.5e12)
    forced = load_config(None, [("mfu.hardware", "a100"), ("train.precision", "fp32")])
    peak, where = mfu.run_peak(forced, named_device("NVIDIA Z100 Hypothetical"))
    assert peak == pytest.approx(156e12) and "mfu.hardware" in where
    with pytest.raises(ConfigError, match="h100-sxm"):  # an unknown override
        load_config(None, [("mfu.hardware", "z100")])


def test_run_peak_on_cpu_is_measured_at_every_start(monkeypatch):
    # any CPU that runs torch does a 256² fp32 matmul faster than 0.1 GFLOP/s
    assert hardware.measure_matmul_flops(torch.float32, budget_s=0.05) > 1e8
    budgets = []
    monkeypatch.setattr(mfu, "measure_matmul_flops", lambda dtype, device, budget_s, sync: budgets.append(budget_s)
                        or 5e10)
    rt = Runtime("cpu", torch.device("cpu"), 0, 0, 1, 1, "fp32")
    cfg = load_config(None, [("train.precision", "fp32")])
    assert mfu.run_peak(cfg, rt)[0] == 5e10 and budgets == [hardware.PEAK_BUDGET_S]
    peak, where = mfu.run_peak(cfg, rt)
    assert peak == 5e10 and "MEASURED on" in where and budgets == [hardware.PEAK_BUDGET_S] * 2


def test_every_rank_measures_the_cpu_peak_at_once_and_their_mean_is_the_peak(monkeypatch):  # as in training
    rt = Runtime("cpu", torch.device("cpu"), 0, 0, 2, 2, "fp32")
    calls = []
    monkeypatch.setattr(rt, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(rt, "all_reduce_sum", lambda t: calls.append("sum") or t + 3e10)  # the other rank's 3e10
    monkeypatch.setattr(mfu, "measure_matmul_flops", lambda *args: calls.append("measure") or 5e10)
    peak, _ = mfu.run_peak(load_config(None, [("train.precision", "fp32")]), rt)
    assert calls == ["barrier", "measure", "sum"] and peak == pytest.approx(4e10)


# ---------------------------------------------------------------- the meter
def simulated_mfu(world: int, accum: int, micro_s: float = 0.02, steps: int = 12) -> list:
    micro_batch, seq = 4, 256
    m = shipped("tiny").model
    meter = mfu.MFUMeter(functools.partial(mfu.token_flops, mfu.meta_model(m)), seq,
                         tokens_per_step=micro_batch * seq * world * accum, peak_flops=1e12, world_size=world,
                         warmup_steps=2)
    out = []
    for step in range(3, steps + 1, 3):  # logged every 3 steps; a micro-step takes micro_s, ranks in parallel
        out.append(meter.update(step, 3, accum * micro_s))
    return out


def test_grad_accumulation_and_world_size_do_not_change_mfu_in_any_convention():
    reference = simulated_mfu(world=1, accum=1)
    assert reference[0]["mfu"] is None  # the window (1..3] holds the 2 warm-up steps
    expected = 4 * 256 / 0.02 * model_flops(shipped("tiny").model, 256) / 1e12
    assert reference[1]["mfu"] == pytest.approx(expected)
    for world, accum in [(1, 4), (8, 1), (8, 4), (64, 2)]:
        got = simulated_mfu(world, accum)
        for a, b in zip(reference, got):
            for key in ("mfu", "mfu_6n", "mfu_full_attention", "hfu", "tflops_per_device"):
                assert a[key] == b[key] if a[key] is None else a[key] == pytest.approx(b[key])
    # ... and a device twice as fast reports twice the MFU (the comparison above can fail).
    assert simulated_mfu(8, 4, micro_s=0.01)[1]["mfu"] == pytest.approx(2 * reference[1]["mfu"])
    values = simulated_mfu(world=2, accum=2)[-1]  # 6N leaves out attention, full attention counts the square
    m = shipped("tiny").model
    assert values["mfu_6n"] / values["mfu"] == pytest.approx(six_n(m) / model_flops(m, 256))
    assert values["mfu_full_attention"] / values["mfu"] == \
        pytest.approx(model_flops(m, 256, causal_halving=False) / model_flops(m, 256))


def test_the_1b_run_at_51_3_percent_is_46_2_in_6n_and_56_3_with_full_attention(capsys):
    """The measured H100 run (bench/results/gpu_check_h100_shipped.json) in the three conventions, as the meter
    and `nanopt estimate` give them."""
    cfg = shipped("1b", ("train.global_batch_tokens", 131072))
    meter = mfu.meter_for_run(cfg, named_device("NVIDIA H100 80GB HBM3"), start_step=0)
    meter.update(step=4, window_steps=2, step_seconds=131072 / 61694.726858213675)
    summary = meter.summary()
    assert [round(100 * summary[k], 1) for k in ("mfu", "mfu_6n", "mfu_full_attention")] == [51.3, 46.2, 56.3]
    assert summary["mfu_basis"] is None and summary["flops_per_token_full_attention"] == 9_025_499_136
    out = run_estimate(capsys, ["estimate", str(REPO / "configs" / "1b.yaml"), "--mfu", "0.5126"])
    assert "51.3% MFU here = 46.2% in 6N alone (the blog) = 56.3% with full attention (nanochat, torchtitan)" in out


def test_set_stage_recomputes_flops_per_token_and_tokens_per_step():
    cfg = shipped("1b", ("train.loss_chunk_tokens", 8192))
    meter = mfu.meter_for_run(cfg, named_device("NVIDIA H100 80GB HBM3"))
    long_step = meter.update(step=10, window_steps=1, step_seconds=1.0)
    meter.set_stage(tokens_per_step=2**19, seq_len=1024)  # half the batch in sequences a quarter as long
    m = cfg.model
    assert meter.tokens_per_step == 2**19
    assert meter.flops == mfu.token_flops(mfu.meta_model(m), 1024, True, cfg.train.micro_batch_size, 8192)
    assert meter.summary()["flops_per_token"] == model_flops(m, 1024)
    short_step = meter.update(step=11, window_steps=1, step_seconds=1.0)
    # 4 x 1024 positions per micro-batch fit one loss chunk: nothing recomputed at this stage (at 4096 there was).
    assert long_step["hfu"] > long_step["mfu"] and short_step["hfu"] == short_step["mfu"]
    assert short_step["mfu"] == pytest.approx(long_step["mfu"] / 2 * model_flops(m, 1024)
                                              / model_flops(m, 4096))
    # The summary's MFU is over both stages' time: total FLOPs over total seconds.
    assert meter.summary()["mfu"] == pytest.approx((long_step["mfu"] + short_step["mfu"]) / 2)


def test_a_stages_first_step_timed_alone_is_a_warm_up_step_in_neither_figure_nor_summary():
    """A 25 s recompile once read "mfu 1.0%" and pulled the summary's mean."""
    cfg = shipped("1b")
    meter = mfu.meter_for_run(cfg, named_device("NVIDIA H100 80GB HBM3"))
    counted = meter.update(step=10, window_steps=5, step_seconds=2.0)
    before = meter.summary()["mfu"]
    recompile = meter.update(step=11, window_steps=0, step_seconds=25.0)
    assert counted["mfu"] > 0 and recompile["mfu"] is None and recompile["tflops_per_device"] is None
    assert meter.summary()["mfu"] == before == pytest.approx(counted["mfu"])
    # An fp8 run is labelled bf16-equivalent, against the dense peak.
    cfg = shipped("1b", ("train.fp8", "tensorwise"))
    meter = mfu.meter_for_run(cfg, named_device("NVIDIA H100 80GB HBM3"))
    assert meter.basis == "bf16-equivalent" and meter.peak_flops == pytest.approx(989.5e12)  # not an FP8 peak
    assert meter.summary()["mfu_basis"] == "bf16-equivalent"


# ---------------------------------------------------------------- the estimator
def run_estimate(capsys, argv: list[str]):
    """`nanopt estimate ARGV` (exit 0): its JSON under --json, else what it printed."""
    assert cli.run(argv) == 0
    out = capsys.readouterr().out
    return json.loads(out) if "--json" in argv else out


def test_estimate_json_for_1b_on_8_h100_sxm_at_40_percent(capsys):
    got = run_estimate(capsys, ["estimate", "--config", str(REPO / "configs" / "1b.yaml"), "--hardware", "h100-sxm",
                                "--gpus", "8", "--mfu", "0.4", "--price-per-gpu-hour", "3.0", "--json"])
    # By hand: the config's budget is 23,570 steps × 2^20 tokens; 6N + causal attention at seq 4096.
    tokens = 23_570 * 1_048_576  # 24,714,936,320 ≈ 20 tokens per parameter
    flops_per_token = 6 * 1_235_814_400 + 6 * 16 * 4096 * 2048  # 8,220,192,768
    hours = tokens * flops_per_token / (8 * 989.5e12 * 0.4) / 3600
    assert got["params"] == 1_235_814_400
    assert got["flops_per_token"] == flops_per_token and got["flops_per_token_6n"] == 7_414_886_400
    assert got["tokens"] == tokens
    assert got["hours"] == pytest.approx(hours) and got["hours"] == pytest.approx(17.8227, abs=1e-3)
    assert got["gpu_hours"] == pytest.approx(8 * hours)
    assert got["cost_usd"] == pytest.approx(8 * hours * 3.0) and got["cost_usd"] == pytest.approx(427.74, abs=0.01)
    # The same speed in the blog's 6N and in nanochat's / torchtitan's full-attention convention.
    assert got["mfu_6n"] == pytest.approx(0.4 * 7_414_886_400 / flops_per_token)
    assert got["mfu_full_attention"] == pytest.approx(0.4 * 9_025_499_136 / flops_per_token)


@pytest.mark.parametrize("config, devices", [("170m-1gpu", 1), ("1b", 8), ("speedrun-gpu", 1), ("tiny", 1)])
def test_estimate_assumes_the_devices_the_config_is_sized_for_unless_told(capsys, config, devices):
    """Before, every config was estimated on 8 GPUs: configs/170m-1gpu.yaml's ~2.8 h on one H100 read 0.3 h."""
    path = str(REPO / "configs" / f"{config}.yaml")
    got = run_estimate(capsys, ["estimate", path, "--json"])
    assert (got["gpus"], got["gpus_source"]) == (devices, "mfu.devices")
    out = run_estimate(capsys, ["estimate", path])
    assert f": {devices} × NVIDIA H100 SXM" in out and f"devices        {devices} (the config's mfu.devices" in out
    given = run_estimate(capsys, ["estimate", path, "--gpus", "2", "--json"])
    assert (given["gpus"], given["gpus_source"]) == (2, "--gpus")
    assert given["hours"] == pytest.approx(got["hours"] * devices / 2)
    assert given["gpu_hours"] == pytest.approx(got["gpu_hours"])


def test_estimate_trains_the_schedule_stage_by_stage(capsys):
    """configs/speedrun-gpu.yaml ramps its batch: 1,000 × 262,144 + 1,000 × 393,216 + 1,500 × 524,288 tokens,
    not 3,500 steps of the first batch (917,504,000)."""
    path = str(REPO / "configs" / "speedrun-gpu.yaml")
    out = run_estimate(capsys, ["estimate", path])
    assert "tokens         1,441,792,000 (the config's plan: 3,500 steps;" in out
    for line in ("stage 1        from step 0: 1,000 steps × 262,144 tokens at seq 2048 = 262,144,000 tokens",
                 "stage 2        from step 1,000: 1,000 steps × 393,216 tokens at seq 2048 = 393,216,000 tokens",
                 "stage 3        from step 2,000: 1,500 steps × 524,288 tokens at seq 2048 = 786,432,000 tokens"):
        assert line in out
    got = run_estimate(capsys, ["estimate", path, "--json"])
    assert got["tokens"] == 1_441_792_000
    assert [(s["first_step"], s["steps"], s["batch_tokens"], s["seq_len"], s["tokens"]) for s in got["stages"]] == [
        (0, 1000, 262_144, 2048, 262_144_000), (1000, 1000, 393_216, 2048, 393_216_000),
        (2000, 1500, 524_288, 2048, 786_432_000)]
    # Attention's FLOPs per token follow each stage's seq_len: a shorter first stage costs less per token.
    short = ["--train.seq_len_schedule=0:512,1000:2048", "--json"]
    mixed = run_estimate(capsys, ["estimate", path, *short])
    m = shipped("speedrun-gpu").model
    assert mixed["total_flops"] == (262_144_000 * model_flops(m, 512)
                                    + (393_216_000 + 786_432_000) * model_flops(m, 2048))
    assert mixed["total_flops"] < got["total_flops"] and mixed["seq_len"] == 2048
    # --tokens: one stage at train.seq_len, and the report says so.
    flat = run_estimate(capsys, ["estimate", path, "--tokens", "1B", "--json"])
    assert flat["tokens"] == 10**9 and flat["stages"] is None
    assert flat["tokens_source"] == "--tokens 1B, all at seq 2048"


def test_estimate_tokens_flag_and_bad_input(capsys):
    args = ["estimate", str(REPO / "configs" / "tiny.yaml"), "--gpus", "1", "--json"]
    got = run_estimate(capsys, args + ["--tokens", "20x"])
    assert got["tokens"] == 20 * 3_213_824 and got["cost_usd"] is None
    got = run_estimate(capsys, args + ["--tokens", "2.5B", "--train.seq_len=512"])
    assert got["tokens"] == 2_500_000_000 and got["seq_len"] == 512
    for bad in (["--hardware", "z100"], ["--mfu", "40"], ["--tokens", "lots"], ["--gpus", "0"],
                ["--price-per-gpu-hour", "nan"], ["--price-per-gpu-hour", "inf"]):  # were "$nan", and Infinity in JSON
        assert cli.run(args + bad) == 2
        assert "error" in capsys.readouterr().err


EIGHT_B = str(REPO / "configs" / "8b.yaml")


def test_estimate_shows_8b_fits_80gb_under_fsdp_on_8_and_not_under_ddp(capsys):
    """configs/8b.yaml's recipe rests on this: ~193 GB per GPU replicated, ~71 GB sharded."""
    got = run_estimate(capsys, ["estimate", EIGHT_B, "--json"])
    assert got["params"] == 8_030_261_248 and got["gpus"] == 8  # Llama-3-8B, on the config's 8 GPUs
    memory = got["memory"]
    assert memory["capacity_bytes"] == 80 * 10**9 and memory["config_parallel"] == "fsdp"
    rows = {row["parallel"]: row for row in memory["rows"]}
    assert set(rows) == {"ddp", "fsdp"} and rows["fsdp"]["shard_ranks"] == 8
    assert rows["fsdp"]["fits"] and rows["fsdp"]["total"] < 80e9
    assert not rows["ddp"]["fits"] and rows["ddp"]["total"] > 2 * 80e9
    assert rows["ddp"]["optimizer"] == 8 * 8_030_261_248 == 8 * rows["fsdp"]["optimizer"]
    out = run_estimate(capsys, ["estimate", EIGHT_B])
    assert "NO" in next(line for line in out.splitlines() if line.strip().startswith("ddp "))
    assert "yes (" in next(line for line in out.splitlines() if line.strip().startswith("fsdp over 8"))
    # With train.recompute on, the rows hold the recomputed activations and the what-if line is left out.
    assert "--train.recompute=true" in out
    recomputed = run_estimate(capsys, ["estimate", EIGHT_B, "--json", "--train.recompute=true"])["memory"]["rows"]
    recomputed = {row["parallel"]: row for row in recomputed}
    assert recomputed["fsdp"]["activations"] == memory["activations_with_block_recompute"]
    assert recomputed["fsdp"]["activations"] < rows["fsdp"]["activations"] / 4
    assert "per-block recompute" not in run_estimate(capsys, ["estimate", EIGHT_B, "--train.recompute=true"])


def test_estimate_adds_an_hsdp_row_for_a_shard_group_and_refuses_one_that_does_not_divide(capsys):
    path = str(REPO / "configs" / "1b.yaml")
    rows = run_estimate(capsys, ["estimate", path, "--gpus", "16", "--json"])["memory"]["rows"]  # 2 nodes of 8
    assert [(r["parallel"], r["shard_ranks"]) for r in rows] == [("ddp", 1), ("fsdp", 16), ("hsdp", 8)]
    rows = run_estimate(capsys, ["estimate", path, "--gpus", "16", "--shard-group-size", "4", "--json"])["memory"]
    assert rows["rows"][2]["shard_ranks"] == 4
    assert cli.run(["estimate", path, "--gpus", "16", "--shard-group-size", "3"]) == 2
    assert "`--shard-group-size 3` must be a positive divisor of the 16 GPUs" in capsys.readouterr().err


# ---------------------------------------------------------------- a variant only this test knows
class GeluMLPWithAnExtraLinear(torch.nn.Module):
    """Another MLP, and an extra Linear per block: w2(gelu(extra(gelu(w1 x)))). Swapped into model.py's Block by
    monkeypatching model.MLP alone: FLOPs, counts, memory and MFU must follow with no other file touched."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = torch.nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.extra = torch.nn.Linear(cfg.ffn_dim, cfg.ffn_dim, bias=False)
        self.w2 = residual_linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.extra(F.gelu(self.w1(x)))))  # B T C -> B T F -> B T F -> B T C


def test_a_variant_defined_only_here_gets_its_flops_counts_memory_and_mfu(monkeypatch):
    from test_memory import _saved_bytes_per_token

    monkeypatch.setattr(nanopt.recipe.model, "MLP", GeluMLPWithAnExtraLinear)
    m = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(m)
    assert isinstance(model.layers[0].mlp, GeluMLPWithAnExtraLinear)
    # Counts by hand: wq, wo 32·32; wk, wv 32·16; w1, w2 32·48; extra 48·48.
    block = 2 * 32 * 32 + 2 * 32 * 16 + 2 * 32 * 48 + 48 * 48
    counts = mfu.param_counts(model)
    assert counts.block_matmuls == 2 * block and counts.norms == 32 * 5 and counts.lm_head == 97 * 32
    assert counts.total == model.num_params() == 2 * block + 32 * 5 + 97 * 32
    assert mfu.param_counts(mfu.meta_model(m)) == counts  # the meta-device twin the meter and estimate count

    # FLOPs against FlopCounterMode, forward and backward (eager attention computes the full square).
    model.set_attention(eager)
    B, T = 3, 16
    idx = torch.randint(0, m.vocab_size, (B, T))
    flops = mfu.token_flops(model, T, causal_halving=False, micro_batch_size=B, loss_chunk_tokens=0)
    total = flops_seen(lambda: model(idx, idx).backward())
    assert flops.full_attention == 6 * counts.n_6n + 12 * 2 * T * 32
    assert total == pytest.approx((flops.full_attention - 6 * counts.norms) * B * T, rel=0.01)
    # train.recompute: every block's forward again but its down projection w2 (HFU's convention, measured).
    model.zero_grad(set_to_none=True)
    model.recompute_blocks = True
    recomputed = flops_seen(lambda: model(idx, idx).backward())
    again = mfu.token_flops(model, T, False, B, 0, recompute=True)
    assert again.hardware - again.model == 2 * 2 * (block - 48 * 32 + 2 * 32) + 12 * 2 * T * 32 // 3
    assert recomputed - total == (again.hardware - again.model - 2 * 2 * 2 * 32) * B * T

    # Memory: parameters as counted, activations as autograd saves them in the variant's block.
    t = Training("fp32", "adamw", micro_batch_size=B, seq_len=T, loss_chunk_tokens=0)
    assert device_memory(mfu.meta_model(m), t, "ddp").params == 4 * counts.total
    for precision in ("bf16", "bf16-pure"):  # (fp32 with GQA: the formula follows CUDA's K/V repeat, test_memory.py)
        assert _saved_bytes_per_token(m, precision, batch=1) == pytest.approx(
            activation_bytes_per_token(Block(m), precision), rel=0.02)

    # MFU: the meter of a run of this config counts the variant (two H100s at 1 s a step).
    cfg = load_config(None, [("train.precision", "bf16")])
    cfg.model = m
    meter = mfu.meter_for_run(cfg, named_device("NVIDIA H100 80GB HBM3", world_size=2))
    assert meter.flops.model == mfu.token_flops(model, cfg.train.seq_len).model
    out = meter.update(step=10, window_steps=2, step_seconds=1.0)
    assert out["mfu"] == pytest.approx(cfg.train.global_batch_tokens * meter.flops.model / (2 * 989.5e12))
