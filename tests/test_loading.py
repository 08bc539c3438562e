"""`from nanopt import load_model` (nanopt/loading.py): `import nanopt` loads no torch, and load_model is lazy."""
from __future__ import annotations

from pathlib import Path


def test_import_nanopt_is_light_and_load_model_is_lazy():
    import subprocess
    import sys

    code = "import sys, nanopt; assert 'torch' not in sys.modules and 'load_model' in nanopt.__all__"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent).returncode == 0
