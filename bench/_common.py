"""Shared bench helpers: the environment banner, alternating timing, matmul peak, FLOPs per token.

Benches are not tests. Every number they print is a median of several repeats measured alternately
in one process after warm-up, so that a noisy, shared machine slows every contender equally.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import queue
import shlex
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NoReturn, Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python bench/x.py` from a checkout, no install needed
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


# nanoGPT's documented CPU shape (4 layers, 4 heads, dim 128, block 64, batch 12) as nanopt overrides: a Llama with
# MHA and a SwiGLU of 3 x 128 x 344 weights ~ nanoGPT's 2 x 128 x 512 MLP. Used by vs_nanogpt.py and omp_policy.py.
NANOGPT_SHAPE = ["--model.dim=128", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=4",
                 "--model.ffn_dim=344", "--train.seq_len=64", "--train.micro_batch_size=12",
                 "--train.global_batch_tokens=768"]
# A recipe's --smoke size (bench/ablation.py, bench/averaging.py): one narrow layer, two-row batches, one thread.
TOY_RECIPE = ["--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.n_kv_heads=2", "--model.ffn_dim=64",
              "--train.micro_batch_size=2", "--train.global_batch_tokens=128", "--runtime.threads=1",
              "--train.warmup_steps=1"]

def cpu_model() -> str:
    """The CPU as nanopt's runtime names it: model, best matmul ISA, native or emulated bf16, torch's kernels."""
    from nanopt.distributed.runtime import CpuBackend

    return CpuBackend(torch.device("cpu")).hardware_name()


def cpu_flags() -> str:
    """The matmul-relevant ISA flags, because they decide which precision is fast on CPU."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in have)
    except OSError:
        pass
    return "?"


SMOKE_HELP = "toy sizes: checks that the bench runs, measures nothing (the test suite runs it)"


def parser(script: str, doc: str) -> argparse.ArgumentParser:
    """A bench's argument parser, named as it is run (`bench/NAME.py`) whether from a shell or a test; its --help
    shows the bench's docstring as written (what it measures, how, and example commands)."""
    return argparse.ArgumentParser(prog=f"bench/{Path(script).name}", description=doc.strip(),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def command(script: str, argv: Optional[list[str]]) -> str:
    """The command line that reproduces this bench: `python bench/NAME.py ARGS`, with the arguments it was given
    (argv from a test calling main(argv) in-process, else the shell's)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(shlex.quote(a) for a in ["python", f"bench/{Path(script).name}", *args])


def bad_input(script: str, message: str) -> NoReturn:
    """Bad arguments: one paragraph on stderr naming what and the fix, exit 2 (as nanopt's own commands do)."""
    print(f"bench/{Path(script).name}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_overrides(script: str, config: str, table: dict[str, list[str]], common: list[str]) -> None:
    """Every variant's overrides (after `common`) load on the config, the keys existing and the values fitting,
    before any run: a misspelt key is exit 2 at once, not an hour in."""
    from nanopt.config import load_config, parse_overrides
    from nanopt.errors import ConfigError

    for name, overrides in table.items():
        try:
            load_config(config, parse_overrides([*common, *overrides]))
        except ConfigError as e:
            bad_input(script, f"variant {name!r} ({' '.join(overrides) or 'no overrides'}) does not load on "
                      f"{config}: {e}")


def progress(message: str) -> None:
    """A progress line on stderr, at once: the table on stdout stays clean, and a long bench is never silent."""
    print(message, file=sys.stderr, flush=True)


def banner(title: str, extra: Optional[dict] = None, cmd: Optional[str] = None) -> None:
    """Print the exact command (`command(__file__, argv)`; default the shell's) and the environment this bench ran
    with, flushed: a bench's output is often piped, and its first lines must not wait for its last."""
    cmd = cmd or " ".join(shlex.quote(a) for a in ["python", *sys.argv])
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
           if k in os.environ}
    print(f"# {title}")
    print(f"command : {cmd}")
    print(f"date    : {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    print(f"torch   : {torch.__version__} | python {platform.python_version()} | threads {torch.get_num_threads()}"
          f" | env {env or '{}'}")
    if torch.cuda.is_available():
        print(f"device  : {torch.cuda.get_device_name()}")
    print(f"cpu     : {cpu_model()} x{os.cpu_count()} | {cpu_flags()} | load avg {os.getloadavg()[0]:.2f}")
    for k, v in (extra or {}).items():
        print(f"{k:8s}: {v}")
    print(flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
              device: torch.device = torch.device("cpu")) -> dict[str, list[float]]:
    """Seconds per call of each fn, measured round-robin (rotating the order each round) after warm-up."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
            sync(device)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            sync(device)
            t0 = time.perf_counter()
            fns[name]()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> str:
    """Relative half-range of the middle of the repeats: how much to trust the median."""
    if len(xs) < 3:
        return "n/a"
    s = sorted(xs)
    lo, hi = s[len(s) // 4], s[-1 - len(s) // 4]
    return f"±{50 * (hi - lo) / statistics.median(xs):.0f}%"


def peak_flops(dtype: torch.dtype, device: torch.device = torch.device("cpu"), budget_s: float = 0.5,
               n: Optional[int] = None) -> float:
    """Best FLOP/s of a fixed n² matmul (default 2048², 8192² on GPU) seen in about budget_s.

    Benches call this inside their alternating rounds, so the peak sees the same contention as the
    model; a larger size than the training loop's start-up measurement, since benches can afford it.
    """
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, dtype=dtype, device=device)
    out = a @ a  # warm-up: allocation, kernel selection
    best, start = 0.0, time.perf_counter()
    while True:
        sync(device)
        t0 = time.perf_counter()
        torch.matmul(a, a, out=out)
        sync(device)
        best = max(best, 2.0 * n**3 / (time.perf_counter() - t0))
        if time.perf_counter() - start > budget_s:
            return best


def spec_peak(device: torch.device, precision: str) -> Optional[float]:
    """The dense spec-sheet peak of a GPU nanopt.distributed.hardware knows (as training reports MFU), else None (CPU or
    unknown)."""
    if device.type != "cuda":
        return None
    from nanopt.distributed.hardware import detect_hardware, table_peak
    from nanopt.distributed.runtime import Runtime

    rt = Runtime("cuda", device, 0, 0, 1, 1, precision)
    key = detect_hardware(rt.hardware_name(), rt.backend.power_limit_watts())
    return None if key is None else table_peak(key, precision)


def add_shape_args(p, dim: int, ffn: int, vocab: int) -> None:
    """The model-shape flags every training bench takes (the defaults differ per bench)."""
    p.add_argument("--dim", type=int, default=dim)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=ffn)
    p.add_argument("--vocab", type=int, default=vocab)
    p.add_argument("--seq", type=int, default=256)


def model_config(a, **extra):
    """nanopt's ModelConfig for the shape flags of add_shape_args."""
    from nanopt.config import ModelConfig

    return ModelConfig(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.kv_heads,
                       ffn_dim=a.ffn, max_seq_len=a.seq, **extra)


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token exactly as the training loop counts them (nanopt.recipe.mfu): 6N + attention.

    6 = 2 (multiply + add) × 3 (forward, backward for activations, backward for weights); N includes
    the LM head even when tied (a real matmul; the embedding lookup is not). Attention counts only the
    unmasked causal half of the score/value matmuls, 6·L·T·D.
    """
    from nanopt.recipe.mfu import meta_model, token_flops

    return float(token_flops(meta_model(cfg), seq_len).model)


def make_step(model: torch.nn.Module, loss_fn, precision: str, device: torch.device):
    """The same step for both models: autocast forward, backward, clip 1.0, fused AdamW, zero_grad."""
    from nanopt.config import TrainConfig
    from nanopt.distributed.runtime import Runtime
    from nanopt.recipe.optim import build_optimizer

    rt = Runtime(device.type, device, 0, 0, 1, 1, precision)  # one process on `device`
    opt = build_optimizer(model, TrainConfig(lr=1e-4, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8), rt)

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, world: int, ports: "mp.Queue") -> dist.TCPStore:
    """A spawned rank's gloo process group, made before nanopt's runtime.init (which then finds it), over a store
    rank 0 binds to a port the kernel picks and hands the other ranks through `ports`. A port picked beforehand
    (free_port) can be taken by another process before rank 0 binds it: with benches and tests side by side, a rank
    then failed with "connection reset by peer". The store is returned for the bench's own blocking waits."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    timeout = datetime.timedelta(minutes=30)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
        for _ in range(world - 1):
            ports.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", ports.get(timeout=600), world, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return store

def spawn_ranks(worker: Callable, world: int, args: tuple, what: str) -> object:
    """`world` spawned processes running worker(rank, world, ports, *args, out), `ports` for join_group; the first
    result one of them puts on `out` (rank 0's, by convention). A worker that dies fails the bench instead of leaving
    it waiting forever."""
    ctx = mp.get_context("spawn")
    out, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, ports, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    while True:
        try:
            result = out.get(timeout=5)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit(f"a worker process failed ({what}); its traceback is above")
    for p in procs:
        p.join()
    return result
