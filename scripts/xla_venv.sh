#!/usr/bin/env bash
# Builds, once, a separate venv with torch 2.9 + torch_xla 2.9 (+ nanopt from this checkout, no deps) for the XLA
# path, cached outside the repo and keyed by a hash of its requirements; prints the venv's path.
# Usage: scripts/xla_venv.sh            (NANOPT_CACHE moves the cache root; default ~/.cache/nanopt)
# torch_xla only runs beside the torch it was built against, and PyPI's torch 2.9 needs the nvidia-*
# runtime wheels to import even on CPU: expect ~7 GB and a few minutes the first time, seconds after.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
REQUIREMENTS=(
  "torch==2.9.*" "torch_xla==2.9.*"
  "numpy>=1.24" "pyyaml>=6" "safetensors>=0.4" "tensorboard>=2.14" "tqdm>=4.60" "pytest>=7"
)
PY_VERSION="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
KEY="$(printf '%s\n' "$PY_VERSION" "${REQUIREMENTS[@]}" | sha256sum | cut -c1-12)"
ROOT="${NANOPT_CACHE:-$HOME/.cache/nanopt}"
VENV="$ROOT/xla-venv-$KEY"
mkdir -p "$ROOT"

# nanopt itself comes from this checkout through a .pth file (what an editable install amounts to,
# without a build step); rewritten whenever the checkout moves, e.g. a fresh clone in CI.
link_repo() {
  local pth
  pth="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nanopt-checkout.pth"
  if [ "$(cat "$pth" 2>/dev/null)" != "$REPO" ]; then
    echo "$REPO" > "$pth"
  fi
}

# One builder at a time (parallel test sessions share the cache).
exec 9>"$ROOT/xla-venv-$KEY.lock"
flock 9

if [ ! -f "$VENV/.complete" ]; then
  echo "xla_venv: building $VENV (torch 2.9 + torch_xla 2.9; several GB, a few minutes)" >&2
  rm -rf "$VENV"   # a half-built venv from an interrupted run
  "$PYTHON" -m venv "$VENV"
  # The machine-wide pip constraint file (if any) still applies; torch 2.9 satisfies it.
  "$VENV/bin/python" -m pip install -q --progress-bar off "${REQUIREMENTS[@]}" >&2
  "$VENV/bin/python" -c 'import torch, torch_xla; print("xla_venv: torch", torch.__version__, "torch_xla", torch_xla.__version__)' >&2
  touch "$VENV/.complete"
fi
link_repo
echo "$VENV"
