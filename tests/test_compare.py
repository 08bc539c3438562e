"""`nanopt compare` (nanopt/lab/compare.py): val loss at equal steps, tokens, FLOPs and seconds (a damaged file of either
run: test_schema.py). The runs are written by hand; two real runs: e2e/test_compare_runs.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import write_config_run

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
