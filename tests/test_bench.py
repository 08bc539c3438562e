"""Every bench under bench/ runs: each at toy size, in this process where it can (its main(argv), so torch is not
imported again), so a moved helper or a renamed key fails here and not in front of the next person who measures.
The benches measure nothing here; speed is never asserted. bench/gpu_check.py's own smokes: tests/test_gpu_check.py.
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"


def bench(name: str) -> ModuleType:
    """bench/NAME.py as the module NAME (bench/ last on sys.path: its neighbours _common and _gpu import by name, and a
    spawned worker finds its module by name, while no bench name can shadow an installed package)."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve() == BENCH / f"{name}.py", f"{name} is another module: {module.__file__}"
    return module


def run(name: str, argv: list[str], capsys) -> str:
    """main(argv) of bench NAME, which must succeed; its standard output."""
    rc = bench(name).main(argv)
    assert rc in (None, 0), rc
    return capsys.readouterr().out


def test_checkpoint_save_runs(tmp_path, capsys):
    out = run("checkpoint_save", ["--gib", "0.001", "--repeats", "1", "--dir", str(tmp_path / "ck")], capsys)
    assert "command : python bench/checkpoint_save.py --gib 0.001 --repeats 1 --dir" in out
    for name in ("nanopt", "write+reread", "crc-in-write", "bytes only"):
        assert f"| {name} | " in out
    assert "nanopt / write+reread = " in out and "nanopt's checkpoint verifies (sizes, crc32s, step): yes" in out
    assert not (tmp_path / "ck").exists()  # the bench cleans up after itself


def test_ablation_runs(tmp_path, capsys):
    """One whole `python -m nanopt.main` run (the recipe at toy width, a target it meets at once): the summary's
    keys the table reads; every variant's overrides are checked against the config before it."""
    out = run("ablation", ["--smoke", "--target-bpb", "100", "--json", str(tmp_path / "a.json")], capsys)
    assert "| recipe | 0 ± 0 | 0.0 ± 0.0 | `-` |" in out and "1 variant(s) x 1 seed(s) at toy size" in out
    result = json.loads((tmp_path / "a.json").read_text())["results"]["recipe"][0]
    assert result["reached"] is True and result["final_val_bpb"] > 0


def test_ablation_refuses_an_unknown_variant_naming_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit:
        bench("ablation").main(["--target-bpb", "3", "--only", "recipe,bogus,adamw lr 2e-3 450 steps"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1, err  # one paragraph, before any run
    assert "--only names 'bogus', which is not a variant" in err and "'adamw lr 2e-3 450 steps'" in err
    assert "'no qk_norm'" in err and "'relu2 mlp'" in err


def test_ablation_refuses_a_variant_whose_override_does_not_load(capsys):
    with pytest.raises(SystemExit) as exit:
        bench("ablation").main(["--target-bpb", "3", "--variant", "typo=--model.dimm=8", "--only", "typo"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("bench/ablation.py: variant 'typo' (--model.dimm=8) does not load")
    assert "model.dimm" in err and err.count("\n") == 1, err


@pytest.mark.slow  # two real runs: ~8 s on 2 cores
def test_omp_policy_runs(capsys):
    """Two real training processes, one per policy; what it measures and each run's result go to stderr as they
    finish (the full bench is 80 runs: it must not be silent for minutes)."""
    bench("omp_policy").main(["--smoke"])
    out = capsys.readouterr()
    assert "2 runs of 3 steps" in out.out and "| nanogpt | 1 | quiet | " in out.out
    assert out.err.startswith("measuring nanogpt shape, 1 rank(s), quiet: unset, PASSIVE x 1 round(s)\n")
    assert "[1/2] round 1: unset " in out.err and "[2/2] round 1: PASSIVE " in out.err


def test_omp_policy_refuses_an_unknown_shape(capsys):
    with pytest.raises(SystemExit) as exit:
        bench("omp_policy").main(["--shapes", "tiny,huge"])
    assert exit.value.code == 2 and "--shapes names huge; the shapes are tiny, nanogpt." in capsys.readouterr().err
