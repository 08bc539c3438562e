"""Where numbers go: the console (logging, the step and summary lines), metrics.jsonl, TensorBoard, optional W&B;
and the peak memory they report. Only rank 0's MetricsLogger writes."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from nanopt.errors import ConfigError
from nanopt.io import append_bytes, finite, json_line, open_append, refuse_link, write_bytes
from nanopt.rundirs import METRICS_FILE, TB_DIR

log = logging.getLogger("nanopt")


class _CurrentStdout(logging.StreamHandler):
    """Writes to sys.stdout as it is at each record: callers that swap it would leave the handler on a closed one."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout  # under the handler's lock (Handler.handle)
        super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        """A stdout that takes no line (disk full, reader gone) is said once on stderr, not once per line."""
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            return super().handleError(record)  # a bad format: logging's block, which names the call
        if not getattr(self, "failed", False):
            self.failed = True
            sys.stderr.write(f"nanopt: console lines cannot be written to stdout ({error.strerror or error}); the "
                             f"run goes on, and its figures are still written to the run directory.\n")


def _not_printed_below(record: logging.LogRecord) -> bool:
    """False for a record a handler of its own logger's chain has printed already (huggingface_hub and datasets
    have their own stderr handler and still propagate: every hub retry line came out twice)."""
    logger: Optional[logging.Logger] = logging.getLogger(record.name)
    while logger is not None and logger.parent is not None:  # up to the root, whose handler this filter sits on
        if any(record.levelno >= h.level and not isinstance(h, logging.NullHandler) for h in logger.handlers):
            return False
        logger = logger.parent if logger.propagate else None
    return True


def setup_logging(is_main: bool) -> None:
    """INFO lines with a clock on rank 0, warnings only elsewhere (so N ranks do not print N copies)."""
    handler = _CurrentStdout()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    handler.addFilter(_not_printed_below)
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, handlers=[handler], force=True)


def format_duration(seconds: float) -> str:
    m, s = divmod(max(0, int(seconds)), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


class MetricsLogger:
    """Writes nothing until open(), which trims metrics.jsonl past the resumed step. Each record is one append on a
    descriptor that never follows a link; a full disk is DiskFull that leaves every earlier line whole."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True, wandb_cfg: Optional[dict] = None):
        self.run_dir, self.enabled, self.tensorboard, self.wandb_cfg = run_dir, enabled, tensorboard, wandb_cfg
        self.writer = self.wandb = None
        self.fd: Optional[int] = None
        self.path = Path(run_dir) / METRICS_FILE

    def open(self, resumed_step: int = 0) -> None:
        if not self.enabled:
            return
        if self.tensorboard and (tb := self.run_dir / TB_DIR).exists() and not tb.is_dir():  # else FileExistsError
            raise ConfigError(f"{tb} is a file, where TensorBoard writes its event files (a directory); move it "
                              f"aside, or set `log.tensorboard: false`.")
        self.trim(resumed_step)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.fd = open_append(self.path)
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.run_dir / TB_DIR))
        if self.wandb_cfg is not None:
            self.wandb = _wandb_run(self.run_dir, self.wandb_cfg)

    def trim(self, step: int) -> None:
        """Drop the records past `step`, which the resumed run logs again. A line that does not parse is kept,
        except a cut last line the next append would join."""
        refuse_link(self.path)  # else a user's file it points to would be read, and its lines copied into the run
        if not self.path.is_file():
            return
        lines = [line for line in self.path.read_bytes().splitlines() if line.strip()]
        write_bytes(self.path, b"".join(x + b"\n" for i, x in enumerate(lines, 1) if _kept(x, step, i == len(lines))))

    def log(self, step: int, values: dict[str, Any]) -> None:
        if self.fd is None:
            return
        append_bytes(self.fd, json_line({"step": step, "time": time.time(), **values}), self.path)
        if self.writer is not None:
            for k, v in values.items():
                if finite(v) is not None:
                    self.writer.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in values.items() if v is not None}, step=step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.fd = self.writer = self.wandb = None


def _kept(line: bytes, step: int, last: bool) -> bool:
    try:
        record = json.loads(line.decode("utf-8"))
    except ValueError:
        return not last
    record_step = record.get("step") if isinstance(record, dict) else None
    return not isinstance(record_step, int) or record_step <= step


def _wandb_run(run_dir: Path, wandb_cfg: dict) -> Any:
    try:
        import wandb
    except ImportError:
        log.warning("log.wandb is on but the wandb package is not installed (pip install wandb); skipping W&B")
        return None
    return wandb.init(project=wandb_cfg["project"], name=wandb_cfg["name"], config=wandb_cfg["config"],
                      dir=str(run_dir), resume="allow")


def _gib(ns: Optional[list[int]]) -> Optional[list[float]]:
    return None if ns is None else [n / 2**30 for n in ns]


def peak_memory(by_rank: tuple[Optional[list[int]], Optional[list[int]]]) -> dict[str, Any]:
    """The busiest rank's peak memory (allocated; reserved where the device caches) and which rank that is: under
    fsdp ranks differ, so rank 0 alone would not say whether any device is close to full."""
    allocated, reserved = map(_gib, by_rank)  # GiB by rank, None where the device cannot tell
    busiest = None if allocated is None else allocated.index(max(allocated))
    return {"peak_memory_gib": None if busiest is None else allocated[busiest], "peak_memory_rank": busiest,
            "peak_reserved_gib": None if reserved is None else max(reserved)}


def peak_memory_per_rank(by_rank: tuple[Optional[list[int]], Optional[list[int]]]) -> dict[str, Any]:
    return dict(zip(("peak_memory_gib_per_rank", "peak_reserved_gib_per_rank"), map(_gib, by_rank)))


def step_line(step: int, max_steps: int, v: dict[str, Any], basis: str = "", ranks: int = 1) -> str:
    """The per-step line; `basis` labels MFU ("bf16-equivalent" under FP8); with `ranks` > 1 it names the busiest."""
    mfu = v.get("mfu")
    mfu_text = "  n/a" if mfu is None else f"{100 * mfu:4.1f}%" + (f" {basis}" if basis else "")
    parts = [f"step {step:>6}/{max_steps}", f"loss {v['loss']:.4f}", f"lr {v['lr']:.2e}",
             f"{v['step_ms']:7.1f} ms/step", f"{v['tokens_per_s']:>9,.0f} tok/s", f"mfu {mfu_text}",
             f"eta {format_duration(v.get('eta_s', 0.0))}"]
    if v.get("peak_memory_gib") is not None:  # None where the device cannot tell
        # CUDA adds what the caching allocator reserved: that, not the allocated peak, is what runs out.
        reserved, memory = v.get("peak_reserved_gib"), f"mem {v['peak_memory_gib']:.2f} GiB"
        if ranks > 1 and v.get("peak_memory_rank") is not None:
            memory += f" @rank {v['peak_memory_rank']}"
        parts.insert(-1, memory + ("" if reserved is None else f" ({reserved:.2f} reserved)"))
    return " | ".join(parts)


def summary_line(s: dict[str, Any]) -> str:
    """A finished run's summary.json, as rundirs.finished read it (numbers or null), in one line."""
    target = (f"stopped at its target at step {s.get('step_to_target')}" if s.get("stopped_at_target") else
              s.get("target_reached") is False and "target not reached")
    parts = [f"{s.get('steps')} steps", s.get("tokens_seen") is not None and f"{s['tokens_seen']:,} tokens",
             s.get("train_seconds") is not None and f"{format_duration(s['train_seconds'])} of training",
             *(f"{k} {s[k]:.4f}" for k in ("final_val_loss", "final_val_bpb") if s.get(k) is not None), target]
    return "summary: " + ", ".join(p for p in parts if p)
