"""The pages, walked: every command in a ```bash block of README.md and docs/*.md runs as its page writes it, in
page order, in a fresh directory of its own, at toy size, and does what its page promises: its exit status, the
files it writes, the lines it prints, the summary it leaves. A command that cannot run here (a GPU, Modal, a TPU,
the network, a pip install) says why. A command a page has and WALKS lacks, or a step no longer on its page, fails
test_every_page_command_is_walked (quick: nothing runs). Inline commands are walked where a page relies on them
(`said`: the page's words); bench/ commands are left to tests/test_bench.py.

`nanopt ...`, `python -m nanopt.main|nanopt.cli ...` and `python -c` run in this process, torchrun as a process. A
sweep is a `beside` step: from the walk's start, `python -m nanopt.cli sweep ...` in its page's directory, its runs
training on the second core; it reads only configs/ and is checked at its place in its page. At toy size: the page's
argv, then the step's `toy` flags (a later flag wins, checked in each run's config.yaml). Step counts stay the page's
where anything reads them; a run that nothing reads after it trains 20 (BRIEF)."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import pytest
import yaml
from conftest import REPO, make_documents

from nanopt import cli, main
from nanopt.config import canonical

# A 64-wide, 2-layer model on 32-token windows, 256 tokens a step, two validation batches.
SHAPE = ("--model.dim=64 --model.n_layers=2 --model.n_heads=4 --model.n_kv_heads=2 --model.ffn_dim=128 "
         "--train.seq_len=32 --train.micro_batch_size=4 --train.global_batch_tokens=256 --eval.batches=2")
TOY = f"{SHAPE} --runtime.threads=1"  # the quick start: its curves.png and samples are what the README shows
BARE = f"{TOY} --log.curves=false --sample.num_samples=0"  # every other run: no ~1 s of matplotlib, no samples
BRIEF = f"{BARE} --train.max_steps=20"  # a run whose length nothing reads: 20 steps instead of 150 save ~1.2 s
# A sweep sets each run's threads itself, and asks torch for devices in a process of its own unless told cpu.
SWEEP_TOY = f"--seeds 1 --runtime.device=cpu --train.max_steps=20 {SHAPE} --log.curves=false --sample.num_samples=0"

GPU = "needs CUDA GPUs"
HUB = "needs the network: a Hugging Face hub dataset or tokenizer"
MODAL = "needs a Modal account and the network"
TPU = "a step of setting up and using a TPU VM"
BENCH = "a bench: tests/test_bench.py runs each bench at toy size"
SUITE = "the test suite itself"
# Two gloo ranks cost ~11 CPU-s here; e2e/test_ddp.py checks two ranks (ddp, fsdp) against one rank's run.
DDP = "two CPU ranks: tests/e2e/test_ddp.py runs ddp and fsdp torchruns against one rank"
LADDER = "trains a ladder of 12 runs: tests/test_scaling.py fits a ladder's summaries and loads the plan's points"
PIP = "installs packages from the network (this venv has them)"
SERVER = "a server that runs until stopped (tests/e2e/test_profiled_run.py reads a run through a real one)"


@dataclass(frozen=True)
class Step:
    doc: str  # the command as its page writes it: a `\` continuation joined, the `# comment` dropped
    toy: str = ""  # flags appended to run it at toy size (a later flag wins)
    run: str = ""  # what runs instead of `doc` where the page's command holds a placeholder (runs/a)
    code: int = 0  # its exit status
    prints: tuple[str, ...] = ()  # parts of what it prints (stdout and stderr)
    files: tuple[str, ...] = ()  # globs it must leave, relative to the page's directory
    summary: dict[str, dict] = field(default_factory=dict)  # run directory -> items of its summary.json
    same: tuple[str, ...] = ()  # files it must leave byte for byte
    said: str = ""  # an inline command: the page's words for it, found in its prose instead of a block
    skip: str = ""  # why it does not run here
    beside: bool = False  # runs from the walk's start as a process of its own (see Beside), checked here


def skip(doc: str, why: str) -> Step:
    return Step(doc, skip=why)


@dataclass(frozen=True)
class Page:
    steps: tuple[Step, ...]
    # Steps of other pages (or a user's own) that this page assumes ran before: each runs once in the module and
    # the run directories it leaves (its `summary` keys) are copied into every page that needs them.
    setup: tuple[Step, ...] = ()
    user_files: tuple[str, ...] = ()  # the user's documents, one JSON object per line, that the page reads


def run_files(run: str, step: int) -> tuple[str, ...]:
    return (f"{run}/config.yaml", f"{run}/metrics.jsonl", f"{run}/tb", f"{run}/checkpoints/step_{step:06d}/COMPLETE")


QUICK_START = Step('pip install "torch==2.13.0" -e ".[dev]" && python -m nanopt.main', run="python -m nanopt.main",
                   toy=TOY, prints=("2 samples from step 150, prompt 'Elementary, my dear'", "done: 150 steps"),
                   files=(*run_files("runs/tiny", 150), "runs/tiny/curves.png"),
                   summary={"runs/tiny": {"steps": 150}})
SPEEDRUN = Step("python -m nanopt.main --config configs/speedrun-cpu.yaml --train.target_val_bpb=2.79 "
                "--train.stop_at_target=true", toy=f"{BARE} --train.target_val_bpb=4.6",
                summary={"runs/speedrun-cpu": {"target_reached": True, "stopped_at_target": True}})
# The profiler's summary of 20 recorded steps takes seconds of torch's event processing: 2 do at toy size.
PROFILED = Step("python -m nanopt.main --train.max_steps=60 --profile.enabled=true --run.name=profiled",
                toy=f"{BARE} --profile.wait=1 --profile.warmup=1 --profile.active=2",
                prints=("profile: steps", "profile: top ops by self time"),
                files=("runs/profiled/profile_summary.json", "runs/profiled/profile.html",
                       "runs/profiled/tb/plugins/profile/step_*/*.pt.trace.json"),
                summary={"runs/profiled": {"steps": 60}})
TENSORBOARD = skip("tensorboard --logdir runs", SERVER)


def sweep_point(optimizer: str, seed: int) -> Step:
    """A point of the README's sweep (runs/opt), trained here: experiments.md reads two seeds a side."""
    run = f"runs/opt/optim.name={optimizer},seed={seed}"
    return Step(f"python -m nanopt.main configs/tiny.yaml --optim.name={optimizer} --run.seed={seed} --run.dir={run}",
                toy=f"{BARE} --train.max_steps=20", summary={run: {"steps": 20}})


WALKS: dict[str, Page] = {
    "README.md": Page((
        QUICK_START,
        Step("python -m nanopt.main", toy=TOY, said="Running the command again prints that finished run's summary",
             prints=("runs/tiny is finished; nothing to train",),
             same=("runs/tiny/metrics.jsonl", "runs/tiny/summary.json")),
        Step("python -m nanopt.main --train.max_steps=300", toy=TOY, said="`--train.max_steps=300` continues it",
             prints=("resuming from runs/tiny/checkpoints/step_000150",), files=run_files("runs/tiny", 300),
             summary={"runs/tiny": {"steps": 300}}),
        skip('pip install "torch==2.13.0" -e ".[dev]" && python -m pytest -q', SUITE),
        # Train
        Step("python -m nanopt.main configs/tiny.yaml --run.name=tiny-file", toy=BRIEF,
             summary={"runs/tiny-file": {"steps": 20}}),
        Step("python -m nanopt.main --config configs/tiny.yaml --train.max_steps=50 --run.name=tiny-50", toy=BARE,
             files=run_files("runs/tiny-50", 50), summary={"runs/tiny-50": {"steps": 50}}),
        skip("torchrun --standalone --nproc-per-node=2 -m nanopt.main --config configs/tiny.yaml --run.name=tiny-ddp",
             DDP),
        skip("torchrun --nproc-per-node=8 -m nanopt.main --config configs/1b.yaml", GPU),
        skip("torchrun --standalone --nproc-per-node=2 -m nanopt.main --runtime.parallel=fsdp --run.name=tiny-fsdp",
             DDP),
        Step("nanopt train configs/tiny.yaml --run.name=tiny-cli", toy=BRIEF, summary={"runs/tiny-cli": {"steps": 20}}),
        TENSORBOARD,
        # Data
        skip("nanopt prepare --config configs/1b.yaml --sample-documents 10000", HUB),
        skip("HF_TOKEN=... nanopt prepare --config configs/1b.yaml", HUB),
        # Experiments
        Step("nanopt sweep configs/tiny.yaml --set optim.name=adamw,muon --seeds 3 --name opt", toy=SWEEP_TOY,
             beside=True, files=("runs/opt/sweep.json",),
             summary={"runs/opt/optim.name=adamw,seed=1337": {"steps": 20},
                      "runs/opt/optim.name=muon,seed=1337": {"steps": 20}}),
        Step("nanopt runs runs/opt", prints=("optim.name=adamw,seed=1337", "optim.name=muon,seed=1337")),
        Step("nanopt compare runs/a runs/b", run="nanopt compare runs/tiny runs/tiny-50",
             prints=("| figure | A | B |", "| final val loss |")),
        Step("nanopt plot runs/a runs/b --metric val_bpb", run="nanopt plot runs/tiny runs/tiny-50 --metric val_bpb",
             prints=("plot_val_bpb_steps.png",), files=("plot_val_bpb_steps.png",)),
        Step("nanopt eval runs/a --watch", run="nanopt eval runs/tiny-50 --watch", files=("runs/tiny-50/evals.jsonl",)),
        # Scaling laws
        Step("nanopt scaling plan configs/ladder-cpu.yaml --budgets 5e11,1e12,2e12 --sizes 4 --out runs/ladder",
             prints=("budget", "nanopt sweep"), files=("runs/ladder/ladder.yaml",)),
        skip("nanopt sweep configs/ladder-cpu.yaml --points runs/ladder/ladder.yaml --dir runs/ladder", LADDER),
        skip("nanopt scaling fit runs/ladder --predict 8e12 --plot fit.png", LADDER),
        # Evaluate, sample, export
        Step("nanopt eval runs/tiny --split test", prints=("test loss",), files=("runs/tiny/evals.jsonl",)),
        skip("nanopt eval runs/tiny --tasks hellaswag --limit 200", HUB),
        Step('nanopt sample runs/tiny --prompt "Elementary, my dear"', prints=("Elementary, my dear",)),
        Step("nanopt export runs/tiny --out exported/tiny",
             files=("exported/tiny/config.json", "exported/tiny/model.safetensors")),
        Step("nanopt average runs/tiny --last 2 --out averaged/tiny", prints=("averaged 2 checkpoints",),
             files=("averaged/tiny/checkpoints/step_000300/COMPLETE",)),
        Step("python -m nanopt.main --train.init_from=hf:exported/tiny --run.name=finetune", toy=BRIEF,
             summary={"runs/finetune": {"steps": 20}}),
        # Speedrun; speed
        SPEEDRUN,
        Step("nanopt estimate --config configs/1b.yaml --hardware h100-sxm --gpus 8 --mfu 0.4 --price-per-gpu-hour 3.0",
             prints=("17.8 h", "$427.74")),
        PROFILED,
        # Modal and TPU
        skip("modal run modal_app.py --config configs/1b.yaml", MODAL),
        skip("python -m nanopt.main configs/tpu-v6e.yaml", TPU),
    )),
    "docs/data.md": Page((
        skip("nanopt prepare --config configs/1b.yaml --sample-documents 10000", HUB),
        skip("HF_TOKEN=... nanopt prepare --config configs/1b.yaml", HUB),
        Step("nanopt prepare --config configs/tiny.yaml --data.source=data/docs --prepare.dataset=json "
             "--prepare.data_files='docs/*.jsonl' --prepare.val_tokens=1e6",
             toy="--prepare.val_tokens=20000 --no-progress", prints=("val: 20,000 tokens",),
             files=("data/docs/manifest.json", "data/docs/stats.json", "data/docs/val_000000.bin",
                    "data/docs/train_000000.bin")),
        Step("python -m nanopt.main configs/tiny.yaml --data.source=data/docs --run.name=docs", toy=BRIEF,
             summary={"runs/docs": {"steps": 20}}),
        skip("HF_TOKEN=... nanopt prepare --config configs/1b.yaml", HUB),
        skip("torchrun --nproc-per-node=8 -m nanopt.main --config configs/1b.yaml", GPU),
    ), user_files=("docs/a.jsonl", "docs/b.jsonl")),
    "docs/development.md": Page((
        skip('pip install "torch==2.13.0" -e ".[dev]" && python -m pytest -q', SUITE),
        skip('python -m pytest -q -m "not slow"', SUITE),
        skip("python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
             "--platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0 lm_eval==0.4.13", PIP),
        skip("OMP_NUM_THREADS=1 python bench/gpu_check.py --quick --cpu-smoke --out /tmp/quick",
             "a bench: tests/test_gpu_check.py runs --quick --cpu-smoke"),
    )),
    "docs/evaluation.md": Page((
        Step("nanopt eval runs/tiny", prints=("val loss",), files=("runs/tiny/evals.jsonl",)),
        Step("nanopt eval runs/tiny/checkpoints/step_000150 --split test --batches 32", prints=("test loss",)),
        skip("torchrun --standalone --nproc-per-node=2 -m nanopt.cli eval runs/tiny",
             "tests/e2e/test_eval_and_export.py runs this command (two ranks give one rank's loss)"),
        Step("nanopt eval --make-tasks tasks/", files=("tasks/nanopt_mc.yaml", "tasks/core/core.yaml")),
        Step("nanopt eval runs/speedrun-cpu --tasks nanopt_mc,nanopt_rolling --include-path tasks/ --core tasks/core",
             toy="--limit 8", prints=("nanopt_mc", "nanopt_rolling", "core"),
             files=("runs/speedrun-cpu/evals.jsonl",)),
        skip("nanopt eval runs/a/checkpoints/step_000050 --tasks hellaswag --limit 500 --num-fewshot 0 --json", HUB),
        skip("nanopt eval exported/tiny --tasks arc_easy", HUB),
        Step("python -m nanopt.main --eval.tasks=nanopt_mc --eval.tasks_path=tasks/ --eval.tasks_every=100 "
             "--run.name=tasks", toy=f"{BARE} --eval.tasks_limit=8", files=("runs/tasks/evals.jsonl",),
             summary={"runs/tasks": {"steps": 150}}),
        Step('nanopt sample runs/tiny --prompt "Elementary, my dear" -n 3 --max-new-tokens 200 --temperature 0.8 '
             '--top-k 50', prints=("Elementary, my dear",)),
        Step("nanopt export runs/tiny --out exported/tiny",
             files=("exported/tiny/config.json", "exported/tiny/model.safetensors")),
        Step("python -c \"from transformers import AutoModelForCausalLM as M; "
             "print(M.from_pretrained('exported/tiny'))\"", prints=("LlamaForCausalLM(",)),
        Step("python -m nanopt.main --train.init_from=hf:exported/tiny --run.name=finetune", toy=BRIEF,
             summary={"runs/finetune": {"steps": 20}}),
    ), setup=(QUICK_START, SPEEDRUN)),
    "docs/experiments.md": Page((
        Step("nanopt sweep configs/tiny.yaml --set optim.name=adamw,muon --set train.lr=1e-3,3e-3 --seeds 3 "
             "--name opt-lr", toy=SWEEP_TOY, beside=True, files=("runs/opt-lr/sweep.json",),
             summary={f"runs/opt-lr/optim.name={o},train.lr={lr},seed=1337": {"steps": 20}
                      for o in ("adamw", "muon") for lr in ("1e-3", "3e-3")}),
        skip("nanopt sweep configs/1b.yaml --set train.lr=2e-4,4e-4 --nproc 2 --name lr --train.max_steps=2000", GPU),
        skip("nanopt runs runs/lr", "reads the GPU sweep above"),
        Step("nanopt runs", prints=("9 runs in",)),  # runs/tiny, runs/opt's 4 and runs/opt-lr's 4
        Step("nanopt runs runs/opt --compare muon adamw --metric final_val_bpb",
             prints=("A = optim.name=muon", "Welch's t-test")),
        Step("nanopt plot runs/a runs/b", run="nanopt plot runs/tiny runs/opt-lr", files=("plot_val_loss_steps.png",)),
        Step("nanopt plot runs/my-sweep --metric val_bpb --x seconds -o sweep.png",
             run="nanopt plot runs/opt-lr --metric val_bpb --x seconds -o sweep.png", files=("sweep.png",)),
        Step("nanopt eval runs/tiny --watch [--interval 30] [--timeout 0] [--device cpu]",
             run="nanopt eval runs/tiny --watch --interval 30 --timeout 0 --device cpu",
             files=("runs/tiny/evals.jsonl",)),
    ), setup=(QUICK_START, *(sweep_point(o, s) for o in ("adamw", "muon") for s in (1337, 1338)))),
    "docs/mfu.md": Page((
        Step("nanopt estimate --config configs/1b.yaml --hardware h100-sxm --gpus 8 --mfu 0.4 --price-per-gpu-hour 3.0",
             prints=("2.03e+20", "17.8 h", "142.6", "$427.74")),
        Step("nanopt estimate configs/1b.yaml --tokens 20x --json", prints=('"gpu_hours"',)),
        Step("nanopt estimate configs/1b.yaml --train.seq_len=8192", prints=("seq 8192",)),
        Step("nanopt estimate configs/170m-1gpu.yaml --gpus 1",
             prints=("1 × NVIDIA H100 SXM", "3,486,515,200", "4.04e+18", "2.8 h")),
    )),
    "docs/modal.md": Page((
        skip("torchrun --standalone --nproc-per-node=<n> -m nanopt.main --config /vol/runs/<name>/modal_config.yaml",
             "what a Modal container runs, on its Volume"),
        skip('pip install -e ".[modal]"', PIP),
        skip("modal setup", MODAL),
        skip("modal secret create huggingface HF_TOKEN=hf_...", MODAL),
        skip("modal secret create wandb WANDB_API_KEY=...", MODAL),
        skip("modal run modal_app.py --config configs/1b.yaml", MODAL),
        skip("modal run modal_app.py --config configs/1b.yaml --gpus 4 --gpu-type A100-80GB --run-name 1b-a100", MODAL),
        skip("modal run modal_app.py --config configs/1b.yaml --prepare", MODAL),
        skip("modal run --detach modal_app.py --config configs/1b.yaml", MODAL),
        skip("modal run modal_app.py::evaluate --run-name 1b", MODAL),
        skip("modal deploy modal_app.py", MODAL),
        skip('modal run modal_app.py::bench --args "--quick"', MODAL),
        skip('modal run modal_app.py::bench --name vs_hf --args="--repeats 7"', MODAL),
        skip('modal run modal_app.py::bench --name gpu_check --args="--sections fp8,ddp,ranks2,sample"', MODAL),
        skip('modal run modal_app.py::sweep --config configs/170m-1gpu.yaml --sets "optim.name=adamw,muon" --seeds 3 '
             '--gpus 1', MODAL),
        skip('modal run modal_app.py::bench --args "--quick"', MODAL),
        skip("modal volume get nanopt bench/gpu_check-<UTC time>", MODAL),
        skip("torchrun --nnodes=<nodes> --node-rank=<rank> --master-addr=<container 0> --master-port=29500 "
             "--nproc-per-node=<n> -m nanopt.main --config /vol/runs/<name>/modal_config.yaml",
             "what Modal's multi-node containers run, on its Volume"),
    )),
    "docs/profiling.md": Page((PROFILED, TENSORBOARD)),
    "docs/results.md": Page((
        skip("OMP_WAIT_POLICY=PASSIVE python bench/vs_hf.py --repeats 7", BENCH),
        skip("OMP_WAIT_POLICY=PASSIVE python bench/ladder.py --repeats 5", BENCH),
        skip("OMP_WAIT_POLICY=PASSIVE python bench/ddp.py --repeats 7", BENCH),
    )),
    "docs/speedrun.md": Page((
        Step("python -m nanopt.main --train.target_val_loss=2.4 --train.stop_at_target=true --eval.every=10 "
             "--run.name=sdpa", toy=f"{BARE} --train.target_val_loss=3.3",
             prints=("target val loss 3.3000 reached at step",),
             summary={"runs/sdpa": {"target_reached": True, "stopped_at_target": True}}),
        Step("nanopt runs", prints=("sdpa",)),
        SPEEDRUN,
        Step("nanopt prepare --config configs/speedrun-cpu.yaml --data.source=data/mytext --prepare.dataset=json "
             "--prepare.data_files=docs.jsonl --prepare.streaming=false --prepare.val_tokens=200000",
             toy="--prepare.val_tokens=20000 --no-progress", prints=("val: 20,000 tokens",),
             files=("data/mytext/manifest.json", "data/mytext/val_000000.bin", "data/mytext/train_000000.bin")),
        Step("python -m nanopt.main --config configs/speedrun-cpu.yaml --data.source=data/mytext "
             "--train.target_val_bpb=2.9 --train.stop_at_target=true --run.name=speedrun-mytext",
             toy=f"{BARE} --train.target_val_bpb=3.5",
             summary={"runs/speedrun-mytext": {"target_reached": True, "stopped_at_target": True}}),
        Step("python -m nanopt.main --config configs/speedrun-cpu.yaml --train.batch_schedule=0:2048,150:4096 "
             "--train.seq_len_schedule=0:32,100:64 --train.max_steps=300 --run.name=schedules",
             toy=f"{BARE} --train.batch_schedule=0:128,30:256 --train.seq_len_schedule=0:16,20:32 "
                 "--train.max_steps=40",  # both stage changes, in 40 steps
             prints=("stage 2 from step 20", "stage 3 from step 30"), summary={"runs/schedules": {"steps": 40}}),
        Step("python -m nanopt.main --train.ema_decay=0.98 --train.ema_start=50 --eval.weights=ema "
             "--checkpoint.every=50 --run.name=ema", toy=BARE, prints=("(ema weights)",),
             files=("runs/ema/checkpoints/step_000150/ema.safetensors",),
             summary={"runs/ema": {"eval_weights": "ema", "steps": 150}}),
        Step("nanopt eval runs/ema --weights model", prints=("step_000150 (step 150) | val loss",)),
        Step("nanopt average runs/ema --last 3 --out averaged/ema", prints=("(steps 50, 100, 150)",),
             files=("averaged/ema/checkpoints/step_000150/COMPLETE",)),
        Step("nanopt eval averaged/ema", prints=("val loss", "averaged/ema/evals.jsonl")),
    ), user_files=("docs.jsonl",)),
    "docs/tpu.md": Page((
        skip("gcloud compute tpus tpu-vm create nanopt --zone=us-east5-b --accelerator-type=v6e-4 "
             "--version=v2-alpha-tpuv6e", TPU),
        skip("gcloud compute tpus tpu-vm ssh nanopt --zone=us-east5-b", TPU),
        skip("git clone <this repo> nanopt && cd nanopt", TPU),
        skip("python3 --version", TPU),
        skip("python3.11 -m venv .venv && . .venv/bin/activate", TPU),
        skip('pip install -e ".[tpu]"', TPU),
        skip("export PJRT_DEVICE=TPU", TPU),
        skip("python -m nanopt.main configs/tpu-v6e.yaml", TPU),
        skip("python -m nanopt.main --runtime.device=xla", TPU),
    )),
}

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def page_commands(text: str) -> list[str]:
    """The commands of a page's ```bash blocks, one per line: a `\\` continuation joined, a `# comment` and
    comment lines dropped, runs of spaces made one."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in re.sub(r"\\\n", " ", block).splitlines():
            line = re.sub(r"(^|\s+)#\s.*$", "", line)
            if line.strip():
                commands.append(" ".join(line.split()))
    return commands


def prose(text: str) -> str:
    return " ".join(re.sub(r"^```.*?^```", "", text, flags=re.S | re.M).split())


def test_every_page_command_is_walked():
    """Each page's commands, in order, are WALKS' steps for it; a page without commands has no entry."""
    for page in PAGES:
        name = str(page.relative_to(REPO))
        text = page.read_text()
        walk = WALKS.get(name, Page(()))
        documented, walked = page_commands(text), [s.doc for s in walk.steps if not s.said]
        assert walked == documented, (
            f"{name}: its commands and WALKS[{name!r}] differ; give each new command a step (how it runs at toy "
            f"size and what it must do, or why it cannot run here) and drop the steps no longer on the page.\n"
            f"on the page, not walked: {[c for c in documented if c not in walked]}\n"
            f"walked, not on the page: {[c for c in walked if c not in documented]}\n"
            f"(or the same commands in another order)")
        for step in walk.steps:
            assert not step.said or " ".join(step.said.split()) in prose(text), \
                f"{name} no longer says {step.said!r}: update or drop the inline step `{step.doc}`"
    assert set(WALKS) <= {str(p.relative_to(REPO)) for p in PAGES}, "WALKS names a page that is gone"


def execute(argv: list[str]) -> int:
    """One command, as a user's shell would run it from the page's directory."""
    try:
        if argv[0] == "nanopt":
            return cli.run(argv[1:])
        if argv[:3] == ["python", "-m", "nanopt.main"]:
            return main.run(argv[3:])
        if argv[:3] == ["python", "-m", "nanopt.cli"]:
            return cli.run(argv[3:])
        if argv[:2] == ["python", "-c"]:
            exec(compile(argv[2], "<python -c>", "exec"), {})
            return 0
        if argv[0] == "torchrun":
            launcher = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
            return subprocess.run(launcher, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300).returncode
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    raise AssertionError(f"the walk cannot run `{shlex.join(argv)}`: give its step a reason to skip")


def toy_won(run_dir: Path, toy: str) -> list[str]:
    """The toy flags that the run's config.yaml does not hold: a later override must win over the page's."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    lost = []
    for flag in shlex.split(toy):
        key, eq, value = flag[2:].partition("=")
        if eq and "." in key:
            section, name = key.split(".", 1)
            if canonical(key, config[section][name]) != canonical(key, value):  # `0:128,30:256` is a list
                lost.append(f"{key}={config[section][name]!r}, the toy's {value}")
    return lost


def check(step: Step, where: str, cwd: Path, capfd, factory, beside: Optional[Beside] = None) -> None:
    before = {name: (cwd / name).read_bytes() for name in step.same}
    if step.beside:
        code, out, err = beside.result(step)
    elif step.doc in DONE:  # a shared step that ran already: a copy of its runs, its output
        code, out, err = copy_runs(step, cwd)
    else:
        code = execute(shlex.split(step.run or step.doc) + shlex.split(step.toy))
        out, err = capfd.readouterr()
        if step.doc in SHARED:
            store = factory.mktemp("shared")
            for run in step.summary:
                shutil.copytree(cwd / run, store / run, symlinks=True)
            DONE[step.doc] = store, (code, out, err)
    what = f"{where}: `{step.run or step.doc}` + `{step.toy}`"
    tail = (out + err)[-4000:]
    assert code == step.code, f"{what} exited {code}, the page says {step.code}:\n{tail}"
    missing = [p for p in step.prints if p not in out + err]
    assert not missing, f"{what} did not print {missing}:\n{tail}"
    absent = [f for f in step.files if not list(cwd.glob(f))]
    assert not absent, f"{what} did not write {absent}"
    for name, content in before.items():
        assert (cwd / name).read_bytes() == content, f"{what} changed {name}"
    for run, items in step.summary.items():
        summary = json.loads((cwd / run / "summary.json").read_text())
        wrong = {k: summary.get(k) for k, v in items.items() if summary.get(k) != v}
        assert not wrong, f"{what}: {run}/summary.json has {wrong}, the page says {items}"
        assert not (lost := toy_won(cwd / run, step.toy)), f"{what}: the page's flags won over the toy's: {lost}"


@pytest.fixture
def page_dir(request, tmp_path, monkeypatch, offline, beside_steps) -> Path:
    """A fresh directory that looks like the clone's root: configs/ is there, runs/ and the rest are not (but what
    the page's `beside` steps, started with the walk, have written by now)."""
    name = request.node.callspec.params["name"]
    cwd = beside_steps[name][0] if name in beside_steps else clone_root(tmp_path)
    monkeypatch.chdir(cwd)
    return cwd


def clone_root(path: Path) -> Path:
    (path / "configs").symlink_to(REPO / "configs")
    return path


class Beside:
    """The walk's `beside` steps, one after another in a thread of their own, each a process in its page's
    directory a little below this process's priority (nice 3): with a sweep's two runs at a time they keep the
    second core busy while the walk here keeps its one. result(command) waits for a step: its exit status, stdout
    and stderr (from files, which never fill up as an unread pipe does)."""

    def __init__(self, steps: list[tuple[Step, Path]]):
        self.lane = ThreadPoolExecutor(max_workers=1)
        self.running: Optional[subprocess.Popen] = None
        self.stopped, self.lock = False, threading.Lock()  # no step starts once stop() has begun
        self.results = {step.doc: self.lane.submit(self._run, step, cwd) for step, cwd in steps}

    def _run(self, step: Step, cwd: Path) -> tuple[int, str, str]:
        argv = shlex.split(step.run or step.doc) + shlex.split(step.toy)
        assert argv[0] == "nanopt" and not step.same, f"`{step.doc}` cannot run beside: a `nanopt` command only"
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            with self.lock:
                assert not self.stopped, "the walk ended first"
                self.running = subprocess.Popen(
                    [sys.executable, "-m", "nanopt.cli", *argv[1:]], stdout=out, stderr=err, text=True, cwd=cwd,
                    env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
                os.setpriority(os.PRIO_PROCESS, self.running.pid, 3)  # before it starts its runs, which inherit it
            code = self.running.wait(timeout=300)
            out.seek(0), err.seek(0)
            return code, out.read(), err.read()

    def result(self, step: Step) -> tuple[int, str, str]:
        return self.results[step.doc].result(timeout=600)

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
        self.lane.shutdown(wait=False, cancel_futures=True)
        if self.running is not None:
            self.running.kill()  # a no-op once it has exited; a sweep killed gives its runs SIGTERM
            self.running.wait()


@pytest.fixture(scope="module")
def beside_steps(request, tmp_path_factory, corpus_dir) -> Iterator[dict[str, tuple[Path, Beside]]]:
    """The `beside` steps of the pages to walk, started when the first page's walk starts, each page's in its
    directory, made now: page -> (its directory, the steps). The walk here trains on one core (runtime.threads=1),
    the sweeps' runs, processes anyway, on the second meanwhile."""
    pages = {item.callspec.params["name"] for item in request.session.items
             if item.path == request.path and item.originalname == "test_page_walk"}
    dirs = {name: clone_root(tmp_path_factory.mktemp("page")) for name, page in WALKS.items()
            if name in pages and any(step.beside and not step.skip for step in page.steps)}
    beside = Beside([(step, cwd) for name, cwd in dirs.items() for step in WALKS[name].steps if step.beside])
    yield {name: (cwd, beside) for name, cwd in dirs.items()}
    beside.stop()


def write_user_files(cwd: Path, names: tuple[str, ...]) -> None:
    for i, name in enumerate(names):
        (cwd / name).parent.mkdir(parents=True, exist_ok=True)
        docs = make_documents(n=160, seed=i)
        (cwd / name).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


# Steps that read nothing a page wrote before them run once in the module (every page's setup steps, and the profiled
# run of README.md and docs/profiling.md): a later page gets a copy of their runs as they were, and their output.
SHARED = {step.doc for page in WALKS.values() for step in page.setup} | {PROFILED.doc}
DONE: dict[str, tuple[Path, tuple[int, str, str]]] = {}  # a shared step -> a copy of its runs, its exit and output


def copy_runs(step: Step, cwd: Path) -> tuple[int, str, str]:
    store, result = DONE[step.doc]
    for run in step.summary:
        shutil.copytree(store / run, cwd / run, symlinks=True)
    return result


def set_up(step: Step, cwd: Path, factory, capfd, monkeypatch) -> None:
    if step.doc not in DONE:
        monkeypatch.chdir(store := clone_root(factory.mktemp("setup")))
        check(step, "a setup step", store, capfd, factory)
        monkeypatch.chdir(cwd)
    copy_runs(step, cwd)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, p in WALKS.items() if any(not s.skip for s in p.steps)])
def test_page_walk(name: str, page_dir: Path, capfd, monkeypatch, tmp_path_factory, beside_steps):
    page = WALKS[name]
    write_user_files(page_dir, page.user_files)
    for step in page.setup:
        set_up(step, page_dir, tmp_path_factory, capfd, monkeypatch)
    for step in page.steps:
        if not step.skip:
            check(step, name, page_dir, capfd, tmp_path_factory, beside_steps[name][1] if step.beside else None)
