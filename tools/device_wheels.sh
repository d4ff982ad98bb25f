#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, for tools/device_check.py (README, "CPU and GPU").
# That machine has PyTorch, numba, PyYAML, transformers and the rest of our needs, but no
# megatron-core and no network; its Python is 3.12 on x86-64. This downloads the pinned
# megatron-core wheel for it into .whl/ (git-ignored), which the device call carries.
set -eo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MCORE_SPEC=${MCORE_SPEC:-megatron-core==$(sed -n 's/.*"megatron-core==\([0-9.]*\)".*/\1/p' pyproject.toml)}
DEVICE_PYTHON=${DEVICE_PYTHON:-3.12}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
mkdir -p .whl
echo "[device_wheels] $MCORE_SPEC for CPython $DEVICE_PYTHON x86-64 into .whl/"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON" --implementation cp \
  "${platforms[@]}" -d .whl "$MCORE_SPEC"
ls -l .whl
