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

# C: akunu's decode matmuls (akunu/backends/cpu/_matvec.c); C++: MLX's CPU backend builds mx.compile kernels with g++.
if [ "$(uname -s)" = "Linux" ] && ! { command -v cc && command -v g++; } >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "Installing C and C++ compilers (akunu's decode matmuls and MLX's fused CPU kernels)..."
    (apt-get update -qq && apt-get install -y -qq gcc g++ libc6-dev) >/dev/null || echo "warning: no compilers; akunu runs without its decode matmuls and fused kernels"
  else
    echo "note: install gcc and g++ for faster CPU decoding (akunu's decode matmuls, MLX's fused kernels)"
  fi
fi

PYTHON="${PYTHON:-python3}"

# Python's headers: akunu's fused CPU kernels (akunu/backends/cpu/kernels.cpp) are built against them on first use.
if [ "$(uname -s)" = "Linux" ] && ! "$PYTHON" -c 'import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "Installing Python's headers (akunu's fused CPU kernels)..."
    (apt-get update -qq && apt-get install -y -qq python3-dev) >/dev/null || echo "warning: no Python headers; akunu runs without its fused CPU kernels"
  else
    echo "note: install python3-dev for akunu's fused CPU kernels (faster CPU decoding)"
  fi
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
echo "akunu is installed in .venv ($(.venv/bin/akunu --version 2>/dev/null || echo 'akunu'))"
# Compile akunu's CPU kernels now (a minute on a small machine), so a first run does not wait for the compiler.
.venv/bin/python -c 'import akunu.backends as b; print("CPU backend:", b.describe())' || echo "warning: akunu's CPU kernels did not build; akunu runs without them"
