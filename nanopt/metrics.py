"""Where numbers go: one console line per logged step, metrics.jsonl, TensorBoard, optional W&B.

Only rank 0 builds a MetricsLogger; other ranks get a silent one.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("nanopt")


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null rather than emit an unparseable line."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True, wandb_cfg: Optional[dict] = None):
        self.enabled = enabled
        self.writer = None
        self.wandb = None
        self.file = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tb"))
        if wandb_cfg is not None:
            try:
                import wandb
            except ImportError:
                log.warning("log.wandb is on but the wandb package is not installed (pip install wandb); skipping W&B")
            else:
                # WANDB_MODE=offline is honoured by wandb itself.
                self.wandb = wandb.init(
                    project=wandb_cfg["project"], name=wandb_cfg["name"], config=wandb_cfg["config"],
                    dir=str(run_dir), resume="allow",
                )

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Append one record {step, time, **values} to every sink."""
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **{k: _clean(v) for k, v in values.items()}}
        self.file.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in values.items() if v is not None}, step=step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def step_line(step: int, max_steps: int, v: dict[str, Any]) -> str:
    """The human-scannable per-step line."""
    mfu = v.get("mfu")
    parts = [
        f"step {step:>6}/{max_steps}",
        f"loss {v['loss']:.4f}",
        f"lr {v['lr']:.2e}",
        f"{v['step_ms']:7.1f} ms/step",
        f"{v['tokens_per_s']:>9,.0f} tok/s",
        f"mfu {'  n/a' if mfu is None else f'{100 * mfu:4.1f}%'}",
        f"eta {format_duration(v.get('eta_s', 0.0))}",
    ]
    if v.get("peak_memory_gib") is not None:  # mfu.peak_memory_gib: None where the device cannot tell
        parts.insert(-1, f"mem {v['peak_memory_gib']:.2f} GiB")
    return " | ".join(parts)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({k: _clean(v) for k, v in data.items()}, indent=2) + "\n")
    os.replace(tmp, path)
