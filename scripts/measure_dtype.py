"""Decode speed of a GGUF model with quantized vs float32 weights (feeds the dtype policy).

Usage: python scripts/measure_dtype.py MODEL.gguf [--tokens 64] [--dtype quantized float32]
Run it again with AKUNU_BLAS=none to measure without the OpenBLAS preload.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import akunu  # noqa: F401  (preloads OpenBLAS before MLX)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from akunu import _blas
from akunu.models.gguf_file import read_gguf
from akunu.models.gguf_model import load_gguf_model

WARMUP_TOKENS = 8


def measure(path: Path, dtype: str, tokens: int) -> dict:
    started = time.perf_counter()
    model, _ = load_gguf_model(read_gguf(path), quantized=dtype == "quantized")
    load_seconds = time.perf_counter() - started
    cache = make_prompt_cache(model)
    prompt = mx.array(list(range(100, 132)))[None]  # timing only: any 32 in-vocabulary ids
    token = mx.argmax(model(prompt, cache=cache)[0, -1]).item()
    step_seconds = []
    for _ in range(WARMUP_TOKENS + tokens):
        step_start = time.perf_counter()
        token = mx.argmax(model(mx.array([[token]]), cache=cache)[0, -1]).item()
        step_seconds.append(time.perf_counter() - step_start)
    decode = step_seconds[WARMUP_TOKENS:]
    ms_per_token = 1000 * statistics.mean(decode)
    return {
        "model": path.name, "dtype": dtype, "blas": _blas.loaded_path or "reference",
        "load_s": round(load_seconds, 2), "ms_per_token": round(ms_per_token, 1),
        "median_ms": round(1000 * statistics.median(decode), 1), "tok_per_s": round(1000 / ms_per_token, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", nargs="+", default=["quantized", "float32"])
    args = parser.parse_args()
    for dtype in args.dtype:
        print(json.dumps(measure(args.model, dtype, args.tokens)), flush=True)


if __name__ == "__main__":
    main()
