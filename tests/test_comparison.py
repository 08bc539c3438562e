"""`nanopt compare` (nanopt/comparison.py): val loss at equal steps, tokens, FLOPs and seconds, and a damaged or odd
file of either run named in one paragraph. The runs are written by hand; two real runs: e2e/test_compare_runs.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import BAD_UTF8, ODD_METRICS, damage, no_traceback, read_out, write_config_run
from nanopt import rundirs
from nanopt.cli import run as cli

# ---------------------------------------------------------------- compare at equal budgets


def write_curve(path: Path, step_ms: float, tokens_per_step: int, evals: dict[int, float]) -> None:
    """metrics.jsonl: a step record every 10 steps (each step `step_ms`) and evaluations {step: val loss}."""
    last = max(evals)
    steps = [{"step": s, "loss": 4.0, "step_ms": step_ms, "tokens_per_s": 1.0, "tokens_seen": s * tokens_per_step}
             for s in range(10, last + 1, 10)]
    vals = [{"step": s, "val_loss": v, "val_bpb": v, "tokens_seen": s * tokens_per_step} for s, v in evals.items()]
    lines = sorted(steps + vals, key=lambda r: (r["step"], "val_loss" in r))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_compare_val_loss_at_equal_steps_tokens_flops_and_seconds(tmp_path, capsys):
    a = write_config_run(tmp_path / "a", 1, {"flops_per_token": 1000, "final_val_loss": 3.0})
    b = write_config_run(tmp_path / "b", 1, {"flops_per_token": 2000, "final_val_loss": 3.3}, **{"run.init_seed": 7})
    write_curve(a, 100.0, 256, {0: 5.0, 20: 4.0, 40: 3.0})  # 4 s of training, 10,240 tokens
    write_curve(b, 50.0, 512, {0: 5.0, 15: 3.6, 30: 3.3})  # 1.5 s, 15,360 tokens, twice the FLOPs per token
    assert cli(["compare", str(a), str(b), "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert {"key": "run.init_seed", "a": "null", "b": "7"} in c["config_changes"]
    rows = {r["unit"]: r for r in c["equal_budgets"]}
    # Seconds, by hand: B trained 30 steps × 0.05 s = 1.5 s, A 40 × 0.1 s: both reached 1.5 s, which is A's
    # step 15, between its evaluations at steps 0 (5.0) and 20 (4.0); B's last evaluation.
    assert rows["seconds"]["budget"] == pytest.approx(1.5)
    assert rows["seconds"]["a"] == pytest.approx(5.0 + (15 - 0) / (20 - 0) * (4.0 - 5.0))
    assert rows["seconds"]["b"] == pytest.approx(3.3) and rows["seconds"]["delta"] == pytest.approx(3.3 - 4.25)
    # FLOPs: A's 10,240 tokens × 1000 are B's 5,120 tokens × 2000, B's step 10, between its steps 0 and 15.
    assert rows["flops"]["budget"] == 10240 * 1000 and rows["flops"]["a"] == pytest.approx(3.0)
    assert rows["flops"]["b"] == pytest.approx(5.0 + 10 / 15 * (3.6 - 5.0))
    assert (rows["steps"]["budget"], rows["steps"]["a"], rows["steps"]["b"]) == (30, pytest.approx(3.5), 3.3)
    assert (rows["tokens"]["budget"], rows["tokens"]["a"], rows["tokens"]["b"]) == (10240, 3.0, pytest.approx(3.5))

    assert cli(["compare", str(a), str(b)]) == 0
    md = capsys.readouterr().out
    assert "## Val loss at equal budgets" in md and "| training seconds | 1.50 | 4.2500 | 3.3000 | -0.9500 |" in md
    assert "| training FLOPs | 1.024e+07 | 3.0000 | 4.0667 | +1.0667 |" in md
    (b / "metrics.jsonl").write_text("")  # no evaluations: no budget, every cell "-"
    assert cli(["compare", str(a), str(b)]) == 0
    assert "| steps | - | - | - | - |" in capsys.readouterr().out


# ---------------------------------------------------------------- odd files


@pytest.mark.parametrize("data, words", ODD_METRICS)
def test_compare_names_a_damaged_metrics_line(fake_sweep, capsys, data, words):
    a, b = fake_sweep / "sw" / "adamw-0", fake_sweep / "sw" / "muon-0"
    path = damage(b, rundirs.METRICS_FILE, data)
    assert cli(["compare", str(a), str(b)]) == 2
    _, err = read_out(capsys)
    assert err.startswith("nanopt compare: error: ") and f"{path}: {words}" in err
    no_traceback(err)


@pytest.mark.parametrize("name, data, words", [
    (rundirs.CONFIG_FILE, BAD_UTF8, "the file is not UTF-8 text"),
    (rundirs.CONFIG_FILE, b"train: {max_steps: 9}\ndata: {date: 2020-01-01}\n", "`data.date` is a date"),
    (rundirs.CONFIG_FILE, b"train: {max_steps: 9}\nmfu: {warmup_steps: many}\n", "`mfu.warmup_steps` is a string"),
    (rundirs.SUMMARY_FILE, BAD_UTF8, "the file is not UTF-8 text"),
    (rundirs.SUMMARY_FILE, b'{"steps": 200, "final_val_loss": [4.3]}', "`final_val_loss`"),
    (rundirs.PROFILE_FILE, BAD_UTF8, "the file is not UTF-8 text"),
    (rundirs.PROFILE_FILE, b'{"step_ms_mean": "slow", "profiled_steps": 2}', "`step_ms_mean`"),
    (rundirs.PROFILE_FILE, b'{"step_ms_mean": 5.0, "profiled_steps": 2, "top_ops": [1]}', "`top_ops[0]`"),
    (rundirs.PROFILE_FILE, b'{"step_ms_mean": 5.0, "profiled_steps": 2, "label_ms": [1]}', "`label_ms`"),
    # A directory at the name (data None): before, read as no file (an unprofiled run, a config of no keys).
    (rundirs.PROFILE_FILE, None, "is a directory"),
    (rundirs.CONFIG_FILE, None, "is a directory"),
])
def test_compare_names_an_odd_file(fake_sweep, capsys, name, data, words):
    a, b = fake_sweep / "sw" / "adamw-0", fake_sweep / "sw" / "muon-0"
    good = b'{"step_ms_mean": 5.0, "profiled_steps": 2, "compute_share": 1.0, "top_ops": []}'
    (a / rundirs.PROFILE_FILE).write_bytes(good)  # both profiled: compare reads both profiles
    (b / rundirs.PROFILE_FILE).write_bytes(good)
    if data is None:
        (b / name).unlink()
        (b / name).mkdir()
    path = b / name if data is None else damage(b, name, data)
    assert cli(["compare", str(a), str(b)]) == 2
    _, err = read_out(capsys)
    assert err.startswith("nanopt compare: error: ") and str(path) in err and words in err, err
    assert err.count("\n") == 1  # one paragraph
    no_traceback(err)
