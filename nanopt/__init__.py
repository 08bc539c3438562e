"""nanopt: a small, fast, honest LLM pretraining speedrun. `from nanopt import load_model` loads a trained model."""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Lazy: `import nanopt` stays free of torch until the model loader is actually used.
    if name == "load_model":
        from nanopt.loading import load_model

        return load_model
    raise AttributeError(f"module 'nanopt' has no attribute {name!r}")


__all__ = ["load_model"]
