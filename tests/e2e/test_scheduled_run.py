"""train.batch_schedule / seq_len_schedule in real runs: a scheduled run counts its stages and resumes mid-stage
bit-exactly; compiled, each seq_len is one static graph."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import REPO, small_overrides

from nanopt.config import load_config
from nanopt.main import run
from nanopt.recipe.optim import lr_multiplier

# ---------------------------------------------------------------- real runs
STEPS = 8
# Stage 1 steps 0-2 (256 tokens, seq 16), stage 2 steps 3-4 (512, seq 16), stage 3 steps 5-7 (512, seq 32).
SCHEDULED = {"train.batch_schedule": "0:256,3:512", "train.seq_len_schedule": "0:16,5:32",
             "train.precision": "fp32", "train.max_steps": STEPS, "checkpoint.every": 2, "log.tensorboard": "false"}


def _args(run_dir, **changes: object) -> list[str]:
    return [*small_overrides(**{**SCHEDULED, **changes}), f"--run.dir={run_dir}"]


@pytest.mark.slow
def test_a_scheduled_run_counts_its_stages_and_resumes_mid_stage_bit_exactly(tmp_path, corpus_dir, capsys):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    # killed in step 5 (it resumes from step 4, inside stage 2): a process of its own, beside the reference run
    env = {**os.environ, "NANOPT_TEST_HOOK": "kill-in-step:5", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nanopt.main", *_args(killed)], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=(err := (tmp_path / "killed.err").open("w")))
    assert run(_args(reference)) == 0
    out = capsys.readouterr().out
    assert "stage 2 from step 3: 512 tokens/step, seq 16, accum 8, lr x1.41" in out
    assert "stage 3 from step 5: 512 tokens/step, seq 32, accum 4, lr x1.41" in out
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["tokens_seen"] == 3 * 256 + 5 * 512 and summary["packing_cropped_share"] is None
    records = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    lines = {r["step"]: r for r in records if "loss" in r}
    cfg = load_config(reference / "config.yaml")
    ratio = [lines[s]["lr"] / lr_multiplier(s - 1, cfg.train) for s in range(1, STEPS + 1)]
    assert ratio[3:] == pytest.approx([ratio[0] * math.sqrt(2)] * 5) and ratio[:3] == pytest.approx([ratio[0]] * 3)
    assert "cropped_share" not in lines[1]

    with err:
        assert proc.wait(timeout=300) == -signal.SIGKILL, (tmp_path / "killed.err").read_text()[-2000:]
    assert run(_args(killed)) == 0
    assert "stage 2 from step 4: 512 tokens/step" in capsys.readouterr().out
    after = json.loads((killed / "summary.json").read_text())
    assert after["weights_sha256_per_rank"] == summary["weights_sha256_per_rank"]
    assert after["tokens_seen"] == summary["tokens_seen"]


@pytest.mark.slow
def test_compiled_each_seq_len_is_one_static_graph_a_batch_change_none_and_a_recompile_no_mfu_figure(tmp_path,
                                                                                                  corpus_dir):
    """A batch change is shape-free (micro_batch_size is fixed); three lengths are three static graphs, 3 x one
    length's (dynamo's default would reuse a slower dynamic one). Each stage's first step, alone, has no MFU."""
    counts = {}
    for name, seq_schedule in (("one", ""), ("three", "0:16,2:32,4:8")):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        # one layer: the whole-model graph, traced layer by layer, compiles in about half the time
        args = _args(tmp_path / name, **{"train.compile": "true", "train.max_steps": 6, "train.seq_len_schedule":
                                         seq_schedule, "train.batch_schedule": "0:256,2:512,4:1024", "log.every": 1,
                                         "checkpoint.every": 0, "model.n_layers": 1})
        assert run(args) == 0
        counts[name] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # "one" changes its batch twice (accum 2 -> 4 -> 8) on a single seq_len: no recompile for that
    assert counts["one"] > 0 and counts["three"] == 3 * counts["one"], counts
    records = [json.loads(x) for x in (tmp_path / "three" / "metrics.jsonl").read_text().splitlines()]
    mfu = {r["step"]: r["mfu"] for r in records if "loss" in r}
    assert mfu[1] is None and mfu[3] is None and mfu[5] is None  # each stage's first step
    assert mfu[4] is not None and mfu[6] is not None
