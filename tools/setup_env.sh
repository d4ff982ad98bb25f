#!/usr/bin/env bash
# Create (or reuse) .venv and install the project with its test extras.
# torch is installed first and pinned to the local CPU wheel: a looser spec would pull
# several GB of CUDA packages. On a GPU machine set TORCH_SPEC to what the machine needs.
set -eo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import megatron.core, torch, megatron_patches, hypothesis" 2>/dev/null; then
  echo "[setup] installing $TORCH_SPEC, megatron-core==0.16.1 and the project into .venv"
  .venv/bin/pip install -q "$TORCH_SPEC"
  .venv/bin/pip install -q -e ".[test]"
fi
