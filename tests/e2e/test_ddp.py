"""Real torchrun processes (gloo on CPU): DDP on two c10d 'nodes' equals one process (with Muon), and FSDP and HSDP
equal it (with AdamW and with Muon; compiled per block too), their checkpoints resuming under any parallelism at any
world size."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import MUON_ARG, free_port, small_overrides, torchrun, torchrun_started
from safetensors.torch import load_file

from nanopt import loading, rundirs
from nanopt.errors import EXIT_STATUS_ENV
from nanopt.main import run

pytestmark = pytest.mark.slow  # every test here trains or launches processes

# fp32 so the comparison is about the algorithm, not bf16 rounding; 8 sequences per step.
ARGS = small_overrides(**{"train.precision": "fp32", "train.max_steps": 4, "train.global_batch_tokens": 256})


def _logged(run_dir: Path, key: str = "loss") -> list[dict]:
    """The metrics.jsonl records that have `key`."""
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if key in r]


def _records(run_dir: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in _logged(run_dir)}


def _val(run_dir: Path) -> dict[int, tuple[float, str]]:
    return {r["step"]: (r["val_loss"], r["weights"]) for r in _logged(run_dir, "val_loss")}


def _final_weights(run_dir: Path, name: str = "model.safetensors") -> dict:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / name))


def _assert_close_weights(want: dict, got: dict, name: str, tolerance: float = 1e-5) -> None:
    assert want.keys() <= got.keys()
    for key in want:
        assert (want[key] - got[key]).abs().max().item() < tolerance, (name, key)


def _assert_same_weights(a: Path, b: Path, name: str = "model.safetensors", tolerance: float = 1e-5) -> None:
    wa, wb = _final_weights(a, name), _final_weights(b, name)
    assert wa.keys() == wb.keys()
    _assert_close_weights(wa, wb, name, tolerance)


def _resumed(proc: subprocess.CompletedProcess, layout: str) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stderr + proc.stdout and layout in proc.stdout


# The averaged weights (train.ema_decay) ride along in the muon and fsdp comparisons: every rank keeps the same
# average (ddp) or its shard of it (fsdp), evaluations swap it in on every rank, and it is saved whole.
EMA_ARGS = ["--train.ema_decay=0.8", "--train.ema_start=2", "--eval.weights=ema", "--eval.every=2"]
MUON_ARGS = [*ARGS, MUON_ARG, *EMA_ARGS]
# Global batch 512 = 4 micro-steps at one rank, 2 per rank at two. A constant lr makes a 5-step run plus its resume
# to 10 one 10-step run. Three evaluation batches do not divide over 2 or 4 ranks: a sharded model's forward is a
# collective, so the rank with fewer must still run as many, or the final evaluation hangs.
FSDP_ARGS = small_overrides(**{"train.precision": "fp32", "train.max_steps": 10, "train.global_batch_tokens": 512,
                               "train.schedule": "constant", "log.tensorboard": "false", "eval.batches": 3}) + EMA_ARGS
FSDP, HALF = "--runtime.parallel=fsdp", "--train.max_steps=5"
COMPILED = ["--train.compile=true", "--train.recompute=true", "--sample.num_samples=1", "--sample.max_new_tokens=4"]
BF16_ARGS = small_overrides(**{"train.precision": "bf16", "train.max_steps": 8, "checkpoint.every": 4,
                               "log.tensorboard": "false"})


class Runs:
    """The file's runs under one root, by name: torchruns started in the background (each waited for once: runs[name]
    is its CompletedProcess) and one-rank runs trained in this process; runs / name is a run's directory."""

    def __init__(self, root: Path) -> None:
        self.root, self.started, self.done = root, {}, {}

    def __truediv__(self, name: str) -> Path:
        return self.root / name

    def start(self, name: str, nproc: int, args: list[str], run_dir: str | None = None, **kw) -> None:
        self.started[name] = torchrun_started(nproc, [*args, f"--run.dir={self / (run_dir or name)}"], **kw)

    def __getitem__(self, name: str) -> subprocess.CompletedProcess:
        if name not in self.done:
            self.done[name] = self.started[name]()
        return self.done[name]

    def train(self, name: str, *args: str) -> int:
        return run([*args, f"--run.dir={self / name}"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_dir):
    """Every run of this file, each torchrun started as soon as what it resumes exists, the one-rank runs trained here
    meanwhile: on 2 cores one launch's idle moments (a launcher importing torch, a rank waiting for its peer) are the
    others' work. A test reads the runs it asserts on (one selected test still waits for all)."""
    runs = Runs(tmp_path_factory.mktemp("runs"))
    try:
        # 1-5 on 2 fsdp ranks from scratch, each writing its DCP shards, compiled per block with recompute and a
        # 4-token sample at the end (dynamo's logs on); fsdp_first resumes a copy of it eager, in this process.
        runs.start("compiled", 2, [*FSDP_ARGS, HALF, FSDP, *COMPILED], env={"TORCH_LOGS": "dynamo,recompiles"})
        runs.start("muon_fsdp", 2, [*FSDP_ARGS, MUON_ARG, HALF, FSDP])
        launcher = ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                    "--rdzv-id=nanopt-test"]
        for node in ("node0", "node1"):
            runs.start(node, 1, MUON_ARGS, run_dir="two", extra=launcher)
        assert runs.train("one_rank_half", *FSDP_ARGS, HALF) == 0  # the checkpoint fsdp and hsdp resume (copies)
        for name in ("ddp_first", "hsdp"):
            shutil.copytree(runs / "one_rank_half", runs / name)
        runs.start("ddp_first", 2, [*FSDP_ARGS, FSDP])
        runs.start("hsdp", 4, [*FSDP_ARGS, "--runtime.parallel=hsdp", "--runtime.shard_group_size=2"])
        assert runs.train("bf16", *BF16_ARGS, "--train.max_steps=4") == 0
        runs.start("bf16_fsdp", 2, [*BF16_ARGS, FSDP], run_dir="bf16")
        assert runs.train("fsdp_reference", *FSDP_ARGS) == 0  # what every sharded AdamW run must equal
        assert runs.train("muon_one", *FSDP_ARGS, MUON_ARG) == 0
        assert runs.train("one", *MUON_ARGS) == 0
        runs["muon_fsdp"]
        runs.start("muon_fsdp_resumed", 2, [*FSDP_ARGS, MUON_ARG, FSDP], run_dir="muon_fsdp")  # the momentum's shards
        runs["compiled"]
        shutil.copytree(runs / "compiled", runs / "fsdp_first")
        assert runs.train("fsdp_first", *FSDP_ARGS, "--runtime.parallel=ddp") == 0  # 1 rank resumes it
        yield runs
    finally:
        for name in runs.started:  # a run no test waited for
            runs[name]


def test_two_ranks_on_two_c10d_nodes_match_one_rank_with_muon(runs):
    """MUON_ARGS under ddp on two c10d 'nodes' of one rank each (a torchrun per node, as the README's line) equal one
    rank trained in this process meanwhile, averaged weights included; the ranks end identical and report their
    peak memory. (AdamW under ddp equals one process to the bit: test_modal_app.py, e2e/test_resume.py.)"""
    one, two = runs / "one", runs / "two"
    procs = [runs["node0"], runs["node1"]]
    for proc in procs:  # torchrun warned nothing about its arguments
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "torch/distributed/run.py" not in proc.stderr, proc.stderr[-3000:]
    said = "".join(proc.stdout + proc.stderr for proc in procs)  # rank 0's lines, on either node
    assert "name: muon" in (two / "config.yaml").read_text() and "2 ranks x 1 accum" in said
    la, lb = ({step: loss for step, (loss, _) in _records(d).items()} for d in (one, two))
    assert la.keys() == lb.keys() and len(la) == 4
    for step in la:
        assert abs(la[step] - lb[step]) < 1e-5, (step, la[step], lb[step])
    _assert_same_weights(one, two)
    _assert_same_weights(one, two, "ema.safetensors")
    summary = json.loads((two / "summary.json").read_text())
    digests = summary["weights_sha256_per_rank"]
    assert len(digests) == 2 and digests[0] == digests[1], "ranks ended with different weights"
    # Every rank's peak memory: the summary lists both, each logged step the busiest and which rank it is.
    peaks = summary["peak_memory_gib_per_rank"]
    assert len(peaks) == 2 and all(p > 0 for p in peaks) and summary["peak_reserved_gib_per_rank"] is None
    logged = _logged(two)
    assert all(r["peak_memory_rank"] in (0, 1) and 0 < r["peak_memory_gib"] <= max(peaks) for r in logged)
    assert f"GiB @rank {logged[-1]['peak_memory_rank']}" in said


def _assert_equals_reference(reference: Path, other: Path) -> None:
    """Loss at each of the 10 steps, the evaluations and the weights to 1e-5; the grad norm to 5e-5 of itself (fsdp's
    per-micro-step reduce-scatter sums in another order, ~1e-5 of a late norm of ~2). A summed gradient: 100% off."""
    records, expected = _records(other), _records(reference)
    assert sorted(records) == list(range(1, 11))
    for step, (loss, norm) in expected.items():
        assert abs(records[step][0] - loss) < 1e-5 and abs(records[step][1] - norm) < 5e-5 * norm, (other, step)
    for name in ("model.safetensors", "ema.safetensors"):  # the average: saved whole, resumed as shards
        _assert_same_weights(reference, other, name)
    evaluated = _val(other)  # the averaged weights' evaluations (a half run's final one at step 5 besides)
    for step, (loss, weights) in _val(reference).items():
        assert abs(evaluated[step][0] - loss) < 1e-5 and evaluated[step][1] == weights, (other, step)


def test_fsdp_trains_as_ddp_and_its_checkpoints_resume_across_parallelism_and_world_size(runs):
    """FSDP on 2 gloo ranks equals one rank over 10 AdamW steps: 1-5 fsdp from scratch, resumed in one process (DCP
    reshards the shards into the whole model, optimizer and average); and 1-5 on 1 rank, resumed under fsdp, which
    saves sharded at 10: read whole here, as `nanopt eval/sample/export` do, the one-rank weights. Gloo's FSDP2 once
    summed the ranks' gradients (pytorch#162338): the logged grad norm would double from step 1."""
    assert runs["compiled"].returncode == 0, runs["compiled"].stderr[-3000:]
    ckpt = runs / "compiled" / "checkpoints" / "step_000005"  # both ranks' DCP shards and the whole weights for readers
    listed = json.loads((ckpt / "COMPLETE").read_text())["files"]
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(listed)
    assert "model.safetensors" in listed and not (ckpt / "optimizer.pt").exists()
    _resumed(runs["ddp_first"], "2 ranks x 2 accum")
    for other in ("fsdp_first", "ddp_first"):
        _assert_equals_reference(runs / "fsdp_reference", runs / other)
    for weights, name in (("model", "model.safetensors"), ("ema", "ema.safetensors")):
        loaded = loading.load(runs / "ddp_first", weights=weights)
        assert loaded.step == 10 and (loaded.source / rundirs.DCP_METADATA).is_file()
        _assert_close_weights(_final_weights(runs / "fsdp_reference", name), loaded.model.state_dict(), name)


def test_fsdp_with_muon_matches_one_rank_and_resumes_its_sharded_momentum(runs):
    """Muon under fsdp on 2 ranks, each orthogonalising the matrices it owns (optim.OwnerSplit), equals one rank
    within 1e-3 in loss and grad norm over 10 fp32 steps, 6-10 resumed under fsdp (the momentum through the DCP
    shards). The weights get 5e-3: Newton-Schulz runs in bf16, where another summation order flips roundings (DDP's
    Muon ends 1.3e-3 from one rank too; losses within 4e-5, AMD EPYC, 2026-11-27)."""
    one, two = runs / "muon_one", runs / "muon_fsdp"
    assert runs["muon_fsdp"].returncode == 0, runs["muon_fsdp"].stderr[-3000:]
    _resumed(runs["muon_fsdp_resumed"], "2 ranks x 2 accum")
    reference, records = _records(one), _records(two)
    assert sorted(records) == list(range(1, 11))
    for step, (loss, norm) in reference.items():
        assert abs(records[step][0] - loss) < 1e-3 and abs(records[step][1] - norm) < 1e-3, (step, records[step])
    _assert_same_weights(one, two, tolerance=5e-3)


def test_hsdp_two_by_two_trains_as_one_rank_from_a_one_rank_checkpoint(runs):
    """HSDP on 4 gloo ranks as 2 replicas x shard groups of 2 resumes a one-rank checkpoint at step 5 (cut to 2-D
    shards), trains to 10 and saves (gathered): equal to the one-rank run to 1e-5. A gradient summed instead of
    averaged over either mesh dimension would double the logged grad norm."""
    _resumed(runs["hsdp"], "4 ranks x 1 accum")
    _assert_equals_reference(runs / "fsdp_reference", runs / "hsdp")


def test_fsdp_in_bf16_learns_and_resumes(runs):
    """train.precision=bf16 under fsdp on 2 gloo ranks (FSDP2 gathers bf16 weights, reduces fp32 gradients into the
    fp32 shards): steps 1-4 on one rank here, 5-8 resumed under fsdp. The loss falls over the 8 steps and over
    fsdp's own 4, and fsdp saves the weights whole in fp32."""
    _resumed(runs["bf16_fsdp"], "bf16 on cpu x2")
    saved = load_file(str(runs / "bf16" / "checkpoints" / "step_000008" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    losses = {step: loss for step, (loss, _) in _records(runs / "bf16").items()}
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1] - 0.5 and losses[8] < losses[5], losses


def test_fsdp_compiled_per_block_trains_as_eager_and_evaluates_and_samples_without_recompiling(runs):
    """train.compile under fsdp (per block), each block recomputed in backward: 5 steps on 2 ranks, 2 micro-steps
    each, equal the eager one-rank run in loss, grad norm and the averaged weights' evaluations. Dynamo traces
    Block.forward once per rank and never recompiles, so the evaluations, the final test loss and the KV-cache sample
    ran the eager blocks (through the compiled ones each would recompile)."""
    run_dir, proc = runs / "compiled", runs["compiled"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    traced = [(name, Path(path).parts[-2:])
              for name, path in re.findall(r"torchdynamo start tracing (\w+) (\S+):\d+", proc.stderr)]
    assert traced == [("forward", ("recipe", "model.py"))] * 2, traced  # Block.forward, once per rank
    assert "Recompiling" not in proc.stderr
    assert "--- 1 samples from step 5" in proc.stdout
    records, expected = _records(run_dir), _records(runs / "fsdp_reference")
    assert sorted(records) == list(range(1, 6))
    for step, (loss, norm) in records.items():
        assert abs(expected[step][0] - loss) < 1e-5 and abs(expected[step][1] - norm) < 5e-5 * norm, (step, norm)
    timed = [r for r in _logged(run_dir, "mfu") if r["mfu"]]
    # hfu counts the blocks' second forward (without train.recompute it equals mfu here: no chunked loss)
    assert timed and all(r["hfu"] > 1.1 * r["mfu"] for r in timed), [r["hfu"] / r["mfu"] for r in timed]
    evaluated, reference = _val(run_dir), _val(runs / "fsdp_reference")
    for step in (0, 2, 4):
        assert abs(evaluated[step][0] - reference[step][0]) < 1e-5 and evaluated[step][1] == reference[step][1]


def test_hsdp_whose_one_shard_group_is_the_whole_world_is_refused_before_any_step(tmp_path):
    """shard_group_size null = the ranks per node: on one node of 2 ranks, one group and no replicas (fsdp). Known
    only once torchrun says the world size: each rank refuses it, exit 2, before the run directory exists. Not among
    `runs`, alone: a rank far behind a peer that refused and left records 1 (seen with 8 such torchruns at once)."""
    status = tmp_path / "codes"
    proc = torchrun(2, [*ARGS, "--runtime.parallel=hsdp", f"--run.dir={tmp_path / 'run'}"],
                    env={EXIT_STATUS_ENV: str(status)})
    assert proc.returncode != 0
    assert "`runtime.shard_group_size` is null, the ranks per node (2), the whole world of 2 ranks" in proc.stderr
    # "rank code" per line: torchrun stops the others once the first exits 2, so every line written says 2.
    codes = dict(line.split() for line in status.read_text().splitlines())
    assert codes and set(codes) <= {"0", "1"} and set(codes.values()) == {"2"}, codes
    assert not (tmp_path / "run").exists()
