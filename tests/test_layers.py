"""The package is a stack (DESIGN.md "Layers"): every module imports only from layers below its own, at module
level. A function-local `import nanopt...` is how an import circle hides, so there are none; the only lazy
import of a nanopt module is the package's `load_model` (it keeps `import nanopt` free of torch)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nanopt"

# Lowest first. A module may import any module of a lower layer, none of its own or a higher one.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),                                          # exit codes and error types
    ("io", "fastbpe", "hub"),                             # atomic files, the cache directory; BPE engine; the hub
    ("hardware", "schema"),                               # peak table, detection, CPU peak; THE reader of own files
    ("config", "tokenizer", "rundirs"),                   # typed config; tokenizers; reading run directories
    ("plan",),                                            # the stage plan: steps, batch, seq_len, tokens per stage
    ("xla", "plots", "runs", "shards", "lock"),           # XLA; pictures; many runs; shards; the lease
    ("runtime",),                                         # THE device module
    ("attention", "optim"),                               # kernels and optimizers, each with what the device offers
    ("model", "loader", "packing", "faults", "metrics"),
    ("mfu", "parallel"),                                  # FLOPs from the model's modules, MFU; DDP / FSDP2
    ("fp8", "memory", "profiling", "validation", "generate", "hf", "taskgen", "ema"),
    ("checkpoint", "scoring"),                            # the format; THE continuation scorer
    ("loading", "core_benchmark", "averaging"),           # a model from a run; CORE; checkpoints averaged
    ("tasks",),                                           # the tasks wing: scoring a model, lm-eval's adapter
    ("train", "prepare", "sweep", "compare", "checkpoint_eval", "scaling"),  # the logic that commands call
    ("commands",),                                        # nanopt/commands/*: one module per subcommand
    ("cli",),
    ("main",),
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
ALLOWED_LAZY = {("__init__", "nanopt.loading")}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    # A module is named by its file, whichever folder holds it (names are unique across the folders).
    return "commands" if rel.parts[0] == "commands" else rel.parts[-1]


def _imported(node: ast.AST) -> list[str]:
    """nanopt modules an import statement names (`from nanopt import a, b` names nanopt.a and nanopt.b)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "nanopt"]
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nanopt":
        if node.module == "nanopt" or (PACKAGE / node.module.split(".", 1)[1].replace(".", "/")).is_dir():
            return [f"{node.module}.{a.name}" for a in node.names]  # modules of the package or of a folder
        return [node.module]
    return []


def _target_layer(dotted: str) -> tuple[str, int | None]:
    parts = dotted.split(".")[1:]
    name = "commands" if parts and parts[0] == "commands" else (parts[-1] if parts else "__init__")
    return name, LAYER.get(name)


def violations() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            for dotted in _imported(node):
                where = f"nanopt/{path.relative_to(PACKAGE)}:{node.lineno}"
                target, layer = _target_layer(dotted)
                if id(node) not in top_level:
                    if (me, dotted) not in ALLOWED_LAZY:
                        out.append(f"{where}: function-local import of {dotted}; import it at module level "
                                   f"(lazy imports are for optional third-party packages only)")
                    continue
                if me == "__init__":
                    out.append(f"{where}: the package __init__ imports {dotted} eagerly; `import nanopt` must stay light")
                elif me not in LAYER or layer is None:
                    out.append(f"{where}: {me if me not in LAYER else target} is not in the layer map "
                               f"(tests/test_layers.py LAYERS); give it a layer")
                elif layer >= LAYER[me]:
                    rule = "its own layer" if layer == LAYER[me] else "a higher layer"
                    out.append(f"{where}: {me} (layer {LAYER[me]}) imports {target} (layer {layer}), which is "
                               f"{rule}; a module imports only from layers below it")
    return out


def test_every_module_imports_only_from_layers_below_it():
    found = violations()
    assert not found, "layer rule broken:\n" + "\n".join(found)


def test_every_module_has_a_layer():
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert modules <= set(LAYER), f"modules with no layer: {sorted(modules - set(LAYER))}"


def test_the_check_finds_an_upward_and_a_hidden_import(tmp_path, monkeypatch):
    """The checker itself: a config module importing train, and a function-local import, are both reported."""
    fake = tmp_path / "nanopt"
    fake.mkdir()
    (fake / "config.py").write_text("from nanopt.training.train import train\n")
    (fake / "model.py").write_text("def f():\n    from nanopt import data\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    found = violations()
    assert any("nanopt/config.py:1" in v and "higher layer" in v for v in found), found
    assert any("nanopt/model.py:2" in v and "function-local" in v for v in found), found


@pytest.mark.parametrize("module", ["nanopt", "nanopt.config", "nanopt.training.plan", "nanopt.distributed.hardware",
                                    "nanopt.cli", "nanopt.main"])
def test_light_modules_do_not_load_torch(module):
    """Layers 0-4 and the dispatcher stay torch-free (Modal's config check; `nanopt estimate` counts a meta-device
    model, so it loads torch)."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
