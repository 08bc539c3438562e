"""Print pip constraints that pin every `>=` floor of pyproject.toml's dependencies (and those of pytest and
transformers, whose APIs the tests use) to the floor itself, so CI runs the quick tests against the oldest
versions a user's `pip install` may give.

Usage: python scripts/floors.py > floors.txt; pip install -c floors.txt "torch==2.13.0" -e ".[dev]"
torch is left out: its floor (2.9) is what the XLA tests' venv runs, and a CPU-only 2.9 wheel is not at hand here.
The dev extra's other tools (datasets, modal, ...) get what pip gives beside those floors.
"""
import re
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
dev = [r for r in project["optional-dependencies"]["dev"] if r.split(">=")[0] in ("pytest", "transformers")]
for requirement in project["dependencies"] + dev:
    name, floor = re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)>=([0-9.]+)", requirement.split(";")[0].strip()).groups()
    name = name.split("[")[0]  # torch-tb-profiler[...] -> the distribution's name
    if name != "torch":
        print(f"{name}=={floor}")
