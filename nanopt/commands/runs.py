"""`nanopt runs [DIR]`: the leaderboard of DIR/*/summary.json, fastest to target first."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from nanopt.errors import ConfigError


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _target(r: dict[str, Any]) -> str:
    """The run's target with its unit (runs may race to a loss or to bits per byte)."""
    if r.get("target_val_bpb") is not None:
        return f"{r['target_val_bpb']:.3f} bpb"
    return "-" if r.get("target_val_loss") is None else f"{r['target_val_loss']:.3f} nats"


def leaderboard(root: Path) -> list[dict[str, Any]]:
    """Every runs/*/summary.json, fastest to target first, then the rest by final validation loss."""
    rows = []
    for path in sorted(root.glob("*/summary.json")):
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        rows.append({**summary, "run": path.parent.name})  # the directory names the run
    reached = sorted((r for r in rows if r.get("train_seconds_to_target") is not None),
                     key=lambda r: (_target(r), r["train_seconds_to_target"]))
    rest = sorted((r for r in rows if r.get("train_seconds_to_target") is None),
                  key=lambda r: (r.get("final_val_loss") is None, r.get("final_val_loss") or 0))
    return reached + rest


def format_leaderboard(rows: list[dict[str, Any]]) -> str:
    header = ("run", "target", "to target (s)", "steps", "tokens", "final val", "val bpb", "test bpb",
              "train (s)", "tokens seen", "params", "hardware")
    table = [header]
    for r in rows:
        table.append((
            r["run"], _target(r), _fmt(r.get("train_seconds_to_target"), ".1f"),
            _fmt(r.get("step_to_target"), "d"), _fmt(r.get("tokens_to_target"), ","),
            _fmt(r.get("final_val_loss"), ".4f"), _fmt(r.get("final_val_bpb"), ".4f"), _fmt(r.get("test_bpb"), ".4f"),
            _fmt(r.get("train_seconds"), ".1f"), _fmt(r.get("tokens_seen"), ","), _fmt(r.get("params"), ","),
            f"{r.get('world_size', '?')}x {r.get('hardware') or r.get('device') or '?'}",
        ))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`nanopt runs [DIR]`: the leaderboard of DIR/*/summary.json (default runs/)."""
    p = argparse.ArgumentParser(prog="nanopt runs", description=(
        "Compare finished runs: time-to-target (training seconds, excluding eval/checkpoint/logging), final "
        "validation loss and bpb, tokens and parameters, from DIR/*/summary.json."))
    p.add_argument("dir", nargs="?", default="runs")
    args = p.parse_args(argv)
    root = Path(args.dir)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory; give the directory that holds the runs (default runs/).")
    rows = leaderboard(root)
    if not rows:
        print(f"no finished runs in {root} (a run writes summary.json when it ends)")
        return 0
    print(format_leaderboard(rows))
    return 0
