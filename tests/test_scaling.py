"""The scaling-law fitter: it recovers a known law from noisy isoFLOP data, predicts the optimum the closed form
gives, reads CSVs and ladders, and refuses a CSV it cannot use with one paragraph (exit 2); the plan."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import one_paragraph

from nanopt import cli
from nanopt.config import load_config
from nanopt.errors import ConfigError
from nanopt.lab import scaling, sweep
from nanopt.recipe.mfu import meta_model, token_flops

# Hoffmann et al.'s fitted law (their eq. 10): the data below is drawn from it.
TRUE = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


def ladder(noise: float = 0.003, budgets=(1e18, 3e18, 1e19, 3e19, 1e20), sizes: int = 7, seed: int = 1):
    """An isoFLOP grid: at each budget, `sizes` models spread 6x either side of the law's optimum, D = C / 6N."""
    rng = np.random.default_rng(seed)
    n, d, c = [], [], []
    for budget in budgets:
        centre = scaling.optimum(TRUE, budget)["params"]
        for f in np.geomspace(1 / 6, 6, sizes):
            n.append(centre * f)
            d.append(budget / (6 * centre * f))
            c.append(budget)
    n, d, c = map(np.array, (n, d, c))
    loss = np.array([scaling.predict_loss(TRUE, a, b) for a, b in zip(n, d)]) * np.exp(rng.normal(0, noise, len(n)))
    return scaling.Points(n, d, c, loss)


@pytest.fixture(scope="module")
def fitted():
    points = ladder()
    return points, scaling.fit(points, bootstrap=20)


@pytest.mark.slow  # the fit's bootstrap (~8 s, shared)
def test_approach_3_recovers_the_law_and_approach_2_each_budgets_optimum_from_noisy_data(fitted):
    points, out = fitted
    for key, tolerance in (("E", 0.03), ("alpha", 0.05), ("beta", 0.05), ("A", 0.3), ("B", 0.3)):
        assert out[key]["value"] == pytest.approx(TRUE[key], rel=tolerance), key
        lo, hi = out[key]["ci"]
        assert lo <= out[key]["value"] <= hi
    # The exponents the law implies for the optimal allocation under C = 6ND, from either approach.
    a = TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"])
    assert out["approach3_a"] == pytest.approx(a, abs=0.02) and out["approach3_b"] == pytest.approx(1 - a, abs=0.02)
    assert out["a"]["value"] == pytest.approx(a, abs=0.03) and out["b"]["value"] == pytest.approx(1 - a, abs=0.03)
    assert out["a"]["value"] + out["b"]["value"] == pytest.approx(1, abs=1e-6)  # C = 6ND: exponents sum to 1
    assert out["budget_count"] == 5 and out["runs"] == len(points.loss) == 35
    for c, n in zip(out["isoflop"]["budgets"], out["isoflop"]["params_opt"]):
        assert n == pytest.approx(scaling.optimum(TRUE, c)["params"], rel=0.25)
    assert all(10 < r < 60 for r in out["tokens_per_param"])  # Chinchilla's ~20 at these budgets, within noise


def test_the_optimum_is_the_closed_form_under_6nd():
    c = 1e21
    got = scaling.optimum(TRUE, c)
    al, be = TRUE["alpha"], TRUE["beta"]
    g = (al * TRUE["A"] / (be * TRUE["B"])) ** (1 / (al + be))
    assert got["params"] == pytest.approx(g * (c / 6) ** (be / (al + be)), rel=1e-3)
    assert got["tokens"] * got["params"] * 6 == pytest.approx(c)
    assert got["loss"] == pytest.approx(scaling.predict_loss(TRUE, got["params"], got["tokens"]))
    # Another FLOPs-per-token rule moves the optimum: 8N per token leaves fewer tokens at each size.
    other = scaling.optimum(TRUE, c, tokens_for=lambda n, budget: budget / (8 * n))
    assert other["tokens"] * other["params"] * 8 == pytest.approx(c) and other["loss"] > got["loss"]


@pytest.mark.slow  # the fit's bootstrap (~8 s, shared)
def test_a_csv_of_flops_or_tokens_fits_the_same_and_the_command_prints_json_predicts_and_plots(tmp_path, fitted,
                                                                                               capsys):
    points, _ = fitted
    by_tokens, by_flops, png = tmp_path / "tokens.csv", tmp_path / "flops.csv", tmp_path / "fit.png"
    by_tokens.write_text("params,tokens,loss,extra\n" + "".join(
        f"{n},{d},{l},x\n" for n, d, l in zip(points.params, points.tokens, points.loss)))
    by_flops.write_text("loss,params,flops\n" + "".join(
        f"{l},{n},{6 * n * d}\n" for n, d, l in zip(points.params, points.tokens, points.loss)))
    a, b = scaling.from_csv(by_tokens), scaling.from_csv(by_flops)
    np.testing.assert_allclose(a.tokens, b.tokens, rtol=1e-9)
    np.testing.assert_allclose(a.flops, points.flops, rtol=1e-9)
    assert len(a.budgets()) == 5
    assert cli.run(["scaling", "fit", "--csv", str(by_tokens), "--json", "--bootstrap", "5", "--predict", "1e22",
                    "--plot", str(png)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(scaling.LAW_KEYS) | {"a", "b"} <= set(result)
    assert all(isinstance(result[k]["value"], float) and len(result[k]["ci"]) == 2 for k in ("E", "alpha", "a"))
    (prediction,) = result["predictions"]
    assert prediction["flops"] == 1e22 and prediction["loss"] < min(points.loss)  # more compute, lower loss
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # the fit's bootstrap (~8 s, shared)
def test_a_ladder_directory_is_read_from_its_summaries(tmp_path, fitted):
    points, _ = fitted
    for i, (n, d, l) in enumerate(zip(points.params, points.tokens, points.loss)):
        run = tmp_path / "ladder" / f"r{i}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"steps": 10, "params": int(n), "tokens_seen": int(d),
                                                      "flops_per_token": 6 * int(n), "final_val_bpb": l}))
    got = scaling.from_runs(tmp_path / "ladder")
    assert len(got.loss) == 35 and len(got.budgets()) == 5
    np.testing.assert_allclose(np.sort(got.loss), np.sort(points.loss))


BAD_CSVS = [
    ("", "lacks params, tokens, loss"),
    ("params,loss\n1,2\n", "lacks tokens"),
    ("params,tokens,loss\n1e6,2e7,abc\n", "line 2"),
    ("params,tokens,loss\n1e6,2e7\n", "line 2"),
    ("params,tokens,loss\n-1e6,2e7,3.1\n", "positive numbers"),
    ("params,tokens,loss\n1e6,2e7,inf\n", "positive numbers"),
    ("params,flops,loss\n" + "".join(f"{n},1e15,{3 - n / 1e7}\n" for n in (1e6, 2e6, 3e6)), "1 compute budget"),
    ("params,flops,loss\n" + "".join(f"{n},{c},3\n" for c in (1e15, 1e16) for n in (1e6, 2e6)), "3 or more"),
]


@pytest.mark.parametrize("text, says", BAD_CSVS)
def test_a_csv_it_cannot_use_is_one_paragraph_and_exit_2(tmp_path, capsys, text, says):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        scaling.from_csv(path)
    assert str(path) in str(e.value) and says in str(e.value) and "params,tokens,loss" in str(e.value)
    assert cli.run(["scaling", "fit", "--csv", str(path)]) == 2
    err = one_paragraph(capsys.readouterr().err)
    assert says in err and str(path) in err


def test_too_few_runs_for_a_parabola_has_no_optimum():
    assert math.isnan(scaling._vertex(np.log([1e6, 1e6, 2e6]), np.array([3.0, 3.1, 2.9])))


# ---------------------------------------------------------------- the plan
LADDER = Path(__file__).resolve().parent.parent / "configs" / "ladder-cpu.yaml"


def test_the_plan_spends_each_budget_at_each_runs_own_flops_by_the_configs_rules():
    ref = load_config(LADDER).train
    rungs = scaling.plan(LADDER, [], [1e12, 4e12], 4)
    assert len(rungs) == 8 and len({r.name for r in rungs}) == 8
    for r in rungs:
        model = meta_model(load_config(LADDER, [("model.depth", str(r.depth))]).model)
        assert (r.params, r.flops_per_token) == (model.num_params(), token_flops(model, ref.seq_len).model)
        assert abs(r.tokens * r.flops_per_token - r.budget) <= r.batch_tokens * r.flops_per_token  # whole steps
        assert r.batch_tokens % (ref.micro_batch_size * ref.seq_len) == 0
        assert r.lr == pytest.approx(ref.lr * (r.batch_tokens / ref.global_batch_tokens) ** 0.5)  # the √ rule
        # AdamW's timescale 1/(lr·wd) is the reference's share of the run.
        assert r.lr * r.weight_decay * r.steps == pytest.approx(ref.lr * ref.weight_decay * ref.max_steps)
        assert 0 <= r.warmup_steps < r.steps
        assert r.overrides()["model.depth"] == r.depth and r.overrides()["train.max_steps"] == r.steps
    for budget in (1e12, 4e12):  # consecutive depths either side of 20 tokens per parameter
        here = [r for r in rungs if r.budget == budget]
        assert [r.depth for r in here] == list(range(here[0].depth, here[0].depth + 4))
        assert max(r.tokens / r.n_6n for r in here) > 20 > min(r.tokens / r.n_6n for r in here)
    # The rules are config keys: no batch scaling and a fixed weight decay keep the reference's values.
    for r in scaling.plan(LADDER, [("scaling.batch_exponent", "0"), ("scaling.weight_decay", "fixed")], [1e12], 3):
        assert (r.batch_tokens, r.lr, r.weight_decay) == (ref.global_batch_tokens, ref.lr, ref.weight_decay)


def test_the_plan_command_prints_every_run_and_writes_a_ladder_the_sweep_reads(tmp_path, capsys):
    assert cli.run(["scaling", "plan", str(LADDER), "--budgets", "1e12,2e12", "--sizes", "3", "--out",
                    str(tmp_path / "ladder"), "--eval.batches=4"]) == 0
    out = capsys.readouterr().out
    assert out.split()[:5] == ["budget", "depth", "params", "tokens", "tokens/N"]
    assert "nanopt sweep" in out and "--points" in out and "--eval.batches=4" in out
    ladder = tmp_path / "ladder" / "ladder.yaml"
    points, configs = sweep.plan(str(LADDER), [], 1, ["--eval.batches=4"], 1, ladder)
    rungs = scaling.plan(LADDER, [], [1e12, 2e12], 3)
    assert [p.name for p in points] == [f"{r.name},seed=1337" for r in rungs]
    for p, r in zip(points, rungs):
        cfg = configs[p.name]
        assert (cfg.model.depth, cfg.train.max_steps, cfg.train.global_batch_tokens) == (r.depth, r.steps,
                                                                                         r.batch_tokens)
        assert cfg.eval.batches == 4
    with pytest.raises(SystemExit, match="^2$"):  # argparse's exit 2, with its usage
        cli.run(["scaling", "plan", str(LADDER), "--budgets", "1e12,x"])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--budgets" in err


@pytest.mark.slow  # the fit's bootstrap (~8 s, shared)
def test_a_held_out_run_is_checked_against_the_law_its_n_all_parameters_or_6ns(tmp_path, fitted):
    _, out = fitted
    run = tmp_path / "held-out"
    run.mkdir()
    n, d = 10**8, 3 * 10**9
    (run / "summary.json").write_text(json.dumps({"steps": 5, "params": n, "tokens_seen": d,
                                                  "final_val_bpb": 1.01 * scaling.predict_loss(TRUE, n, d)}))
    got = scaling.check(out, run, "final_val_bpb")
    assert got["error"] == pytest.approx(-0.01, abs=0.01)  # the fitted law is the true one, within its noise
    summary = {"params": 1000, "flops_per_token_6n": 4800, "tokens_seen": 7}
    assert scaling.count(summary, "params") == 1000 and scaling.count(summary, "n_6n") == 800
