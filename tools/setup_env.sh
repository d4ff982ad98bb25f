#!/usr/bin/env bash
# Create (or reuse) .venv and install the project with its test extras.
# torch is installed first and pinned to the local CPU wheel: a looser spec would pull
# several GB of CUDA packages. On a GPU machine set TORCH_SPEC to what the machine needs.
# Progress: a line per step and per 10 packages pip collects (a fresh machine takes 2-4 minutes).
set -eo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

# pip's output, condensed: every 10th "Collecting" and the final "Successfully installed" line
pip_progress() {
  awk '/^Collecting/ {n++; if (n % 10 == 0) {printf "[setup]   %d packages collected\n", n; fflush()}}
       /^Successfully installed/ {printf "[setup]   %s\n", substr($0, 1, 160); fflush()}'
}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import megatron.core, torch, megatron_patches, hypothesis" 2>/dev/null; then
  started=$SECONDS
  echo "[setup] 1/2 installing $TORCH_SPEC into .venv"
  .venv/bin/pip install --progress-bar off "$TORCH_SPEC" | pip_progress
  echo "[setup] 2/2 installing megatron-core==0.16.1, the project and its test extras (pyproject.toml)"
  .venv/bin/pip install --progress-bar off -e ".[test]" | pip_progress
  echo "[setup] done in $((SECONDS - started)) s; use it with: source .venv/bin/activate"
fi
