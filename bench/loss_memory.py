"""Peak host memory of the loss path: full logits vs nanopt's chunked cross-entropy (Llama._chunked_loss).

Each measurement runs in a fresh subprocess and reports the growth of peak RSS (ru_maxrss) over the
process's RSS just before the loss, for forward + backward of the loss over N tokens of hidden states.
It is a benchmark, not a test.

    python bench/loss_memory.py [--tokens 2048] [--vocab 32768 128256]
    python bench/loss_memory.py --tokens 64 --vocab 512 --chunk 16 --dim 32     # what the test suite runs
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
from typing import Optional

import _common as C  # importing _common puts REPO on sys.path: nanopt from this checkout
import torch

from nanopt.config import ModelConfig  # noqa: E402
from nanopt.recipe.model import build_model  # noqa: E402


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(vocab: int, tokens: int, chunk: int, dim: int) -> dict:
    """In this process: peak RSS growth (bytes) of loss forward + backward. chunk=0 -> one full-logits pass."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=vocab, dim=dim, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=2 * dim,
                                    max_seq_len=tokens))
    model.loss_chunk_tokens = chunk or tokens  # a single chunk takes the plain, full-logits path
    h = torch.randn(1, tokens, dim, requires_grad=True)  # 1 N C: the final hidden states
    targets = torch.randint(0, vocab, (1, tokens))
    # Warm-up on a few tokens so allocator/library setup is not counted, then the baseline.
    model._chunked_loss(h[:, :8], targets[:, :8]).backward()
    model.zero_grad(set_to_none=False)
    before = _rss_bytes()
    loss = model._chunked_loss(h, targets)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"vocab": vocab, "tokens": tokens, "chunk": chunk, "peak_growth_bytes": peak - before,
            "loss": float(loss.detach()), "grad_norm": float(h.grad.norm())}


def child(vocab: int, tokens: int, chunk: int, dim: int) -> subprocess.Popen:
    """One measurement in a fresh process (its peak RSS is its own), started now: a vocabulary's two run side by
    side, since a process's peak memory does not depend on its neighbour's."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(vocab), str(tokens), str(chunk), str(dim)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def result(proc: subprocess.Popen) -> dict:
    """A child's measurement; a child that failed stops the bench (its traceback is above, on stderr)."""
    out, _ = proc.communicate()
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(proc.args)}")
    return json.loads(out.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> None:
    ap = C.parser(__file__, __doc__)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 128256])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        torch.set_num_threads(1)
        print(json.dumps(measure(*args.child)))
        return
    print(f"command: {C.command(__file__, argv)}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, {C.cpu_model()}, {os.cpu_count()} cores, "
          "1 thread per measurement (two side by side), fp32")
    print(f"{'vocab':>7} {'tokens':>6} {'full logits MB':>15} {'chunk':>6} {'full MB':>8} {'chunked MB':>10} "
          f"{'saved':>6}  loss/grad agree", flush=True)
    for vocab in args.vocab:
        procs = {chunk: child(vocab, args.tokens, chunk, args.dim) for chunk in (0, args.chunk)}
        rows = {chunk: result(proc) for chunk, proc in procs.items()}
        full, chunked = rows[0]["peak_growth_bytes"] / 2**20, rows[args.chunk]["peak_growth_bytes"] / 2**20
        agree = (abs(rows[0]["loss"] - rows[args.chunk]["loss"]) < 1e-4
                 and abs(rows[0]["grad_norm"] - rows[args.chunk]["grad_norm"]) < 1e-4 * rows[0]["grad_norm"])
        logits_mb = args.tokens * vocab * 4 / 2**20
        print(f"{vocab:>7} {args.tokens:>6} {logits_mb:>15.0f} {args.chunk:>6} {full:>8.0f} {chunked:>10.0f} "
              f"{full / max(chunked, 1):>5.1f}x  {agree}", flush=True)


if __name__ == "__main__":
    main()
