"""How fast a checkpoint reaches the disk, and how large a state fits in a preemption's grace period.

Four ways to write the same state (fp32 weights + AdamW moments, `--gib` GiB in all), alternately, medians:
  nanopt        checkpoint.save_resumable: DCP's shards of weights and moments, then the whole weights for
                readers; each file fsynced and its crc32 re-read from the page cache
  write+reread  the previous save: write and fsync every file, then read each back for its crc32, in turn
  crc-in-write  crc32 summed as the bytes go through a Python file object (no re-read), each file fsynced
  bytes only    the same files written and fsynced with no checksum at all: the disk's floor
It is a benchmark, not a test. The directory (`--dir`, default runs/.bench_checkpoint) must be on the disk
checkpoints go to: a tmpfs would measure memory, not the disk.

  python bench/checkpoint_save.py [--gib 2] [--repeats 5] [--dir DIR] [--grace 25]
"""
from __future__ import annotations

import os
import shutil
import sys
import zlib
from pathlib import Path
from typing import Optional

import safetensors.torch
import torch
from safetensors.torch import save_file

from _common import REPO, alternate, banner, command, median, parser, spread
from nanopt.distributed.runtime import Runtime
from nanopt.io import fsync, write_json
from nanopt.training import checkpoint

ONE_PROCESS = Runtime("cpu", torch.device("cpu"), 0, 0, 1, 1, "fp32")


def build_state(gib: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of `gib` / 3 GiB of fp32 weights and an AdamW whose two moments make up the rest."""
    n = int(gib * 2**30 / 4 / 3)
    side = 4096
    model = torch.nn.Module()
    rows = max(1, n // side)
    model.w = torch.nn.Parameter(torch.randn(rows, side))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.w.grad = torch.randn_like(model.w)
    opt.step()  # creates exp_avg and exp_avg_sq
    return model, opt


def previous_save(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, checksum: bool) -> None:
    """The save before crc32-while-writing: write, fsync, then (checksum) read every file back."""
    tmp = root / ".tmp_step_000001"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({"w": model.w.detach()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    torch.save(opt.state_dict(), tmp / "optimizer.pt")
    files = {}
    for f in sorted(tmp.iterdir()):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        files[f.name] = {"bytes": f.stat().st_size, "crc32": checkpoint.crc32_of(f) if checksum else 0}
    write_json(tmp / "COMPLETE", {"files": files})
    fsync(tmp)
    shutil.rmtree(tmp)


class _CrcFile:
    def __init__(self, f):
        self.f, self.crc = f, 0

    def write(self, chunk) -> int:
        self.crc = zlib.crc32(chunk, self.crc)
        return self.f.write(chunk)

    def flush(self) -> None:
        self.f.flush()


def crc_in_write_save(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """crc32 while writing: safetensors to bytes, torch.save through a file object; no re-read."""
    tmp = root / ".tmp_step_000001"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {}
    for name, write in (("model.safetensors", lambda f: f.write(safetensors.torch.save({"w": model.w.detach()}))),
                        ("optimizer.pt", lambda f: torch.save(opt.state_dict(), f))):
        with open(tmp / name, "wb") as raw:
            out = _CrcFile(raw)
            write(out)
            raw.flush()
            os.fsync(raw.fileno())
        files[name] = {"crc32": out.crc}
    write_json(tmp / "COMPLETE", {"files": files})
    fsync(tmp)
    shutil.rmtree(tmp)


def main(argv: Optional[list[str]] = None) -> int:
    ap = parser(__file__, __doc__)
    ap.add_argument("--gib", type=float, default=2.0, help="total state size (weights + AdamW moments)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=REPO / "runs" / ".bench_checkpoint")
    ap.add_argument("--grace", type=float, default=25.0, help="seconds a preemption leaves for the save")
    args = ap.parse_args(argv)
    model, opt = build_state(args.gib)
    root = args.dir
    root.mkdir(parents=True, exist_ok=True)
    banner("checkpoint save throughput", {"dir": f"{root} ({os.statvfs(root).f_bsize} B blocks)",
                                          "state": f"{args.gib:g} GiB"}, command(__file__, argv))

    def nanopt_save() -> None:
        final = checkpoint.save_resumable(root / "nanopt", 1, model, opt, {"config": {}}, 1, ONE_PROCESS)
        shutil.rmtree(final.parent)

    fns = {"nanopt": nanopt_save,
           "write+reread": lambda: previous_save(root / "prev", model, opt, checksum=True),
           "crc-in-write": lambda: crc_in_write_save(root / "crcw", model, opt),
           "bytes only": lambda: previous_save(root / "bytes", model, opt, checksum=False)}
    times = alternate(fns, args.repeats)
    size = sum(p.numel() * 4 for p in model.parameters()) + sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    print(f"| save | median s | spread | GB/s | fits in {args.grace:g} s |")
    print("| --- | --- | --- | --- | --- |")
    for name, ts in times.items():
        rate = size / median(ts) / 1e9
        print(f"| {name} | {median(ts):.2f} | {spread(ts)} | {rate:.2f} | {rate * args.grace:.0f} GB |")
    base = median(times["write+reread"])
    print(f"\nnanopt / write+reread = {median(times['nanopt']) / base:.2f}x time; "
          f"bytes only / write+reread = {median(times['bytes only']) / base:.2f}x")
    # untimed: what was measured
    saved = checkpoint.save_resumable(root / "nanopt", 1, model, opt, {"config": {}}, 1, ONE_PROCESS)
    problem = checkpoint.verify_checkpoint(saved)  # a checkpoint a resume accepts, or why not
    print(f"nanopt's checkpoint verifies (sizes, crc32s, step): {'yes' if problem is None else 'NO: ' + problem}")
    shutil.rmtree(root, ignore_errors=True)
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())
