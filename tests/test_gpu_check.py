"""bench/gpu_check.py --cpu-smoke: the GPU check's own code at toy size on CPU, so that it cannot rot between the
sessions that have a GPU. Some full sections and the quick check run through its main(argv) here, the other full
sections as `python bench/gpu_check.py` beside them."""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from conftest import BENCH, REPO, bench_module

# Every full section a test below reads, in two checks side by side (2 cores; each training run has one thread):
# SMOKED_HERE in this process, then the quick check, while SMOKED_APART runs in a process of its own. The 1b section's
# run is the fp8 section's bf16 baseline (run once), so the two are in the same check.
SMOKED_HERE = "env,attention,ddp,ranks2,sample,tasks"
SMOKED_APART = "fp8,1b,speedrun"


def load_gpu_check():
    return bench_module("gpu_check")


def read_result(out: Path, rc: Optional[int], log: str = "") -> dict:
    result = json.loads((out / "gpu_check.json").read_text())
    assert rc == 0 and not [s for s in result if isinstance(result[s], dict) and "error" in result[s]], (result, log)
    return result


def start(out: Path, *args: str) -> subprocess.Popen:
    """`python bench/gpu_check.py --cpu-smoke --out OUT ARGS`, beside this process; its output in OUT/stdout.txt and
    OUT/stderr.txt, where no pipe can fill up unread."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
        return subprocess.Popen([sys.executable, str(BENCH / "gpu_check.py"), "--cpu-smoke", "--out", str(out), *args],
                                cwd=REPO, stdout=stdout, stderr=stderr,
                                env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def smokes(request, tmp_path_factory) -> dict:
    """The smokes the selected tests read: the full check of SMOKED_APART in a process of its own while this one
    runs that of SMOKED_HERE, then the quick check, on one thread each. "full": the sections of both full checks in
    one result, and both Markdown reports; "quick": the quick check's result and standard output; "quick_dir"."""
    selected = [item.name for item in request.session.items if item.module is request.module]
    full = any(name.startswith("test_cpu_smoke_") for name in selected)
    here, apart, quick = (tmp_path_factory.mktemp(d) for d in ("gpu_check", "gpu_check_apart", "gpu_quick"))
    proc, gc, out = start(apart, "--sections", SMOKED_APART) if full else None, load_gpu_check(), {"quick_dir": quick}
    threads = torch.get_num_threads()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OMP_NUM_THREADS", "1")
            torch.set_num_threads(1)
            if full:
                out["full"] = read_result(here, gc.main(["--cpu-smoke", "--out", str(here), "--sections", SMOKED_HERE]))
            if any(name.startswith("test_quick_cpu_smoke_") for name in selected):
                with contextlib.redirect_stdout(io.StringIO()) as stdout:
                    rc = gc.main(["--cpu-smoke", "--out", str(quick), "--quick"])
                out["quick"] = read_result(quick, rc, stdout.getvalue()[-3000:]), stdout.getvalue()
    finally:
        torch.set_num_threads(threads)
        if proc:
            try:
                proc.wait(timeout=900)
            finally:
                proc.kill()  # a no-op once it has exited
    if full:
        other = read_result(apart, proc.returncode, (apart / "stdout.txt").read_text()[-3000:] +
                            (apart / "stderr.txt").read_text()[-3000:])
        assert set(SMOKED_APART.split(",")) <= set(other)
        out["full"].update({name: other[name] for name in SMOKED_APART.split(",")})
        out["full"] = out["full"], (here / "gpu_check.md").read_text() + (apart / "gpu_check.md").read_text()
    return out


@pytest.mark.slow
def test_cpu_smoke_runs_every_section_and_reports_what_it_measured(smokes):
    # 170m is the same toy as 1b here; the resume section's comparison is tested below on fake runs.
    result, report = smokes["full"]
    tasks = result["tasks"]
    assert tasks["requests"] == 4 * 40 and tasks["seconds"] > 0 and tasks["batched_vs_alone_max_abs"] < 0.05
    assert result["env"]["torch"] == torch.__version__
    for dtype in ("bfloat16", "float32"):
        row = result["attention"][dtype]
        assert row["nanopt_sdpa_rel_err"] < (2e-2 if dtype == "bfloat16" else 1e-5)
        assert row["sdpa_kernel_enable_gqa"] and row["nanopt_kernel"] == "sdpa"
    # Finding 1's evidence: without the in-place zeroing the no_sync gradients live outside DDP's bucket.
    assert result["ddp"]["set_to_none"]["grad_storages"] > 1 == result["ddp"]["in_place"]["grad_storages"]
    # nanopt's own DDP path (train.step_model at world size 1) trains exactly like the unwrapped model.
    path = result["ddp"]["nanopt_path"]
    assert path["ddp"]["tokens_per_s"] > 0 and path["unwrapped"]["tokens_per_s"] > 0 and path["loss_diff"] == 0
    sample = result["sample"]
    assert sample["greedy_tokens_equal"] and sample["max_abs_logit_diff"] < 1e-4 and sample["cached_tokens_per_s"] > 0
    assert not result["env"]["torchao"].startswith("not importable") and result["env"]["nanopt_fp8"] == "emulated"
    run = result["1b"]["eager"]
    assert run["rc"] == 0 and run["tokens_per_s"] > 0 and run["steps_timed"] == [3, 4, 5, 10]
    assert 0 < run["profile"]["compute_share"] <= 1 and run["top_ops"], run  # its size is the load's, not a test
    assert run["top_ops_share_sum"] <= 1.0
    assert result["fp8"]["1b"]["eager"] == run  # the fp8 section's bf16 baseline is the same run, run once
    for title in ("## DDP gradients", "## nanopt's DDP path", "## Sampling with the KV cache", "## Training 1b",
                  "## Downstream scoring"):
        assert title in report
    assert "FAILED" not in report


@pytest.mark.slow
def test_cpu_smoke_of_fp8_and_two_ranks_on_one_device(smokes):
    result, report = smokes["full"]
    ranks = result["ranks2"]
    assert ranks["two_ranks"]["rc_per_rank"] == [0, 0] and ranks["replicas_equal"]
    assert ranks["steps_compared"] == list(range(1, 11)) and ranks["max_abs_loss_diff"] < 1e-3
    fp8 = result["fp8"]
    assert fp8["models"] == ["1b"] and fp8["1b"]["fp8_eager"]["rc"] == 0 and fp8["1b"]["fp8_speedup"] > 0
    assert any("fp8: 14 block Linears in FP8" in line for line in fp8["1b"]["fp8_eager"]["log_notable"]), fp8["1b"]
    loss = fp8["loss"]
    assert loss["eager"]["val_loss"] < 5.5 and abs(loss["val_loss_gap"]) < 0.05  # it learns; FP8 barely differs
    assert "## Two ranks on one GPU" in report and f"## FP8 (train.fp8) against {result['precision']}" in report


def test_a_section_failed_when_a_run_in_it_failed_at_any_depth():
    gc = load_gpu_check()
    assert not gc.section_failed({"rc": 0, "1b": {"compiled": {"rc": 0}}, "loss": {"eager": {"rc": 0}}})
    assert gc.section_failed({"1b": {"fp8": {"rc": 1}}})
    assert gc.section_failed({"two_ranks": {"rc": None}})  # timed out
    assert gc.section_failed({"error": "Traceback ..."})
    assert not gc.section_failed({"rc": [0, 0, -9, 0]})  # resume's list: its kill is on purpose


def test_resume_section_compares_the_resumed_run_with_the_straight_one_and_a_rerun(tmp_path, monkeypatch):
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
def test_cpu_smoke_of_the_gpu_speedrun_config(smokes):
    result, report = smokes["full"]
    run = result["speedrun"]
    assert run["speed"]["rc"] == 0 and run["speed"]["tokens_per_s"] > 0
    curve = [loss for _, loss in run["curve"]["val_loss"]]
    assert run["curve"]["rc"] == 0 and len(curve) >= 3 and curve[-1] < curve[0] - 0.5
    assert "## configs/speedrun-gpu.yaml" in report


# ---------------------------------------------------------------- --quick: the first device call's check


@pytest.mark.slow
def test_quick_cpu_smoke_runs_every_never_run_path_and_judges_it(smokes):
    gc, (result, log), out = load_gpu_check(), smokes["quick"], smokes["quick_dir"]
    # The report ends the output, its goals last: a device call's reply shows its tail.
    assert log.rstrip().splitlines()[-1].startswith("gpu_check: ") and "## Goals" in log.split("## Sections")[-1]
    assert result["quick"] and [s for s in gc.gpu_quick.QUICK_SECTIONS if s not in result] == []
    assert not [s for s in gc.gpu_quick.QUICK_SECTIONS if "error" in result[s] or "skipped" in result[s]], result
    assert result["env"]["torchao"] == importlib.import_module("torchao").__version__ and "lm_eval" in result["env"]
    muon = result["muon"]
    assert muon["toy"]["matrices"] == 2 * 6 and muon["toy"]["torch_ms"] > 0 and muon["per_shape"]
    assert "muon_batch_max_numel" in muon["cut_off"] and muon["goal"]["what"].startswith("BatchedMuon")
    for recipe in ("tensorwise", "rowwise"):  # FP8 decoding: every block Linear (relu2: 6) converted, the cache right
        row = result["decode_fp8"][recipe]
        assert row["fp8_linears"] == 2 * 6 and row["logits_agree"] and row["fp8_vs_plain_max_abs"] > 0
    assert result["sample"]["logits_agree"] and result["harness"]["harness_vs_scoring_max_abs"] < 0.05
    tasks = result["tasks"]  # its goal is a time: judged, not asserted (no test asserts a speed)
    assert tasks["goal"]["value"] == tasks["seconds"] > 0 and tasks["goal"]["met"] in (True, False)
    ddp = result["fp8_ddp"]  # eager here: DDP at world size 1 trains exactly like the model unwrapped, either way
    assert ddp["works_with"] == ["ddp_split", "ddp_one_graph"] and ddp["loss_diff"] == {"ddp_split": 0,
                                                                                         "ddp_one_graph": 0}
    assert ddp["ddp_split"]["fp8_linears"] == 2 * 6 and ddp["default_splits"] is False
    fsdp = result["fsdp"]  # FSDP2 at world size 1 in a real process group: it trains, against DDP's loss and speed
    assert fsdp["fsdp"]["tokens_per_s"] > 0 and fsdp["fsdp_over_ddp"] > 0 and fsdp["goal"]["what"].startswith("FSDP")
    assert fsdp["loss_diff"] < 0.01  # bf16: FSDP computes in bf16 weights, DDP under autocast
    speedrun = result["speedrun"]  # compiled: only the stage that brings a new seq_len recompiles
    assert speedrun["rc"] == 0 and speedrun["packing_cropped_share"] is not None
    assert [(s["batch_tokens"], s["seq_len"], s["recompiles"]) for s in speedrun["stages"]] == [
        (256, 64, 0), (384, 64, 0), (384, 32, 1), (512, 64, 0)]
    assert all(s["tokens_per_s"] > 0 and s["steps_timed"] >= 2 for s in speedrun["stages"])
    assert speedrun["goals"][1]["met"] is True
    fp8, base = result["fp8"], result["fp8"][result["precision"]]  # the headline: bf16 (or the smoke's) vs FP8
    assert base["fp8_linears"] == 0 and fp8["tensorwise"]["fp8_linears"] == fp8["rowwise"]["fp8_linears"] == 14
    for recipe in ("tensorwise", "rowwise"):
        r = fp8[recipe]
        assert r["speedup"] == base["step_ms"] / r["step_ms"] and 0 < r["loss_gap"] < 0.01 < r["fp8_flops_share"]
    assert fp8["goals"][0]["value"] == fp8["tensorwise"]["speedup"]  # the baseline is measured here, not shipped
    assert fp8["reference"]["what"].startswith("not a baseline") and fp8["reference"]["step_ms"] > 0
    report = (out / "gpu_check.md").read_text()
    assert "FAILED" not in report and f"CPU smoke in {result['precision']}: toy sizes" in report
    assert all(f"| {name} | " in report for name in gc.gpu_quick.QUICK_SECTIONS)  # every section has its row


def test_quick_sections_skip_with_a_reason_where_a_package_is_absent(monkeypatch, capsys):
    gc = load_gpu_check()
    real = gc.gpu_quick.importlib.util.find_spec
    monkeypatch.setattr(gc.gpu_quick.importlib.util, "find_spec", lambda name: None if name in ("torchao", "lm_eval")
                        else real(name))
    device = torch.device("cpu")
    size = gc.gpu_quick.sizes(True)
    for out in (gc.gpu_quick.check_decode_fp8(device, size["decode"]),
                gc.gpu_quick.check_fp8_ddp(device, size["fp8_ddp"]),
                gc.gpu_quick.check_fp8(device, size["fp8"])):
        assert out == {"skipped": "torchao is not importable: carry its wheel (docs/development.md, 'When a GPU is "
                                  "available')"}
    assert "lm-eval" in gc.gpu_quick.check_harness(device, size["harness"])["skipped"]
    assert capsys.readouterr().out.count("gpu_check: skipped:") == 4
    assert not gc.section_failed({"skipped": "torchao is not importable"})


def test_stage_table_counts_recompiles_where_they_were_logged_and_times_after_each_stages_first_step():
    gc = load_gpu_check()
    stages = [(0, 256, 64), (4, 384, 64), (7, 384, 32), (10, 512, 64)]
    log = ["stage 1 from step 0: ...", "step 1 | ...", "stage 2 from step 4: ...", "stage 3 from step 7: ...",
           "V1126 Recompiling function forward in model.py:300", "    triggered by the following guard failure(s):",
           "stage 4 from step 10: ...", "step 13 | done"]
    records = [{"step": s, "tokens_per_s": 1000.0 * s, "step_ms": 10.0 * s} for s in range(1, 14)]
    table = gc.gpu_quick.stage_table(log, records, stages)
    assert [t["recompiles"] for t in table] == [0, 0, 1, 0]
    assert [t["new_shape"] for t in table] == [True, False, True, False]
    assert [t["first_step_ms"] for t in table] == [10.0, 50.0, 80.0, 110.0]  # each stage's first step, untimed
    assert [t["tokens_per_s"] for t in table] == [3000.0, 6500.0, 9500.0, 12500.0] and table[0]["steps_timed"] == 3


def test_the_muon_cut_off_is_the_largest_size_up_to_which_batching_never_lost():
    gc = load_gpu_check()
    rows = [{"numel": n, "batched_over_alone": r} for n, r in ((1000, 0.3), (5000, 1.04), (9000, 1.2), (20000, 0.8))]
    assert gc.gpu_quick.cut_off(rows)["muon_batch_max_numel"] == 5000  # 1.04: within the margin, noise
    assert gc.gpu_quick.cut_off(rows[:2])["muon_batch_max_numel"] is None
    assert gc.gpu_quick.cut_off([{"numel": 10, "batched_over_alone": 1.5}])["muon_batch_max_numel"] == 0


def test_the_shipped_h100_row_is_the_fp8_sections_reference():
    row = json.loads(load_gpu_check().gpu_quick.SHIPPED.read_text())["1b"]["default"]
    assert round(row["step_ms"], 1) == 2124.5 and row["rc"] == 0  # configs/1b.yaml on one H100, 2026-11-23


# ---------------------------------------------------------------- one rental: parts, the deadline, isolation


def test_a_deadline_skips_every_section_it_cannot_fit_and_the_reports_name_each(tmp_path):
    gc = load_gpu_check()
    assert gc.main(["--quick", "--cpu-smoke", "--deadline-s", "0", "--out", str(tmp_path)]) == 0
    result, report = json.loads((tmp_path / "gpu_check.json").read_text()), (tmp_path / "gpu_check.md").read_text()
    for name in gc.gpu_quick.QUICK_SECTIONS:
        assert result[name]["skipped"] == "deadline" and result[name]["deadline_s"] == 0, result[name]
        assert f"| {name} | " in report and "skipped: deadline" in report.split(f"| {name} | ")[1].split("\n")[0]


def test_each_section_leaves_both_reports_before_the_next_starts(tmp_path):
    gc = load_gpu_check()
    seen = []

    def second() -> dict:
        seen.append((json.loads((tmp_path / "gpu_check.json").read_text()), (tmp_path / "gpu_check.md").read_text()))
        raise RuntimeError("second broke")

    results = {"date": "today", "command": "test", "smoke": True}
    jobs = {"env": lambda: {"torch": "x"}, "fp8": second, "muon": lambda: {"skipped": "on purpose"}}
    gc.run_sections(jobs, results, gc.writer(tmp_path, gc.gpu_quick.markdown), {"env": 1, "fp8": 1, "muon": 1e9}, 1e6)
    (first, first_report), = seen
    assert first["env"] == {"torch": "x"} and "| torch | x |" in first_report and "fp8" not in first
    final = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "second broke" in final["fp8"]["error"] and final["muon"]["skipped"] == "deadline"  # 1e9 s do not fit
    assert not list(tmp_path.glob(".*.tmp"))  # written by replacing, no temp file left
    report = (tmp_path / "gpu_check.md").read_text()
    assert "| fp8 | 1 |" in report and "FAILED: RuntimeError: second broke" in report and "skipped: deadline" in report


def test_a_failing_line_in_a_section_loses_none_of_the_others(monkeypatch):
    gc = load_gpu_check()
    q, device, size = gc.gpu_quick, torch.device("cpu"), gc.gpu_quick.sizes(True)
    calls = []

    def fake_step(cfg, rt, batches, steps):
        calls.append((cfg.runtime.parallel, cfg.train.fp8, cfg.train.compile_ddp_split, rt.distributed))
        if len(calls) in (2, 3, 5, 7):  # fsdp's fsdp line; fp8_ddp's split and unwrapped lines; fp8's tensorwise
            raise RuntimeError("this line broke")
        return {"tokens_per_s": 100.0, "step_ms": 10.0, "loss": 5.0, "graphs": 1, "graph_breaks": 0}

    monkeypatch.setattr(q, "time_train_step", fake_step)
    fsdp = q.check_fsdp(device, size["fsdp"])
    assert fsdp["ddp"]["tokens_per_s"] == 100 and "this line broke" in fsdp["fsdp"]["error"]
    assert fsdp["goal"]["met"] is None and "FAILED RuntimeError" in q.summary_line("fsdp", fsdp)
    ddp = q.check_fp8_ddp(device, size["fp8_ddp"])  # the split line and the unwrapped one fail
    assert ddp["works_with"] == ["ddp_one_graph"] and ddp["ddp_one_graph"]["loss"] == 5.0 and ddp["loss_diff"] == {}
    assert "error" in ddp["ddp_split"] and "error" in ddp["unwrapped"]
    fp8 = q.check_fp8(device, size["fp8"])
    assert "error" in fp8["tensorwise"] and fp8["rowwise"]["speedup"] == 1.0 and fp8["goals"][0]["met"] is None
    assert calls == [("ddp", "none", None, True), ("fsdp", "none", None, True), ("ddp", "rowwise", True, True),
                     ("ddp", "rowwise", False, True), ("ddp", "rowwise", None, False), ("ddp", "none", None, False),
                     ("ddp", "tensorwise", None, False), ("ddp", "rowwise", None, False)]  # every line ran
    for name, r in (("fsdp", fsdp), ("fp8_ddp", ddp), ("fp8", fp8)):
        assert gc.section_failed(r) and q.summary_line(name, r)  # failed, and still reported line by line


def test_the_two_parts_hold_every_section_once_and_each_fits_its_deadline():
    gc = load_gpu_check()
    plan, parts = gc.gpu_quick.PLAN, [gc.parse(["--quick", "--cpu-smoke", "--part", n]).sections for n in "12"]
    assert parts[0][:3] == ["env", "fp8", "fp8_ddp"]  # the headline first, after env
    assert sorted(parts[0] + parts[1]) == sorted([*plan, "env"]) and parts[0] + parts[1][1:] == list(plan)
    for part, device_call in zip(parts, documented_device_calls()):
        deadline = float(device_call["command"].split("--deadline-s ")[1].split()[0])
        assert sum(plan[s][1] for s in part) + 10 <= deadline < device_call["timeout_s"] <= 300  # 10 s: imports
    assert sum(c["timeout_s"] for c in documented_device_calls()) <= 600
    for bad in (["--part", "1"], ["--quick", "--part", "1", "--sections", "fp8"], ["--deadline-s", "9"]):
        with pytest.raises(SystemExit) as e:
            gc.parse([*bad, "--cpu-smoke"])
        assert e.value.code == 2


def documented_device_calls() -> list[dict]:
    """The device calls docs/development.md prepares: each one's command, carry and timeout_s."""
    text = (REPO / "docs" / "development.md").read_text().split("## When a GPU is available")[1]
    calls = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", text, flags=re.S)]
    assert len(calls) == 2 and all(c["carry"] == [".whl"] for c in calls), calls
    return calls


def test_the_documented_device_calls_fit_the_device_tool_and_parse():
    gc = load_gpu_check()
    for n, call in enumerate(documented_device_calls(), 1):
        assert len(call["command"]) < 2000
        args = shlex.split(call["command"].split("bench/gpu_check.py")[1].split("2>&1")[0].replace("$OUT", "/o"))
        assert gc.parse([*args, "--cpu-smoke"]).part == n
