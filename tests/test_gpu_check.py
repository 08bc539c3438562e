"""bench/gpu_check.py --cpu-smoke: the GPU check's own code, run at toy size on CPU so that it cannot rot
between the sessions that have a GPU (docs/results.md "GPU: one H100" has its figures)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def load_gpu_check():
    sys.path.insert(0, str(REPO / "bench"))  # gpu_check imports its neighbour _common
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smoke(tmp_path: Path, sections: str) -> dict:
    """`bench/gpu_check.py --cpu-smoke --sections SECTIONS`: its exit code must be 0; its JSON report."""
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--out", str(tmp_path),
                           "--sections", sections], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not any("error" in result[s] for s in sections.split(",")), result
    return result


@pytest.mark.slow
def test_cpu_smoke_runs_every_section_and_reports_what_it_measured(tmp_path):
    # 170m is the same toy as 1b here: one training section keeps the code path alive. The resume section's four
    # real runs would add ~80 s (tests/test_resume.py runs kill-and-resume on CPU); its comparison is tested below.
    result = smoke(tmp_path, "env,attention,ddp,sample,tasks,1b")
    tasks = result["tasks"]
    assert tasks["requests"] == 4 * 40 and tasks["seconds"] > 0 and tasks["batched_vs_alone_max_abs"] < 0.05
    assert result["env"]["torch"] == __import__("torch").__version__
    for dtype in ("bfloat16", "float32"):
        row = result["attention"][dtype]
        assert row["nanopt_sdpa_rel_err"] < (2e-2 if dtype == "bfloat16" else 1e-5)
        assert row["sdpa_kernel_enable_gqa"] and row["nanopt_kernel"] == "sdpa"
    # Finding 1's evidence: without the in-place zeroing the no_sync gradients live outside DDP's bucket.
    assert result["ddp"]["set_to_none"]["grad_storages"] > 1 == result["ddp"]["in_place"]["grad_storages"]
    # nanopt's own DDP path (train._wrap at world size 1) trains exactly like the unwrapped model.
    path = result["ddp"]["nanopt_path"]
    assert path["ddp"]["tokens_per_s"] > 0 and path["unwrapped"]["tokens_per_s"] > 0 and path["loss_diff"] == 0
    sample = result["sample"]
    assert sample["greedy_tokens_equal"] and sample["max_abs_logit_diff"] < 1e-4 and sample["cached_tokens_per_s"] > 0
    assert not result["env"]["torchao"].startswith("not importable") and result["env"]["nanopt_fp8"] == "emulated"
    run = result["1b"]["eager"]
    assert run["rc"] == 0 and run["tokens_per_s"] > 0 and run["steps_timed"] == [3, 4, 5, 10]
    assert run["profile"]["compute_share"] > 0.5 and run["top_ops"], run
    assert run["top_ops_share_sum"] <= 1.0
    report = (tmp_path / "gpu_check.md").read_text()
    for title in ("## DDP gradients", "## nanopt's DDP path", "## Sampling with the KV cache", "## Training 1b",
                  "## Downstream scoring"):
        assert title in report
    assert "FAILED" not in report


@pytest.mark.slow
def test_cpu_smoke_of_fp8_and_two_ranks_on_one_device(tmp_path):
    result = smoke(tmp_path, "ranks2,fp8")
    ranks = result["ranks2"]
    assert ranks["two_ranks"]["rc_per_rank"] == [0, 0] and ranks["replicas_equal"]
    assert ranks["steps_compared"] == list(range(1, 11)) and ranks["max_abs_loss_diff"] < 1e-3
    fp8 = result["fp8"]
    for name in ("1b", "170m"):
        assert fp8[name]["fp8_eager"]["rc"] == 0 and fp8[name]["fp8_speedup"] > 0
    loss = fp8["loss"]
    assert loss["eager"]["val_loss"] < 5.5 and abs(loss["val_loss_gap"]) < 0.05  # it learns; FP8 barely differs
    report = (tmp_path / "gpu_check.md").read_text()
    assert "## Two ranks on one GPU" in report and "## FP8 (train.fp8) against bf16" in report


def test_a_section_failed_when_a_run_in_it_failed_at_any_depth():
    gc = load_gpu_check()
    assert not gc.section_failed({"rc": 0, "1b": {"compiled": {"rc": 0}}, "loss": {"eager": {"rc": 0}}})
    assert gc.section_failed({"1b": {"fp8": {"rc": 1}}})
    assert gc.section_failed({"two_ranks": {"rc": None}})  # timed out
    assert gc.section_failed({"error": "Traceback ..."})
    assert not gc.section_failed({"rc": [0, 0, -9, 0]})  # resume's list: its kill is on purpose


def test_resume_section_compares_the_resumed_run_with_the_straight_one_and_a_rerun(tmp_path, monkeypatch):
    """check_resume's bookkeeping on fake runs: which steps it compares, the differences, the digests."""
    gc = load_gpu_check()
    losses = {"resume-straight": 1.0, "resume-again": 1.0, "resume-killed": 1.25}
    calls = []

    def fake_run(args, run_dir, timeout, env=None):
        calls.append((run_dir.name, (env or {}).get("NANOPT_TEST_HOOK")))
        killed = env is not None
        resumed = run_dir.name == "resume-killed" and not killed  # goes on from the step-4 checkpoint
        steps = range(1, 7) if killed else range(5, 11) if resumed else range(1, 11)
        records = [{"step": s, "loss": losses[run_dir.name] * s} for s in steps]
        if not killed:
            run_dir.mkdir(parents=True, exist_ok=True)
            digest = "same" if run_dir.name != "resume-killed" else "other"
            (run_dir / "summary.json").write_text(json.dumps({"weights_sha256_per_rank": [digest]}))
        return {"rc": -9 if killed else 0, "records": records, "log_tail": ""}

    monkeypatch.setattr(gc, "nanopt_run", fake_run)
    out = gc.check_resume([], tmp_path, tmp_path / "shards", 10)
    assert calls == [("resume-straight", None), ("resume-again", None), ("resume-killed", "kill-in-step:7"),
                     ("resume-killed", None)]
    assert out["rc"] == [0, 0, -9, 0] and out["steps_compared"] == [5, 6, 7, 8, 9, 10]
    assert out["max_abs_loss_diff"] == 0.25 * 10 and out["weights_equal"] is False
    assert out["rerun_max_abs_loss_diff"] == 0.0 and out["rerun_weights_equal"] is True
    assert not any((tmp_path / d).exists() for d in ("resume-straight", "resume-again", "resume-killed"))


@pytest.mark.slow
def test_cpu_smoke_of_the_gpu_speedrun_config(tmp_path):
    """configs/speedrun-gpu.yaml at toy width: its speed row and a validation curve on real text that falls."""
    run = smoke(tmp_path, "speedrun")["speedrun"]
    assert run["speed"]["rc"] == 0 and run["speed"]["tokens_per_s"] > 0
    curve = [loss for _, loss in run["curve"]["val_loss"]]
    assert run["curve"]["rc"] == 0 and len(curve) >= 3 and curve[-1] < curve[0] - 0.5
    assert "## configs/speedrun-gpu.yaml" in (tmp_path / "gpu_check.md").read_text()
