"""`nanopt runs` (nanopt/lab/runs.py): statistics against hand computations (scipy only for the t distribution's
quantiles and CDF), runs grouped by setting with each (setting, seed) counted once, where a group's spread comes
from (a damaged file: test_schema.py). The runs are written by hand (conftest)."""
from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest
from conftest import FAKE_LOSSES, error_line, read_out, write_config_run, write_fake_run
from scipy import stats

from nanopt.cli import run as cli
from nanopt.config import Config, configs_dir, load_config, parse_overrides, to_yaml
from nanopt.lab import runs as experiments
from nanopt.lab.runs import describe, seeds_needed, welch

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
    # A clear win and a clear loss.
    better, worse = [3.00, 3.01, 3.02, 2.99, 3.00], [3.10, 3.12, 3.11, 3.09, 3.13]
    win = welch(better, worse, "final_val_loss", 0.01)
    assert win["p"] < 0.01 and win["p"] == pytest.approx(_welch_by_hand(better, worse)[2]) and win["a_beats_b"]
    loss = welch(worse, better, "final_val_loss", 0.05)
    assert loss["p"] > 0.5 and loss["p"] == pytest.approx(1 - win["p"]) and loss["a_beats_b"] is False
    # On a task score (higher is better) the test asks whether A is higher.
    higher = welch([0.5, 0.52, 0.51], [0.3, 0.31, 0.29], "task:mc/acc", 0.05, lower_is_better=False)
    lower = welch([0.5, 0.52, 0.51], [0.3, 0.31, 0.29], "final_val_loss", 0.05)
    assert higher["a_beats_b"] and higher["alternative"] == "mean(A) > mean(B)"
    assert not lower["a_beats_b"] and higher["p"] < 0.01 < lower["p"]
    # Too few runs, or no spread: no test, and why.
    c = welch([1.0], [2.0, 3.0], "final_val_loss", 0.05)
    assert not c["testable"] and c["p"] is None and "n is too small" in c["reason"] and "A has 1" in c["reason"]
    c = welch([1.0, 1.0], [2.0, 2.0], "step_to_target", 0.05)
    assert not c["testable"] and "no spread" in c["reason"] and c["difference"] == -1.0


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


ADAMW = [4.52, 4.50, 4.55]
MUON = [4.31, 4.30, 4.33]
SECONDS = {"adamw": [12.0, 12.5, 11.8], "muon": [9.1, 9.4, 9.0]}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """runs/sw/<point>/: 3 seeds each of adamw and muon, also differing in neutral keys (checkpointing, sampling);
    one adamw run with another max_steps; one unfinished run. Read only."""
    root = tmp_path_factory.mktemp("runs")
    for opt, losses in (("adamw", ADAMW), ("muon", MUON)):
        for i, loss in enumerate(losses):
            write_config_run(root / "sw" / f"optim.name={opt},seed={i}", 1337 + i,
                             {"final_val_loss": loss, "final_val_bpb": loss * 1.44,
                              "train_seconds_to_target": SECONDS[opt][i], "step_to_target": 150,
                              "tokens_to_target": 150 * 8192},
                             **{"optim.name": opt, "checkpoint.every": 10 * i, "sample.num_samples": i})
    write_config_run(root / "short", 7, {"final_val_loss": 4.9}, **{"train.max_steps": 100})
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
    assert [r.config["run.seed"] for r in groups["train.max_steps=200,optim.name=muon"].runs] == [1337, 1338, 1339]
    assert groups["train.max_steps=100,optim.name=adamw"].values == {"train.max_steps": "100", "optim.name": "adamw"}
    assert [r.name for r in groups["train.max_steps=200,optim.name=adamw"].runs] == [
        f"sw/optim.name=adamw,seed={i}" for i in range(3)]
    only_sweep = experiments.group_runs(experiments.find_runs(sweep / "sw")[0])
    assert [g.name for g in only_sweep] == ["optim.name=adamw", "optim.name=muon"]


def _config_run(path: Path, config: Any, seed: int, loss: float, *overrides: str) -> None:
    cfg = load_config(config, parse_overrides([*overrides, f"--run.seed={seed}"]))
    cfg.run.name, cfg.run.dir = path.name, str(path)
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(to_yaml(cfg))
    (path / "summary.json").write_text(json.dumps({"steps": 200, "hardware": "cpu", "world_size": 1,
                                                   "final_val_loss": loss}))


def test_a_sweep_beside_runs_of_other_configs_is_named_by_its_one_grid_key(tmp_path, capsys):
    """Before: the README's run, speedrun.md's and a sweep of two settings were named by the ~30 keys that differ
    between tiny.yaml and speedrun-cpu.yaml, a 567-column table."""
    root = tmp_path / "runs"
    _config_run(root / "tiny", None, 1337, 2.2)
    _config_run(root / "sdpa", configs_dir() / "speedrun-cpu.yaml", 1337, 2.0, "--train.target_val_loss=1.6")
    for opt in ("adamw", "muon"):
        for seed in (1337, 1338):
            _config_run(root / "tiny-sweep" / f"optim.name={opt},seed={seed}", configs_dir() / "tiny.yaml", seed,
                        2.1 + (opt == "muon") / 10 + (seed - 1337) / 100, f"--optim.name={opt}", "--runtime.threads=1")
    groups = experiments.group_runs(experiments.find_runs(root)[0])
    assert [(g.name, g.values) for g in groups] == [
        ("sdpa", {}), ("tiny", {}), ("tiny-sweep/optim.name=adamw", {"optim.name": "adamw"}),
        ("tiny-sweep/optim.name=muon", {"optim.name": "muon"})]
    assert [g.name for g in experiments.group_runs(experiments.find_runs(root / "tiny-sweep")[0])] == [
        "optim.name=adamw", "optim.name=muon"]
    assert cli(["runs", str(root), "--compare", "muon", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "A = tiny-sweep/optim.name=muon" in out and max(map(len, out.splitlines())) <= 100
    # A directory of seeds of one setting is named by the directory.
    shutil.rmtree(root / "tiny-sweep" / "optim.name=muon,seed=1337")
    shutil.rmtree(root / "tiny-sweep" / "optim.name=muon,seed=1338")
    assert [g.name for g in experiments.group_runs(experiments.find_runs(root)[0])] == ["sdpa", "tiny", "tiny-sweep"]


def test_runs_cli_prints_group_statistics_json_or_the_leaderboard(sweep, capsys):
    assert cli(["runs", str(sweep)]) == 0
    out = capsys.readouterr().out
    muon = describe(MUON)
    row = next(line for line in out.splitlines() if line.startswith("train.max_steps=200,optim.name=muon"))
    assert row.split()[1:] == ["3", "time", "to", "target", "(s)", "3", f"{statistics.mean(SECONDS['muon']):.2f}",
                               f"{statistics.stdev(SECONDS['muon']):.2f}", *row.split()[-2:]]
    assert f"{muon['mean']:.4f}" in out and f"[{muon['ci95'][0]:.4f}, {muon['ci95'][1]:.4f}]" in out
    assert "skipped" in out and "seed=3: not finished" in out
    assert "every group of several runs: spread from both init and data order" in out  # a run.seed sweep

    assert cli(["runs", str(sweep), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    g = next(g for g in data["groups"] if g["name"] == "train.max_steps=200,optim.name=muon")
    # Field by field: pytest >= 9 refuses approx() of a dict holding a list (ci95).
    assert g["n"] == 3 and set(g["stats"]["final_val_loss"]) == set(muon)
    assert all(g["stats"]["final_val_loss"][k] == pytest.approx(v) for k, v in muon.items())
    assert g["stats"]["step_to_target"]["sd"] == 0 and "train_seconds_to_target" in g["stats"]
    short = next(g for g in data["groups"] if g["name"].startswith("train.max_steps=100"))
    assert set(short["stats"]) == {"final_val_loss"}  # only the figures its run has
    assert len(data["runs"]) == 7 and data["comparison"] is None
    # The leaderboard when runs do not group (a run directory itself is a DIR with one run), or with --runs.
    assert cli(["runs", str(sweep / "short")]) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[:3] == ["run", "target", "to"]
    assert cli(["runs", str(sweep), "--runs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["run", "target", "to"]
    assert lines[2].startswith("sw/optim.name=muon,seed=2 ")  # fastest to target first


def test_runs_compare_says_whether_a_beats_b(sweep, capsys):
    assert cli(["runs", str(sweep), "--compare", "muon", "200,optim.name=adamw"]) == 0
    out = capsys.readouterr().out
    p = _welch_by_hand(MUON, ADAMW)[2]
    assert p < 0.01
    assert "A = train.max_steps=200,optim.name=muon" in out and "Welch's t-test, one-sided" in out
    assert f"p = {p:.3g}" in out and "A beats B at alpha = 0.05" in out
    n = seeds_needed(statistics.stdev(MUON), statistics.stdev(ADAMW), statistics.fmean(MUON) - statistics.fmean(ADAMW))
    assert f"the observed {statistics.fmean(MUON) - statistics.fmean(ADAMW):.4f}: {n} seeds per group" in out
    assert cli(["runs", str(sweep), "--compare", "muon", "200,optim.name=adamw", "--effect", "0.001", "--json"]) == 0
    seeds = json.loads(capsys.readouterr().out)["comparison"]["seeds"]
    assert seeds["seeds_for_observed"] == n and seeds["alpha"] == 0.01 and seeds["power"] == 0.8
    assert seeds["seeds_for_difference"] == seeds_needed(seeds["sd_a"], seeds["sd_b"], 0.001) > n

    assert cli(["runs", str(sweep), "--compare", "200,optim.name=adamw", "muon",
                "--metric", "train_seconds_to_target", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)["comparison"]
    assert c["metric"] == "train_seconds_to_target" and c["a_beats_b"] is False
    assert c["p"] == pytest.approx(_welch_by_hand(SECONDS["adamw"], SECONDS["muon"])[2]) and c["p"] > 0.5
    assert c["a"]["name"] == "train.max_steps=200,optim.name=adamw" and c["b"]["n"] == 3

    # Directories of seeds stand for their runs; a single run is n = 1, too few to test.
    a_dir = sweep / "sw" / "optim.name=muon,seed=0"
    assert cli(["runs", str(sweep), "--compare", str(a_dir), "muon"]) == 0
    out = capsys.readouterr().out
    assert "no test: n is too small to test: A has 1 and B has 3" in out


@pytest.mark.parametrize("args, words", [
    (["runs", "{root}/nowhere"], ["nowhere is not a directory"]),
    (["runs", "{root}", "--compare", "lion", "muon"], ["no group name contains 'lion'", "optim.name=muon"]),
    (["runs", "{root}", "--compare", "adamw", "muon"], ["matches 2 groups", "give more of the name"]),
    (["runs", "{root}", "--compare", "{root}", "muon"], ["holds 3 settings, not one"]),
    (["runs", "{root}", "--compare", "muon", "max_steps=100", "--metric", "nope"], ["--metric nope", "final_val_loss"]),
    (["runs", "{root}", "--alpha", "5"], ["--alpha 5.0"]),
    # without --compare these were silently ignored
    (["runs", "{root}", "--metric", "train_seconds"], ["--metric applies only with --compare"]),
    (["runs", "{root}", "--alpha", "0.01"], ["--alpha applies only with --compare"]),
    (["runs", "{root}", "--effect", "0.1"], ["--effect applies only with --compare"]),
    (["compare", "{root}/sw", "{root}/short"], ["is not a run directory", "nanopt runs"]),
    (["compare", "{root}/sw/optim.name=muon,seed=3", "{root}/short"], ["has no summary.json", "not finished"]),
    (["compare", "{root}/short", "{root}/gone"], ["gone is not a directory"]),
])
def test_bad_input_exits_2_naming_it(sweep, capsys, args, words):
    assert cli([a.format(root=sweep) for a in args]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


# ---------------------------------------------------------------- where a group's spread comes from
def test_init_and_data_seeds_are_seeds_of_one_setting_and_say_where_the_spread_comes_from(tmp_path, capsys):
    """A sweep over run.init_seed (data seed fixed) and one over run.data_seed (init seed fixed)."""
    root = tmp_path / "runs"
    by_init, by_data = [3.50, 3.52, 3.47], [3.490, 3.500, 3.495]
    for k in range(3):
        write_config_run(root / "init" / f"i{k}", 1337, {"final_val_loss": by_init[k]}, **{"run.init_seed": k + 1})
        write_config_run(root / "data" / f"d{k}", 1337, {"final_val_loss": by_data[k]}, **{"run.data_seed": k + 1})
    # Another run.seed, but the init and data seeds of init/i0: the same run again, counted once.
    write_config_run(root / "zz", 5, {"final_val_loss": 3.0}, **{"run.init_seed": 1, "run.data_seed": 1337})
    assert cli(["runs", str(root / "init")]) == 0
    assert "all: spread from init only (data seed 1337 fixed)" in capsys.readouterr().out
    assert cli(["runs", str(root / "data")]) == 0
    assert "all: spread from data order only (init seed 1337 fixed)" in capsys.readouterr().out

    assert cli(["runs", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("6 runs in 1 group(s)") and "all: spread from both init and data order" in out
    assert (f"  final val loss sd: init alone {statistics.stdev(by_init):.4f} (3 runs, data seed 1337); "
            f"data order alone {statistics.stdev(by_data):.4f} (3 runs, init seed 1337)") in out
    assert f"warning: {root / 'zz'} repeats {root / 'init' / 'i0'} (the same setting, init seed 1 and data seed " \
           f"1337): counted once" in out
    assert cli(["runs", str(root), "--json"]) == 0
    group = json.loads(capsys.readouterr().out)["groups"][0]
    assert group["n"] == 6 and [1, 1337] in group["seed_pairs"] and [1337, 3] in group["seed_pairs"]
    spread = group["spread"]
    assert spread["from"] == "both" and spread["init_only"]["data_seed"] == 1337
    assert spread["init_only"]["runs"] == ["init/i0", "init/i1", "init/i2"]
    assert spread["data_only"]["stats"]["final_val_loss"]["sd"] == pytest.approx(statistics.stdev(by_data))


# ---------------------------------------------------------------- each (setting, seed) counted once
def _comparison(root: Path, capsys) -> dict[str, Any]:
    assert cli(["runs", str(root), "--compare", "muon", "adamw", "--json"]) == 0
    return json.loads(read_out(capsys)[0])


def test_a_copied_sweep_counts_each_seed_once_and_says_so(fake_sweep, capsys):
    once = _comparison(fake_sweep, capsys)
    shutil.copytree(fake_sweep / "sw", fake_sweep / "sw-copy")
    twice = _comparison(fake_sweep, capsys)
    assert twice["comparison"]["p"] == pytest.approx(once["comparison"]["p"]) and once["comparison"]["p"] < 0.01
    assert twice["comparison"]["a"]["n"] == once["comparison"]["a"]["n"] == 3
    assert [g["n"] for g in twice["groups"]] == [g["n"] for g in once["groups"]] == [3, 3]
    assert len(twice["runs"]) == 6 and not once["warnings"]
    assert len(twice["warnings"]) == 6
    assert f"{fake_sweep / 'sw-copy' / 'muon-0'} repeats {fake_sweep / 'sw' / 'muon-0'}" in "\n".join(twice["warnings"])

    assert cli(["runs", str(fake_sweep)]) == 0
    out, _ = read_out(capsys)
    assert out.splitlines()[0].startswith("6 runs in 2 group(s)")
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 6 and all("repeats" in w and "counted once" in w for w in warnings)
    assert any(str(fake_sweep / "sw-copy" / "adamw-2") in w and str(fake_sweep / "sw" / "adamw-2") in w
               for w in warnings)


def test_group_runs_keeps_the_first_of_a_repeat_by_path_order(fake_sweep):
    shutil.copytree(fake_sweep / "sw" / "muon-0", fake_sweep / "aa-copy")  # sorts before sw/: it is the one kept
    groups = experiments.group_runs(experiments.find_runs(fake_sweep)[0])
    muon = next(g for g in groups if g.values == {"optim.name": "muon"})
    assert [r.name for r in muon.runs] == ["aa-copy", "sw/muon-1", "sw/muon-2"]
    assert [(r.run.name, r.first.name) for r in muon.repeats] == [("sw/muon-0", "aa-copy")]


# ---------------------------------------------------------------- a run that holds runs
def test_runs_lists_a_run_and_the_runs_below_it(fake_sweep, capsys):
    holder = write_fake_run(fake_sweep / "sw", 7, {"final_val_loss": 4.9}, **{"train.max_steps": 100})
    assert cli(["runs", str(holder), "--json"]) == 0
    names = [r["run"] for r in json.loads(read_out(capsys)[0])["runs"]]
    assert sorted(names) == sorted(["sw", *(f"{o}-{i}" for o in FAKE_LOSSES for i in range(3))])


# ---------------------------------------------------------------- task scores and flags
@pytest.mark.parametrize("effect", ["nan", "inf", "-inf", "0", "-0.5"])
@pytest.mark.usefixtures("offline")
def test_runs_compare_effect_must_be_finite_and_positive(effect, tmp_path, capsys):
    assert cli(["runs", str(tmp_path), "--compare", "a", "b", f"--effect={effect}"]) == 2
    assert f"--effect {float(effect)}" in error_line(capsys.readouterr().err, "runs")
