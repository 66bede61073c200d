#!/usr/bin/env bash
# Wheels that a lent GPU machine, which has no network, installs from the working tree: run this here (with
# network) before the session, and pass `bench/wheels` in the device tool's `carry` (bench/wheels/ is ignored by
# git: wheels are never committed).
#   liger-kernel, for `triton_kernels.py --liger` (Liger-Kernel's Multi-Token Attention beside the
#   evolution step). A pure-Python wheel (py3-none-any); 0.8.5 asks only for torch >= 2.1.2 and triton >= 2.3.1,
#   so it is installed with --no-deps and the machine's own torch and triton stay.
# On the GPU machine:
#   python3 -m pip install --no-deps --no-index --target /tmp/liger bench/wheels/liger_kernel-*.whl
#   PYTHONPATH=$PWD:/tmp/liger python3 bench/benchmarks/triton_kernels.py --liger --dtypes bf16 --cases 512:8
set -euo pipefail
LIGER_KERNEL_VERSION=${LIGER_KERNEL_VERSION:-0.8.5}
PYTHON=${PYTHON:-python3}
WHEELS="$(cd "$(dirname "$0")/.." && pwd)/wheels"  # bench/wheels, which the device call carries
mkdir -p "$WHEELS"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$WHEELS" "liger-kernel==$LIGER_KERNEL_VERSION"
ls -l "$WHEELS"
