#!/usr/bin/env bash
# Set up akunu in ./.venv: OpenBLAS where apt can install it (Linux), then the package and test tools.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = "Linux" ] && ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "Installing OpenBLAS (MLX's CPU matmuls are ~40x faster with it)..."
    (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread) >/dev/null || echo "warning: OpenBLAS install failed; continuing with MLX's reference BLAS"
  else
    echo "note: install libopenblas0-pthread (as root) for ~40x faster CPU matmuls"
  fi
fi

if [ "$(uname -s)" = "Linux" ] && ! command -v cc >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "Installing a C compiler (akunu builds its decode matmuls: faster CPU decoding)..."
    (apt-get update -qq && apt-get install -y -qq gcc libc6-dev) >/dev/null || echo "warning: no C compiler; akunu runs without its decode matmuls"
  else
    echo "note: install gcc for akunu's decode matmuls (faster CPU decoding)"
  fi
fi

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
echo "akunu is installed in .venv ($(.venv/bin/akunu --version 2>/dev/null || echo 'akunu'))"
