"""Every bench under bench/ runs at toy size, in this process where it can (its main(argv)), so a moved helper or a
renamed key fails here. The slow smokes run side by side, each main(argv) in a fork of one other process (SMOKES).
Speed is never asserted. bench/gpu_check.py's own smokes: tests/test_gpu_check.py."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import pytest
import torch
from conftest import BENCH, bench_module as bench

REPO = Path(__file__).resolve().parent.parent
# Where a bench finds a peer kept outside the project (bench/vs_nanogpt.py's default): beside the checkout. The peers
# that are packages (transformers for vs_hf, lm-eval for lmeval_speed) are dev dependencies: never skipped.
PEERS = REPO.parent / "shared" / "peers"
SMOKED_ELSEWHERE = {"gpu_check": "tests/test_gpu_check.py"}  # and its --quick sections (bench/gpu_quick.py)


def run(name: str, argv: list[str], capsys) -> str:
    """main(argv) of bench NAME, which must succeed; its standard output."""
    rc = bench(name).main(argv)
    assert rc in (None, 0), rc
    return capsys.readouterr().out


def refused(name: str, argv: list[str], capsys) -> str:
    """main(argv) of bench NAME, which must exit 2 (bad input); its standard error."""
    with pytest.raises(SystemExit) as exit:
        bench(name).main(argv)
    assert exit.value.code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------- the slow smokes, side by side

NANOGPT = PEERS / "nanoGPT" / "train.py"  # bench/vs_nanogpt.py's peer
# The slow smokes' arguments (given each one's directory), by bench: test_NAME_runs judges each. tests/bench_smokes.py
# runs them side by side in this order (the longest chain of processes first), while this process goes on.
SMOKES: dict[str, Callable[[Path], list[str]]] = {
    "vs_nanogpt": lambda d: ["--smoke", "--part", "step", "--json", str(d / "r.json")],
    "ablation": lambda d: ["--smoke", "--target-bpb", "100", "--json", str(d / "a.json")],
    "averaging": lambda d: ["--smoke", "--parallel", "3", "--json", str(d / "avg.json")],
    "omp_policy": lambda d: ["--smoke"],
    "ddp": lambda d: ["--smoke"],
    "fsdp_memory": lambda d: ["--smoke"],
    "loss_memory": lambda d: ["--tokens", "64", "--vocab", "512", "--chunk", "16", "--dim", "32"],
    "sweep": lambda d: ["--smoke"],
    "mup_transfer": lambda d: ["--smoke", "--json", str(d / "m.json"), "--plot", str(d / "m.png")],
}


class Smoke(NamedTuple):
    out: str
    err: str
    dir: Path  # where its --json went


class Smokes:
    """The slow smokes the selected tests judge, started together (tests/bench_smokes.py)."""

    def __init__(self, names: list[str], root: Path) -> None:
        self.root, self.argv = root, {name: SMOKES[name](root / name) for name in names}
        with open(root / "driver.log", "w") as log:
            self.driver = subprocess.Popen([sys.executable, str(REPO / "tests" / "bench_smokes.py"), str(root),
                                            json.dumps(self.argv)], cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)

    def result(self, name: str, timeout: float = 600) -> Smoke:
        """Bench NAME's output once it has finished, which it must have done with exit code 0."""
        out, deadline = self.root / name, time.monotonic() + timeout
        while not (out / "rc").exists() and self.driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        rc = (out / "rc").read_text() if (out / "rc").exists() else None
        assert rc is not None, (f"bench/{name}.py has not finished after {timeout:.0f} s, or tests/bench_smokes.py "
                                f"ended without it:\n{(self.root / 'driver.log').read_text()[-3000:]}")
        smoke = Smoke((out / "stdout.txt").read_text(), (out / "stderr.txt").read_text(), out)
        assert rc == "0", (f"python bench/{name}.py {' '.join(self.argv[name])}: exit code {rc}\n{smoke.out[-2000:]}\n"
                           f"{smoke.err[-3000:]}")
        return smoke

    def stop(self) -> None:
        if self.driver.poll() is None:  # a test failed before the rest had finished: the smokes and their runs go
            os.killpg(self.driver.pid, signal.SIGKILL)
        self.driver.wait()


@pytest.fixture(scope="module")
def smokes(request, tmp_path_factory) -> Iterator[Smokes]:
    """The slow smokes of this module's selected tests, all started when the first of them runs."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    names = [n for n in SMOKES if f"test_{n}_runs" in selected and (n != "vs_nanogpt" or NANOGPT.is_file())]
    started = Smokes(names, tmp_path_factory.mktemp("smokes"))
    yield started
    started.stop()


# The scripts: bench/gpu_quick.py is gpu_check.py's --quick, and _common.py and _gpu.py are their helpers.
BENCHES = sorted(p.stem for p in BENCH.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_answers_help_with_its_own_name(name, capsys):
    with pytest.raises(SystemExit) as exit:
        bench(name).main(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: bench/{name}.py") and "-h, --help" in out, out


def test_every_bench_has_a_smoke_here_or_in_its_own_file():
    """A new bench without a smoke fails here: name its test below (test_<name>_runs) or in SMOKED_ELSEWHERE."""
    here = {n.removeprefix("test_").removesuffix("_runs") for n in globals() if n.endswith("_runs")}
    assert [n for n in BENCHES if n not in here and n not in SMOKED_ELSEWHERE] == []
    assert all((REPO / where.split()[0]).is_file() for where in SMOKED_ELSEWHERE.values())


def test_checkpoint_save_runs(tmp_path, capsys):
    out = run("checkpoint_save", ["--gib", "0.001", "--repeats", "1", "--dir", str(tmp_path / "ck")], capsys)
    assert "command : python bench/checkpoint_save.py --gib 0.001 --repeats 1 --dir" in out
    for name in ("nanopt", "write+reread", "crc-in-write", "bytes only"):
        assert f"| {name} | " in out
    assert "nanopt / write+reread = " in out and "nanopt's checkpoint verifies (sizes, crc32s, step): yes" in out
    assert not (tmp_path / "ck").exists()  # the bench cleans up after itself


@pytest.mark.slow  # a training process (SMOKES: side by side with the others): ~3.5 s alone on 2 quiet cores
def test_ablation_runs(smokes):
    """One whole run (the recipe at toy width, a target met at its first evaluation, step 1): the summary's keys
    the table reads."""
    out, _, where = smokes.result("ablation")
    # Its seconds are the machine's (a loaded one takes longer to step 1): their cell's form, not their value.
    assert re.search(r"\n\| recipe \| 1 ± 0 \| \d+\.\d ± 0\.0 \| - \| `-` \|\n", out), out
    assert "1 variant(s) x 1 seed(s) at toy size" in out
    result = json.loads((where / "a.json").read_text())["results"]["recipe"][0]
    assert result["reached"] is True and result["steps"] == 1 and result["final_val_bpb"] > 0


def test_ablation_tests_each_variant_against_the_recipe_over_seeds():
    """Welch's p over the seeds that reached the target; "equal" for the same constant, n/a below two seeds."""
    rows = lambda *xs: [{"reached": x is not None, "steps": x} for x in xs]  # noqa: E731
    p_value = bench("ablation").p_value
    assert float(p_value(rows(100, 101, 99, 100), rows(140, 141, 139, 140), "steps")) < 0.001
    assert float(p_value(rows(100, 120, 80), rows(110, 90, 100), "steps")) > 0.5
    assert p_value(rows(140, 140), rows(140, 140, 140), "steps") == "equal"
    assert p_value(rows(140, None), rows(140, 140), "steps") == "n/a"


def test_ablation_refuses_an_unknown_variant_or_one_whose_override_does_not_load(capsys):
    err = refused("ablation", ["--target-bpb", "3", "--only", "recipe,bogus,adamw lr 2e-3 450 steps"], capsys)
    assert err.count("\n") == 1, err  # one paragraph, before any run
    assert "--only names 'bogus', which is not a variant" in err and "'adamw lr 2e-3 450 steps'" in err
    assert "'no qk_norm'" in err and "'relu2 mlp'" in err
    err = refused("ablation", ["--target-bpb", "3", "--variant", "typo=--model.dimm=8", "--only", "typo"], capsys)
    assert err.startswith("bench/ablation.py: variant 'typo' (--model.dimm=8) does not load")
    assert "model.dimm" in err and err.count("\n") == 1, err


@pytest.mark.slow  # three training processes side by side (SMOKES): ~7 s alone on 2 quiet cores
def test_averaging_runs(smokes, capsys):
    """Three whole runs (cosine, constant, wsd), each scored as its last weights, EMA and LAWA 2; run again with the
    same --json (and a setting the scores do not depend on), nothing trains."""
    out, _, where = smokes.result("averaging")
    kept = where / "avg.json"
    assert "3 arms x 1 seed(s), 4 steps, a checkpoint every 2, LAWA of the last 2 at toy size (--smoke), 3 runs at " \
           "once" in out
    scores = json.loads(kept.read_text())["scores"]["0"]
    assert set(scores) == {"cosine", "constant", "wsd"}
    for arm in scores.values():
        assert set(arm) == {"last", "ema", "lawa 2"} and all(0 < bpb < 20 for bpb in arm.values())
    # The three sets of weights differ, so they were three evaluations, not one three times.
    assert len({scores["constant"][w] for w in ("last", "ema", "lawa 2")}) == 3
    assert f"| constant | {scores['constant']['last']:.4f} | " in out
    assert "| constant + LAWA 2 vs WSD with decay | constant lawa 2 | wsd last | " in out
    assert "| n/a | n/a | no |" in out  # one seed: nothing to test
    again = run("averaging", ["--smoke", "--json", str(kept)], capsys)
    assert again.split("\nval bpb")[1] == out.split("\nval bpb")[1]


def test_averaging_compares_each_claim_over_seeds():
    """Welch one-sided per claim and the seeds it needs; no seeds figure where A is not the lower side."""
    def seed(i: int) -> dict:
        wobble = 0.01 * (i % 3)
        return {"cosine": {"last": 2.90 + wobble, "ema": 2.85 + wobble, "lawa 4": 2.86 + wobble},
                "constant": {"last": 2.95 + wobble, "ema": 2.88 + wobble, "lawa 4": 2.84 + wobble},
                "wsd": {"last": 2.87 + wobble, "ema": 2.86 + wobble, "lawa 4": 2.87 + wobble}}
    rows = {r["claim"]: r for r in bench("averaging").compare({str(i): seed(i) for i in range(6)}, [4])}
    assert list(rows)[0] == "EMA vs none" and len(rows) == 7
    won = rows["constant + LAWA 4 vs WSD with decay"]
    assert won["a_beats_b"] and won["p"] < 0.01 and won["difference"] == pytest.approx(-0.03)
    assert isinstance(won["seeds_needed"], int) and won["seeds_needed"] >= 2
    lost = rows["LAWA 4 vs EMA"]  # 0.01 higher: tested (p near 1), and no seeds can show it lower
    assert lost["testable"] and lost["p"] > 0.5 and not lost["a_beats_b"] and lost["seeds_needed"] is None


@pytest.mark.parametrize("name, argv, words", [
    ("averaging", ["--steps", "160", "--every", "20", "--last", "9"], "--last '9': give distinct K from 2 to 8"),
    ("averaging", ["--steps", "165", "--every", "20", "--last", "2,x"],
     "from 2 to 9, comma separated (a run of 165 steps"),
    ("averaging", ["--every", "0"], "--every (0)"),
    ("averaging", ["--parallel", "0"], "--parallel (0)"),
    ("averaging", ["--config", str(REPO / "configs" / "tiny.yaml")], "tiny.yaml keeps no EMA (train.ema_decay is 0)"),
    ("averaging", ["--json", "TMP/avg.json"], "--json TMP/avg.json holds seeds of other settings"),
    ("omp_policy", ["--shapes", "tiny,huge"], "--shapes names huge; the shapes are tiny, nanogpt."),
    ("sweep", ["--runs", "1"], "a sweep is at least 2 runs"),
    ("vs_nanogpt", ["--nanogpt", "TMP", "--smoke"], "--nanogpt TMP has no train.py: point it at a nanoGPT checkout"),
])
def test_a_bench_refuses_bad_input_in_one_paragraph(name, argv, words, tmp_path, capsys):
    """TMP: this test's directory, where avg.json holds a run of other settings."""
    (tmp_path / "avg.json").write_text(json.dumps({"settings": {"steps": 80}, "scores": {}}))
    err = refused(name, [a.replace("TMP", str(tmp_path)) for a in argv], capsys)
    assert err.startswith(f"bench/{name}.py: ") and words.replace("TMP", str(tmp_path)) in err, err
    assert err.count("\n") == 1, err


@pytest.mark.slow  # a training process (SMOKES): ~3.5 s alone on 2 quiet cores
def test_omp_policy_runs(smokes):
    """Each run's result goes to stderr as it finishes (the full bench is 80 runs: never silent for minutes)."""
    out = smokes.result("omp_policy")
    assert "1 runs of 3 steps" in out.out and "| nanogpt | 1 | quiet | " in out.out and "(1.00x) | PASSIVE |" in out.out
    assert out.err.startswith("measuring nanogpt shape, 1 rank(s), quiet: PASSIVE x 1 round(s)\n")
    assert "[1/1] round 1: PASSIVE " in out.err and " ms/step (run " in out.err


# nanochat's core_eval.py as bench/core_parity.py calls it, answered by nanopt.evals.core_benchmark: the harness (its adapters,
# nanopt at batch 1 and batch N, the per-item comparison, the table) runs where the peer is absent.
NANOCHAT_STAND_IN = '''
from nanopt.evals import core_benchmark as core
from nanopt.distributed.runtime import Runtime


def render_prompts_mc(item, delimiter, shots):
    return core.render_prompts("multiple_choice", item, delimiter, shots)


def render_prompts_schema(item, delimiter, shots):
    return core.render_prompts("schema", item, delimiter, shots)


def render_prompts_lm(item, delimiter, shots):
    return core.render_prompts("language_modeling", item, delimiter, shots)


SCORED = {}  # a task's items scored once, not once per item


def evaluate_example(idx, model, tokenizer, data, device, meta):
    key = (id(data), meta["num_fewshot"])
    if key not in SCORED:
        task = core.CoreTask("one", meta["task_type"], meta["num_fewshot"], meta["continuation_delimiter"], 0.0, data)
        rt = Runtime(device.type, device, 0, 0, 1, 1, "fp32")
        SCORED[key] = core.evaluate_core(model.model, tokenizer.tok, [task], rt, batch_size=1)["examples"]["one"]
    return SCORED[key][idx]
'''


def test_core_parity_runs(tmp_path, capsys):
    stand_in = tmp_path / "core_eval.py"
    stand_in.write_text(NANOCHAT_STAND_IN)
    out = run("core_parity", ["--nanochat-core-eval", str(stand_in), "--steps", "0", "--n", "4", "--batch-size", "3",
                              "--max-seq-len", "64", "--bundle", str(tmp_path / "bundle")], capsys)
    assert "command : python bench/core_parity.py --nanochat-core-eval" in out and "all examples agree" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("nanopt_")]
    # n, then prompts the same, and examples agreeing at batch 1 and batch 3, for all 4 items of each task
    assert len(rows) == 6 and all(r[3] == r[5] == r[6] == r[7] == "4" for r in rows), out


def test_core_parity_against_nanochat_itself(tmp_path, capsys):
    peer = PEERS / "nanochat" / "nanochat" / "core_eval.py"
    if not peer.is_file():
        pytest.skip(f"the peer is absent: nanochat's core_eval.py is not at {peer}")
    out = run("core_parity", ["--nanochat-core-eval", str(peer), "--steps", "0", "--n", "4", "--max-seq-len", "64",
                              "--bundle", str(tmp_path / "bundle")], capsys)
    assert "all examples agree" in out


@pytest.mark.slow  # two spawned processes (SMOKES): ~4 s alone on 2 quiet cores
def test_ddp_runs(smokes):
    """Two spawned gloo ranks: one-process and two-process steps alternate, and their losses must agree."""
    out = smokes.result("ddp").out
    assert "losses match (max |diff| " in out and "1 proc x 2 threads   | " in out and "2 procs x 1 thread   | " in out


@pytest.mark.slow  # two spawned processes (SMOKES): ~3.5 s alone on 2 quiet cores
def test_fsdp_memory_runs(smokes):
    """Two spawned gloo ranks hold a DDP and an FSDP model; FSDP's bytes are half DDP's, as the model says."""
    out = smokes.result("fsdp_memory").out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines() if line.startswith("    2 |")}
    assert set(rows) == {"ddp", "fsdp"}
    measured, modelled = float(rows["fsdp"][5]), float(rows["fsdp"][7])
    assert measured == pytest.approx(modelled, abs=0.01) and float(rows["fsdp"][6]) <= 0.55
    assert "RATIO 2 ranks: fsdp/ddp bytes 0.5" in out


def test_ladder_runs(capsys):
    out = run("ladder", ["--smoke"], capsys)
    assert "peak    : best 128^2 matmul" in out and "+ micro-batch 2 " in out and "RATIO best rung = " in out
    assert "torch.compile" not in out  # --smoke leaves the compiled rungs out


@pytest.mark.slow  # a BPE trained, a model exported, lm-eval and transformers imported: ~4 s
def test_lmeval_speed_runs(capsys, monkeypatch):
    """A BPE, a Llama exported, lm-eval's own requests for the generated tasks: nanopt's model against the harness's
    hf model, same log-probs, alternating rounds."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # what the bench sets, undone after the test
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = run("lmeval_speed", ["--smoke"], capsys)
    for kind, n in (("loglikelihood", 16), ("loglikelihood_rolling", 4)):
        line = next(line for line in out.splitlines() if line.startswith(f"{kind} "))
        assert f" {n} requests | max |Δ logprob| " in line and " nanopt/hf " in line, out
        assert float(line.split("max |Δ logprob| ")[1].split()[0]) < 1e-3  # the same scores before any timing


def test_loss_memory_measures_in_this_process():
    """What each of its child processes runs: the full and the chunked loss agree (loss and gradient)."""
    full, chunked = (bench("loss_memory").measure(512, 64, chunk, 32) for chunk in (0, 16))
    assert full["loss"] == pytest.approx(chunked["loss"], rel=1e-5) and chunked["chunk"] == 16
    assert full["grad_norm"] == pytest.approx(chunked["grad_norm"], rel=1e-4)


@pytest.mark.slow  # two fresh processes side by side (the bench reads each one's peak RSS; SMOKES): ~3 s alone
def test_loss_memory_runs(smokes):
    out = smokes.result("loss_memory").out
    assert out.startswith("command: python bench/loss_memory.py --tokens 64 --vocab 512 --chunk 16 --dim 32\n")
    assert out.splitlines()[-1].split()[:4] == ["512", "64", "0", "16"] and out.rstrip().endswith("True"), out


def test_muon_step_runs(capsys):
    out = run("muon_step", ["--smoke"], capsys)  # C.TOY_RECIPE's one layer: q, k, v, o and SwiGLU's three
    assert "matrices: 7 in 3 shapes" in out and "BatchedMuon (bf16) is **" in out
    for label in ("torch.optim.Muon (bf16)", "nanopt BatchedMuon, bf16", "nanopt BatchedMuon, fp32",
                  "torch AdamW (fused)"):
        assert f"| {label} | " in out, label
    assert "This CPU's backend trains with" in out


@pytest.mark.slow
def test_muon_step_whole_step_runs(capsys):
    """Three real training processes at toy width (Muon in the backend's dtype, in bf16, AdamW): a row each."""
    out = run("muon_step", ["--smoke", "--whole-step"], capsys)
    for label in ("muon (auto dtype)", "muon, bf16 Newton-Schulz", "adamw"):
        assert re.search(rf"\| {re.escape(label)} \| \d+\.\d \| n/a \| \d+\.\d\dx \|", out), (label, out)


def test_muon_dist_runs(capsys):
    """Forked gloo ranks (1, then 2) step the speedrun's matrices, each orthogonalising its share."""
    out = run("muon_dist", ["--smoke"], capsys)
    assert "matrices: 21 in 3 shapes" in out and "| ranks | Newton-Schulz ms/step, busiest rank |" in out
    assert "\n| 1 | " in out and "\n| 2 | " in out


def test_packing_speed_runs(capsys):
    threads = torch.get_num_threads()
    out = run("packing_speed", ["--tokens", "20000", "--seq-len", "64", "--micro-batch", "2", "--buffer", "16",
                                "--steps", "2", "--repeats", "1"], capsys)
    assert "corpus  : 20,000 tokens in 4 shards" in out and "M packed tokens/s on one core" in out
    assert torch.get_num_threads() == threads  # it measures on one thread, then gives the others back


def test_prepare_runs(capsys, monkeypatch):
    """`nanopt prepare`'s path against the per-document loop on 16 documents: the same tokens from both."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # what the bench sets, undone after the test
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = run("prepare", ["--documents", "16", "--copies", "1", "--vocab", "300", "--workers", "1", "--repeats", "1"],
              capsys)
    assert "corpus: 16 documents" in out and "identical shards from both paths: True" in out
    assert "ratio nanopt prepare / naive: " in out


def test_sample_runs(capsys):
    out = run("sample", ["--new-tokens", "4", "--prompt-tokens", "4", "--repeats", "1"], capsys)
    assert "batch 1, prompt 4 + 4 new tokens" in out and "speed-up of the KV cache: " in out


@pytest.mark.slow  # one real `nanopt sweep` of two toy runs side by side (SMOKES): ~4 s alone on 2 quiet cores
def test_sweep_runs(smokes):
    out = smokes.result("sweep")
    assert "| quiet | " in out.out and "(1.00x, n/a) |" in out.out
    assert "quiet, round 1/1: --parallel 2 swept 2 runs in " in out.err


@pytest.mark.slow  # six toy training processes, 2 at a time (SMOKES): ~35 s on 2 loaded cores
def test_mup_transfer_runs(smokes):
    """Widths 32 and 64 at 2 lrs, sp and mup: 6 runs (mup at the base width is sp's run), the table and plot."""
    out, err, where = smokes.result("mup_transfer")
    runs = json.loads((where / "m.json").read_text())["runs"]
    assert len(runs) == 6 and not any(k.startswith("mup 32 ") for k in runs)
    assert all(0 < bpb < 20 for bpb in runs.values())
    base = re.search(r"\n\| sp \| 32 \| [^|]+\| [^|]+\| (\d+\.\d+) \|", out)
    assert base and f"| mup | 32 | " in out and out.count(f"| {base.group(1)} |") == 2, out  # the shared run
    assert re.search(r"\nsp: the best lr moves [+-]\d\.\d\d grid steps", out), out
    assert "[6/6] " in err and (where / "m.png").read_bytes().startswith(b"\x89PNG")


def test_mup_transfer_finds_the_best_lr_between_grid_points():
    """A parabola's vertex through the grid's best and neighbours; at the edge or by a diverged run, the point."""
    best = bench("mup_transfer").best_log2_lr
    lrs = [2.0 ** e for e in range(-10, -4)]
    assert best(lrs, [(e + 7.3) ** 2 for e in range(-10, -4)]) == pytest.approx(-7.3)
    assert best(lrs, [1, 2, 3, 4, 5, 6]) == -10
    assert best(lrs, [5, 4, 3, 2, math.inf, 9]) == -7


def test_vs_hf_runs(capsys):
    """One train step of each model alternating, then each profiled; the ratio and the ceiling."""
    out = run("vs_hf", ["--smoke"], capsys)
    assert "fp32      | HF transformers  | " in out and "fp32      | nanopt           | " in out
    assert "CEILING fp32: nanopt/HF <= " in out and "RATIO fp32: nanopt/HF tokens/s = " in out


@pytest.mark.slow  # `nanopt prepare`, nanoGPT and nanopt, each a real process (SMOKES): ~9 s alone on 2 quiet cores
def test_vs_nanogpt_runs(smokes):
    """The step-time part against the peer itself (the race part's keys: test_ablation_runs, same recipe)."""
    if not NANOGPT.is_file():
        pytest.skip(f"the peer is absent: no nanoGPT checkout at {NANOGPT.parent} (bench/vs_nanogpt.py's default)")
    out, _, where = smokes.result("vs_nanogpt")
    step = json.loads((where / "r.json").read_text())["step"]
    assert step["nanogpt_ms"] > 0 and step["nanopt_ms"] > 0 and len(step["rounds"]["nanopt"]) == 1
    assert "nanopt speed / nanoGPT speed = **" in out and "(removed at the end)" in out
