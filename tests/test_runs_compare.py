"""`nanopt runs` groups seeds and tests one group against another; `nanopt compare` sets two runs side by side.

Statistics are checked against hand computations (textbook formulas, scipy only for the t distribution's
quantiles and CDF); grouping on run directories written from real Config objects; compare on two real
tiny profiled runs."""
from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import pytest
from scipy import stats

from nanopt import experiments, profiling, rundirs
from nanopt.cli import run
from nanopt.config import Config, to_yaml
from nanopt.experiments import describe, seeds_needed, welch

from conftest import run_module, small_overrides


# ---------------------------------------------------------------- statistics against known samples


def test_describe_is_mean_sample_sd_and_student_t_interval():
    values = [4.10, 4.12, 4.15, 4.11]
    d = describe(values)
    mean = sum(values) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)  # n - 1
    half = 3.182446305284263 * sd / math.sqrt(4)  # t(0.975, df=3) from a printed table
    assert d["n"] == 4 and d["mean"] == pytest.approx(4.12) and d["sd"] == pytest.approx(sd)
    assert d["ci95"] == pytest.approx([mean - half, mean + half])
    assert describe([5.0]) == {"n": 1, "mean": 5.0, "sd": None, "ci95": None}
    assert describe([3.0, 3.0, 3.0])["ci95"] == [3.0, 3.0]  # no spread: a zero-width interval, not nan


def _welch_by_hand(a: list[float], b: list[float]) -> tuple[float, float, float, float]:
    """t, Welch-Satterthwaite df, one-sided p (H1: mean a < mean b) and the 95% half-width of the difference."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    t = (statistics.mean(a) - statistics.mean(b)) / se
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return t, df, stats.t.cdf(t, df), stats.t.ppf(0.975, df) * se


def test_welch_matches_the_hand_computation():
    a, b = [1.0, 2.0, 3.0], [4.0, 5.0, 7.0]
    t, df, p, half = _welch_by_hand(a, b)
    assert t == pytest.approx(-3.1622776601683795) and df == pytest.approx(3.4482758620689653)
    c = welch(a, b, "final_val_loss", 0.05)
    assert c["testable"] and c["t"] == pytest.approx(t) and c["df"] == pytest.approx(df)
    assert c["p"] == pytest.approx(p) and c["p"] == pytest.approx(0.041914517471454034 / 2)  # one-sided
    assert c["difference"] == pytest.approx(2 - 16 / 3)
    assert c["difference_ci95"] == pytest.approx([c["difference"] - half, c["difference"] + half])
    assert c["a_beats_b"] is True and c["alternative"] == "mean(A) < mean(B)"


def test_welch_clear_win_and_clear_loss():
    better, worse = [3.00, 3.01, 3.02, 2.99, 3.00], [3.10, 3.12, 3.11, 3.09, 3.13]
    win = welch(better, worse, "final_val_loss", 0.01)
    assert win["p"] < 0.01 and win["p"] == pytest.approx(_welch_by_hand(better, worse)[2]) and win["a_beats_b"]
    loss = welch(worse, better, "final_val_loss", 0.05)
    assert loss["p"] > 0.5 and loss["p"] == pytest.approx(1 - win["p"]) and loss["a_beats_b"] is False


def _power_by_hand(sd_a: float, sd_b: float, d: float, n: int, alpha: float) -> float:
    """Power of Welch's one-sided test with n seeds a side: P(T > t_crit) for T noncentral t with the
    Welch-Satterthwaite df and noncentrality d / se, written out from the formulas."""
    se2 = sd_a ** 2 / n + sd_b ** 2 / n
    df = se2 ** 2 / ((sd_a ** 2 / n) ** 2 / (n - 1) + (sd_b ** 2 / n) ** 2 / (n - 1))
    return 1 - stats.nct.cdf(stats.t.ppf(1 - alpha, df), df, d / math.sqrt(se2))


@pytest.mark.parametrize("sd_a, sd_b, d", [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (0.0013, 0.0021, 0.003), (2.0, 0.5, -1.5)])
def test_seeds_needed_is_the_least_n_whose_power_reaches_80_percent(sd_a, sd_b, d):
    n = seeds_needed(sd_a, sd_b, d, alpha=0.01)
    assert _power_by_hand(sd_a, sd_b, abs(d), n, 0.01) >= 0.8 > _power_by_hand(sd_a, sd_b, abs(d), n - 1, 0.01)
    # The normal approximation n = (z_0.99 + z_0.8)^2 (sd_a^2 + sd_b^2) / d^2 is a little below (t's fatter tails).
    approx = (stats.norm.ppf(0.99) + stats.norm.ppf(0.8)) ** 2 * (sd_a ** 2 + sd_b ** 2) / d ** 2
    assert approx <= n <= approx + 4
    assert seeds_needed(1.0, 1.0, 1.0) == 22  # the textbook figure for d = 1 at one-sided 0.01, power 0.8
    assert seeds_needed(1.0, 1.0, 0.0) is None and seeds_needed(0.0, 0.0, 0.1) == 2


def test_welch_says_when_n_is_too_small_or_there_is_no_spread():
    c = welch([1.0], [2.0, 3.0], "final_val_loss", 0.05)
    assert not c["testable"] and c["p"] is None and "n is too small" in c["reason"] and "A has 1" in c["reason"]
    c = welch([1.0, 1.0], [2.0, 2.0], "step_to_target", 0.05)
    assert not c["testable"] and "no spread" in c["reason"] and c["difference"] == -1.0


# ---------------------------------------------------------------- grouping synthetic run directories


def write_run(path: Path, seed: int, summary: dict, **changes: object) -> Path:
    """A finished run directory: config.yaml from a real Config with `changes` ("optim.name": "muon"), and
    summary.json."""
    cfg = Config()
    cfg.run.seed, cfg.run.name, cfg.run.dir = seed, path.name, str(path)
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(to_yaml(cfg))
    (path / "summary.json").write_text(json.dumps({"steps": 200, "hardware": "AMD EPYC", "world_size": 1, **summary}))
    return path


ADAMW = [4.52, 4.50, 4.55]
MUON = [4.31, 4.30, 4.33]
SECONDS = {"adamw": [12.0, 12.5, 11.8], "muon": [9.1, 9.4, 9.0]}


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """runs/sw/<point>/: 3 seeds each of adamw and muon; seeds also differ in neutral keys (checkpointing,
    sampling); one adamw run with another max_steps; one unfinished run."""
    root = tmp_path / "runs"
    for opt, losses in (("adamw", ADAMW), ("muon", MUON)):
        for i, loss in enumerate(losses):
            write_run(root / "sw" / f"optim.name={opt},seed={i}", 1337 + i,
                      {"final_val_loss": loss, "final_val_bpb": loss * 1.44, "train_seconds_to_target": SECONDS[opt][i],
                       "step_to_target": 150, "tokens_to_target": 150 * 8192},
                      **{"optim.name": opt, "checkpoint.every": 10 * i, "sample.num_samples": i})
    write_run(root / "short", 7, {"final_val_loss": 4.9}, **{"train.max_steps": 100})
    unfinished = root / "sw" / "optim.name=muon,seed=3"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text(to_yaml(Config()))
    return root


def test_runs_group_by_setting_and_split_on_a_result_changing_key(sweep):
    runs, skipped = experiments.find_runs(sweep)
    assert len(runs) == 7 and len(skipped) == 1 and "not finished" in skipped[0]
    groups = {g.name: g for g in experiments.group_runs(runs)}
    # Keys that vary between groups, in config order (train before optim); seeds, names, checkpoint.every
    # and sample.num_samples do not split a group; train.max_steps does.
    assert set(groups) == {"train.max_steps=200,optim.name=adamw", "train.max_steps=200,optim.name=muon",
                           "train.max_steps=100,optim.name=adamw"}
    assert groups["train.max_steps=200,optim.name=muon"].seeds == [1337, 1338, 1339]
    assert groups["train.max_steps=100,optim.name=adamw"].values == {"train.max_steps": "100", "optim.name": "adamw"}
    assert [r.name for r in groups["train.max_steps=200,optim.name=adamw"].runs] == [
        f"sw/optim.name=adamw,seed={i}" for i in range(3)]
    only_sweep = experiments.group_runs(experiments.find_runs(sweep / "sw")[0])
    assert [g.name for g in only_sweep] == ["optim.name=adamw", "optim.name=muon"]


def test_runs_cli_prints_group_statistics_and_json(sweep, capsys):
    assert run(["runs", str(sweep)]) == 0
    out = capsys.readouterr().out
    muon = describe(MUON)
    row = next(line for line in out.splitlines() if line.startswith("train.max_steps=200,optim.name=muon"))
    assert row.split()[1:] == ["3", "time", "to", "target", "(s)", "3", f"{statistics.mean(SECONDS['muon']):.2f}",
                               f"{statistics.stdev(SECONDS['muon']):.2f}", *row.split()[-2:]]
    assert f"{muon['mean']:.4f}" in out and f"[{muon['ci95'][0]:.4f}, {muon['ci95'][1]:.4f}]" in out
    assert "skipped" in out and "seed=3: not finished" in out

    assert run(["runs", str(sweep), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    g = next(g for g in data["groups"] if g["name"] == "train.max_steps=200,optim.name=muon")
    # Field by field: pytest >= 9 refuses approx() of a dict holding a list (ci95).
    assert g["n"] == 3 and set(g["stats"]["final_val_loss"]) == set(muon)
    assert all(g["stats"]["final_val_loss"][k] == pytest.approx(v) for k, v in muon.items())
    assert g["stats"]["step_to_target"]["sd"] == 0 and "train_seconds_to_target" in g["stats"]
    short = next(g for g in data["groups"] if g["name"].startswith("train.max_steps=100"))
    assert set(short["stats"]) == {"final_val_loss"}  # only the figures its run has
    assert len(data["runs"]) == 7 and data["comparison"] is None


def test_runs_compare_says_whether_a_beats_b(sweep, capsys):
    assert run(["runs", str(sweep), "--compare", "muon", "200,optim.name=adamw"]) == 0
    out = capsys.readouterr().out
    p = _welch_by_hand(MUON, ADAMW)[2]
    assert p < 0.01
    assert "A = train.max_steps=200,optim.name=muon" in out and "Welch's t-test, one-sided" in out
    assert f"p = {p:.3g}" in out and "A beats B at alpha = 0.05" in out
    n = seeds_needed(statistics.stdev(MUON), statistics.stdev(ADAMW), statistics.fmean(MUON) - statistics.fmean(ADAMW))
    assert f"the observed {statistics.fmean(MUON) - statistics.fmean(ADAMW):.4f}: {n} seeds per group" in out
    assert run(["runs", str(sweep), "--compare", "muon", "200,optim.name=adamw", "--effect", "0.001", "--json"]) == 0
    seeds = json.loads(capsys.readouterr().out)["comparison"]["seeds"]
    assert seeds["seeds_for_observed"] == n and seeds["alpha"] == 0.01 and seeds["power"] == 0.8
    assert seeds["seeds_for_difference"] == seeds_needed(seeds["sd_a"], seeds["sd_b"], 0.001) > n

    assert run(["runs", str(sweep), "--compare", "200,optim.name=adamw", "muon",
                "--metric", "train_seconds_to_target", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)["comparison"]
    assert c["metric"] == "train_seconds_to_target" and c["a_beats_b"] is False
    assert c["p"] == pytest.approx(_welch_by_hand(SECONDS["adamw"], SECONDS["muon"])[2]) and c["p"] > 0.5
    assert c["a"]["name"] == "train.max_steps=200,optim.name=adamw" and c["b"]["n"] == 3

    # Directories of seeds stand for their runs; a single run is n = 1, too few to test.
    a_dir = sweep / "sw" / "optim.name=muon,seed=0"
    assert run(["runs", str(sweep), "--compare", str(a_dir), "muon"]) == 0
    out = capsys.readouterr().out
    assert "no test: n is too small to test: A has 1 and B has 3" in out


def test_runs_leaderboard_when_runs_do_not_group(sweep, capsys):
    assert run(["runs", str(sweep / "short")]) == 0  # a run directory itself is a DIR with one run
    assert capsys.readouterr().out.splitlines()[0].split()[:3] == ["run", "target", "to"]
    assert run(["runs", str(sweep), "--runs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["run", "target", "to"]
    assert lines[2].startswith("sw/optim.name=muon,seed=2 ")  # fastest to target first


@pytest.mark.parametrize("args, words", [
    (["runs", "{root}/nowhere"], ["nowhere is not a directory"]),
    (["runs", "{root}", "--compare", "lion", "muon"], ["no group name contains 'lion'", "optim.name=muon"]),
    (["runs", "{root}", "--compare", "adamw", "muon"], ["matches 2 groups", "give more of the name"]),
    (["runs", "{root}", "--compare", "{root}", "muon"], ["holds 3 settings, not one"]),
    (["runs", "{root}", "--compare", "muon", "max_steps=100", "--metric", "nope"], ["--metric nope", "final_val_loss"]),
    (["runs", "{root}", "--alpha", "5"], ["--alpha 5.0"]),
    (["compare", "{root}/sw", "{root}/short"], ["is not a run directory", "nanopt runs"]),
    (["compare", "{root}/sw/optim.name=muon,seed=3", "{root}/short"], ["has no summary.json", "not finished"]),
    (["compare", "{root}/short", "{root}/gone"], ["gone is not a directory"]),
])
def test_bad_input_exits_2_naming_it(sweep, capsys, args, words):
    assert run([a.format(root=sweep) for a in args]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


# ---------------------------------------------------------------- where a group's spread comes from


def test_init_and_data_seeds_are_seeds_of_one_setting_and_say_where_the_spread_comes_from(tmp_path, capsys):
    """A sweep over run.init_seed (data seed fixed) and one over run.data_seed (init seed fixed), as
    `nanopt sweep --set run.init_seed=1,2,3` and `--set run.data_seed=1,2,3` make them."""
    root = tmp_path / "runs"
    by_init, by_data = [3.50, 3.52, 3.47], [3.490, 3.500, 3.495]
    for k in range(3):
        write_run(root / "init" / f"i{k}", 1337, {"final_val_loss": by_init[k]}, **{"run.init_seed": k + 1})
        write_run(root / "data" / f"d{k}", 1337, {"final_val_loss": by_data[k]}, **{"run.data_seed": k + 1})
    # Another run.seed, but the init and data seeds of init/i0: the same run again, counted once.
    write_run(root / "zz", 5, {"final_val_loss": 3.0}, **{"run.init_seed": 1, "run.data_seed": 1337})
    assert run(["runs", str(root / "init")]) == 0
    assert "all: spread from init only (data seed 1337 fixed)" in capsys.readouterr().out
    assert run(["runs", str(root / "data")]) == 0
    assert "all: spread from data order only (init seed 1337 fixed)" in capsys.readouterr().out

    assert run(["runs", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("6 runs in 1 group(s)") and "all: spread from both init and data order" in out
    assert (f"  final val loss sd: init alone {statistics.stdev(by_init):.4f} (3 runs, data seed 1337); "
            f"data order alone {statistics.stdev(by_data):.4f} (3 runs, init seed 1337)") in out
    assert f"warning: {root / 'zz'} repeats {root / 'init' / 'i0'} (the same setting, init seed 1 and data seed " \
           f"1337): counted once" in out
    assert run(["runs", str(root), "--json"]) == 0
    group = json.loads(capsys.readouterr().out)["groups"][0]
    assert group["n"] == 6 and [1, 1337] in group["seed_pairs"] and [1337, 3] in group["seed_pairs"]
    spread = group["spread"]
    assert spread["from"] == "both" and spread["init_only"]["data_seed"] == 1337
    assert spread["init_only"]["runs"] == ["init/i0", "init/i1", "init/i2"]
    assert spread["data_only"]["stats"]["final_val_loss"]["sd"] == pytest.approx(statistics.stdev(by_data))


def test_a_run_seed_sweep_varies_both_in_every_group(sweep, capsys):
    assert run(["runs", str(sweep)]) == 0
    assert "every group of several runs: spread from both init and data order" in capsys.readouterr().out


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
    a = write_run(tmp_path / "a", 1, {"flops_per_token": 1000, "final_val_loss": 3.0})
    b = write_run(tmp_path / "b", 1, {"flops_per_token": 2000, "final_val_loss": 3.3}, **{"run.init_seed": 7})
    write_curve(a, 100.0, 256, {0: 5.0, 20: 4.0, 40: 3.0})  # 4 s of training, 10,240 tokens
    write_curve(b, 50.0, 512, {0: 5.0, 15: 3.6, 30: 3.3})  # 1.5 s, 15,360 tokens, twice the FLOPs per token
    assert run(["compare", str(a), str(b), "--json"]) == 0
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

    assert run(["compare", str(a), str(b)]) == 0
    md = capsys.readouterr().out
    assert "## Val loss at equal budgets" in md and "| training seconds | 1.50 | 4.2500 | 3.3000 | -0.9500 |" in md
    assert "| training FLOPs | 1.024e+07 | 3.0000 | 4.0667 | +1.0667 |" in md
    (b / "metrics.jsonl").write_text("")  # no evaluations: no budget, every cell "-"
    assert run(["compare", str(a), str(b)]) == 0
    assert "| steps | - | - | - | - |" in capsys.readouterr().out


def test_profile_file_name_is_the_profilers():
    assert rundirs.PROFILE_FILE == profiling.SUMMARY_FILE


# ---------------------------------------------------------------- nanopt compare on real runs


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    """Two real tiny profiled runs: AdamW and Muon (5 steps, profile 1 wait / 1 warm-up / 2 recorded)."""
    root = tmp_path_factory.mktemp("compare")
    out = []
    for name in ("adamw", "muon"):
        run_dir = root / name
        proc = run_module(["nanopt.main", *small_overrides(**{"train.max_steps": 5, "eval.every": 5}),
                           f"--run.dir={run_dir}", f"--optim.name={name}", "--log.tensorboard=false",
                           "--profile.enabled=true", "--profile.wait=1", "--profile.warmup=1", "--profile.active=2"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        out.append(run_dir)
    return out[0], out[1]


def _median_speed(run_dir: Path, key: str) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r[key] for r in records if "loss" in r and r["step"] > 1)  # mfu.warmup_steps = 1


@pytest.mark.slow
def test_compare_real_runs_json_deltas_are_the_differences(two_runs, capsys):
    a, b = two_runs
    assert run(["compare", str(a), str(b), "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["config_changes"] == [{"key": "optim.name", "a": "adamw", "b": "muon"}]
    figures = {f["key"]: f for f in c["figures"]}
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    for key in ("tokens_per_s", "step_ms", "mfu"):
        assert figures[key]["a"] == pytest.approx(_median_speed(a, key))
        assert figures[key]["b"] == pytest.approx(_median_speed(b, key))
    for key in ("train_seconds", "final_val_loss", "final_val_bpb"):
        assert (figures[key]["a"], figures[key]["b"]) == (sa[key], sb[key])
    for f in figures.values():
        assert f["delta"] == pytest.approx(f["b"] - f["a"]) and f["ratio"] == pytest.approx(f["b"] / f["a"])
    assert "train_seconds_to_target" not in figures  # no target set: no row

    pa, pb = (json.loads((d / "profile_summary.json").read_text()) for d in (a, b))
    parts = {p["key"]: p for p in c["profile"]["parts"]}
    assert set(parts) >= {"step_ms_mean", "compute_share", "data_loader_share", "host_overhead_share",
                          "label_ms.forward", "label_ms.backward", "label_ms.optimizer"}
    for key in ("compute_share", "data_loader_share", "host_overhead_share"):
        assert parts[key]["a_ms"] == pytest.approx(pa[key] * pa["step_ms_mean"])
        assert parts[key]["b_ms"] == pytest.approx(pb[key] * pb["step_ms_mean"])
        assert parts[key]["delta_ms"] == pytest.approx(parts[key]["b_ms"] - parts[key]["a_ms"])
    assert sum(parts[k]["a_ms"] for k in ("compute_share", "data_loader_share", "host_overhead_share")) == \
        pytest.approx(parts["step_ms_mean"]["a_ms"])
    ops = c["profile"]["top_ops"]
    mm = next(op for op in ops if op["name"] == "aten::mm")
    a_mm = next(op for op in pa["top_ops"] if op["name"] == "aten::mm")
    b_mm = next(op for op in pb["top_ops"] if op["name"] == "aten::mm")
    assert mm["a_ms"] == pytest.approx(a_mm["self_ms"] / pa["profiled_steps"])
    assert mm["delta_ms"] == pytest.approx(b_mm["self_ms"] / pb["profiled_steps"] - mm["a_ms"])
    matched = [abs(op["delta_ms"]) for op in ops if op["delta_ms"] is not None]
    assert matched == sorted(matched, reverse=True) and len(matched) >= 3
    assert all(op["delta_ms"] is None for op in ops[len(matched):])  # ops in one top list only come last


def test_compare_real_runs_markdown_and_one_profile_missing(two_runs, tmp_path, capsys):
    a, b = two_runs
    assert run(["compare", str(a), str(b)]) == 0
    md = capsys.readouterr().out
    for row in ("| `optim.name` | adamw | muon |", "| tokens/s (median step) |", "| MFU (median step) |",
                "| step time, ms (median step) |", "| final val loss |", "| compute |", "| data loader |",
                "| host overhead |", "| `aten::mm` |", "## Top ops by self time"):
        assert row in md, row
    unprofiled = tmp_path / "unprofiled"
    shutil.copytree(b, unprofiled, ignore=shutil.ignore_patterns("checkpoints", "tb"))
    (unprofiled / "profile_summary.json").unlink()
    assert run(["compare", str(a), str(unprofiled)]) == 0
    md = capsys.readouterr().out
    assert "only A was profiled" in md and "## Profile" not in md and "| final val loss |" in md
    # The two real runs differ in a result-changing key, so `nanopt runs` lists them, one row each.
    assert run(["runs", str(a.parent)]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]] == ["adamw", "muon"]
