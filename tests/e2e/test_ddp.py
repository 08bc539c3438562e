"""Real torchrun processes (gloo on CPU): DDP equals one process (with AdamW and with Muon), two 'nodes' train
together, and FSDP equals them (with AdamW and with Muon), its checkpoints resuming under either parallelism at any
world size."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import MUON_ARG, REPO, free_port, run_module, small_overrides, torchrun
from nanopt.main import run

# fp32 so the comparison is about the algorithm, not bf16 rounding; 8 sequences per step.
ARGS = small_overrides(**{"train.precision": "fp32", "train.max_steps": 4, "train.global_batch_tokens": 256})


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def _final_weights(run_dir: Path, name: str = "model.safetensors") -> dict:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / name))


def _assert_same_weights(a: Path, b: Path, name: str = "model.safetensors") -> None:
    wa, wb = _final_weights(a, name), _final_weights(b, name)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert (wa[key] - wb[key]).abs().max().item() < 1e-5, (name, key)


def _assert_same_run(a: Path, b: Path) -> None:
    la, lb = _losses(a), _losses(b)
    assert la.keys() == lb.keys() and len(la) == 4
    for step in la:
        assert abs(la[step] - lb[step]) < 1e-5, (step, la[step], lb[step])
    wa, wb = _final_weights(a), _final_weights(b)
    for name in wa:
        assert (wa[name] - wb[name]).abs().max().item() < 1e-5, name


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, corpus_dir) -> Path:
    run_dir = tmp_path_factory.mktemp("single")
    proc = run_module(["nanopt.main", *ARGS, f"--run.dir={run_dir}"], env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_two_ranks_match_one_rank(single_run, tmp_path):
    proc = torchrun(2, [*ARGS, f"--run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks x 1 accum" in proc.stdout
    _assert_same_run(single_run, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    digests = summary["weights_sha256_per_rank"]
    assert len(digests) == 2 and digests[0] == digests[1], "ranks ended with different weights"
    # Every rank's peak memory: the summary lists both, each logged step the busiest and which rank it is.
    peaks = summary["peak_memory_gib_per_rank"]
    assert len(peaks) == 2 and all(p > 0 for p in peaks) and summary["peak_reserved_gib_per_rank"] is None
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in logged if "loss" in r]
    assert all(r["peak_memory_rank"] in (0, 1) and 0 < r["peak_memory_gib"] <= max(peaks) for r in logged)
    assert f"GiB @rank {logged[-1]['peak_memory_rank']}" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_two_nodes_over_c10d_rendezvous_match_one_rank(single_run, tmp_path):
    port = free_port()
    procs = []
    for _ in (0, 1):  # the README's line: c10d numbers the nodes, no --node-rank
        launcher = ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=nanopt-test"]
        cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "--nproc-per-node=1",
               "-m", "nanopt.main", *ARGS, f"--run.dir={tmp_path}"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "torch/distributed/run.py" not in err, err[-3000:]  # torchrun warned nothing about its arguments
    _assert_same_run(single_run, tmp_path)
    digests = json.loads((tmp_path / "summary.json").read_text())["weights_sha256_per_rank"]
    assert len(digests) == 2 and digests[0] == digests[1]


# ---------------------------------------------------------------- muon


# The averaged weights (train.ema_decay) ride along in the muon and fsdp comparisons: every rank keeps the same
# average (ddp) or its shard of it (fsdp), evaluations swap it in on every rank, and it is saved whole.
EMA_ARGS = ["--train.ema_decay=0.8", "--train.ema_start=2", "--eval.weights=ema", "--eval.every=2"]


@pytest.mark.slow
def test_two_ranks_match_one_rank_with_muon(tmp_path):
    args = [*ARGS, MUON_ARG, *EMA_ARGS]
    one, two = tmp_path / "one", tmp_path / "two"
    assert run([*args, f"--run.dir={one}"]) == 0  # in this process: the single-rank reference
    proc = torchrun(2, [*args, f"--run.dir={two}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks x 1 accum" in proc.stdout
    _assert_same_run(one, two)
    _assert_same_weights(one, two, "ema.safetensors")
    digests = json.loads((two / "summary.json").read_text())["weights_sha256_per_rank"]
    assert len(digests) == 2 and digests[0] == digests[1], "ranks ended with different weights"


# ---------------------------------------------------------------- fsdp
# Global batch 512 = 4 micro-steps at one rank, 2 per rank at two: accumulation runs under no_sync and under
# set_requires_gradient_sync(False). A constant lr makes a 5-step run plus its resume to 10 one 10-step run.
FSDP_ARGS = small_overrides(**{"train.precision": "fp32", "train.max_steps": 10, "train.global_batch_tokens": 512,
                               "train.schedule": "constant", "log.tensorboard": "false"}) + EMA_ARGS
HALF = "--train.max_steps=5"


@pytest.mark.slow
def test_fsdp_trains_as_ddp_and_its_checkpoints_resume_across_parallelism_and_world_size(tmp_path):
    """FSDP on 2 gloo ranks equals one rank (what DDP is tested equal to above) to 1e-5 in loss, grad norm and
    weights over 10 AdamW steps: steps 1-5 fsdp from scratch, then resumed under ddp on 1 rank; and 1-5 on 1 rank,
    then resumed under fsdp on 2 ranks. Gloo's FSDP2 once summed the ranks' gradients instead of averaging them
    (pytorch#162338): the logged grad norm would double from step 1 (AdamW's update hardly sees a gradient's scale,
    so the loss alone would barely show it; doubling the gradients in clip_grad_norm fails this test)."""
    one, fsdp_first, ddp_first = tmp_path / "one", tmp_path / "fsdp_first", tmp_path / "ddp_first"
    assert run([*FSDP_ARGS, f"--run.dir={one}"]) == 0
    proc = torchrun(2, [*FSDP_ARGS, HALF, "--runtime.parallel=fsdp", f"--run.dir={fsdp_first}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run([*FSDP_ARGS, "--runtime.parallel=ddp", f"--run.dir={fsdp_first}"]) == 0  # 1 rank resumes it
    assert run([*FSDP_ARGS, HALF, f"--run.dir={ddp_first}"]) == 0
    proc = torchrun(2, [*FSDP_ARGS, "--runtime.parallel=fsdp", f"--run.dir={ddp_first}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stderr + proc.stdout and "2 ranks x 2 accum" in proc.stdout
    reference = _records(one)
    for other in (fsdp_first, ddp_first):
        records = _records(other)
        assert sorted(records) == list(range(1, 11))
        for step, (loss, norm) in reference.items():
            assert abs(records[step][0] - loss) < 1e-5 and abs(records[step][1] - norm) < 1e-5, (other, step)
        for name in ("model.safetensors", "ema.safetensors"):  # the average: saved whole, resumed as shards
            _assert_same_weights(one, other, name)
        evaluated = _val(other)  # the averaged weights' evaluations (the half run's final one at step 5 besides)
        for step, (loss, weights) in _val(one).items():
            assert abs(evaluated[step][0] - loss) < 1e-5 and evaluated[step][1] == weights, (other, step)


def _val(run_dir: Path) -> dict[int, tuple[float, str]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["val_loss"], r["weights"]) for r in records if "val_loss" in r}


@pytest.mark.slow
def test_fsdp_with_muon_matches_one_rank_and_resumes_its_sharded_momentum(tmp_path):
    """Muon under fsdp on 2 ranks, each orthogonalising only the matrices it owns (optim.OwnerSplit: the owner
    gathers a matrix's rows, the others get theirs back), equals one rank within 1e-3 in loss and grad norm over 10
    fp32 steps: 1-5 from scratch, 6-10 resumed under fsdp, so the momentum went through optimizer.pt whole and came
    back as shards. The weights get 5e-3: Newton-Schulz runs in bf16, where the fp32 gradients' other summation order
    flips roundings, and DDP's Muon (every rank orthogonalising everything, as before the split, or split: the same
    bits) ends 1.3e-3 from one rank here too; losses stay within 4e-5 (AMD EPYC, 2026-11-27)."""
    args = [*FSDP_ARGS, MUON_ARG]
    one, two = tmp_path / "one", tmp_path / "two"
    assert run([*args, f"--run.dir={one}"]) == 0
    for steps in ([HALF], []):
        proc = torchrun(2, [*args, *steps, "--runtime.parallel=fsdp", f"--run.dir={two}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stderr + proc.stdout and "2 ranks x 2 accum" in proc.stdout
    reference, records = _records(one), _records(two)
    assert sorted(records) == list(range(1, 11))
    for step, (loss, norm) in reference.items():
        assert abs(records[step][0] - loss) < 1e-3 and abs(records[step][1] - norm) < 1e-3, (step, records[step])
    wa, wb = _final_weights(one), _final_weights(two)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert (wa[name] - wb[name]).abs().max().item() < 5e-3, name


def _records(run_dir: Path) -> dict[int, tuple[float, float]]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = (rec["loss"], rec["grad_norm"])
    return out
