"""Plain decode speed with quantized vs float32 weights, akunu's loop beside mlx-lm's, in one process.

    .venv/bin/python scripts/measure_dtype.py [--model smollm2-135m] [--tokens 64] [--rounds 3]
    AKUNU_BLAS=none .venv/bin/python scripts/measure_dtype.py     # the same without OpenBLAS

For each dtype the model is loaded once; then akunu's plain decoding (no speculation) and
mlx-lm's `stream_generate` run on the same loaded model, alternating, and the median decode
tok/s of each is printed as one JSON line. These numbers feed the `--dtype auto` policy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import akunu  # noqa: F401  (preloads OpenBLAS before MLX)

# isort: split
from akunu import backends
from akunu.bench import Prompt
from akunu.bench.engine import ModelEngine
from akunu.models import load_model

PROMPT = "Write a Python function that returns the fibonacci numbers up to n."


def measure(name: str, dtype: str, tokens: int, rounds: int) -> dict:
    started = time.perf_counter()
    loaded = load_model(name, dtype=dtype)
    load_seconds = time.perf_counter() - started
    # Greedy; the token budget is the stop, so both loops decode the same number of tokens.
    engine = ModelEngine(loaded.model, loaded.tokenizer, max_tokens=tokens, context_length=loaded.context_length)
    ids = engine.encode(Prompt("fibonacci", "chat", PROMPT))
    speeds: dict[str, list[float]] = {"akunu": [], "mlx-lm": []}
    for method in ("plain", "mlx-lm"):  # warm-up
        engine.run(method, ids)
    for i in range(rounds):
        for method in ("plain", "mlx-lm") if i % 2 == 0 else ("mlx-lm", "plain"):
            run = engine.run(method, ids)
            speeds["akunu" if method == "plain" else "mlx-lm"].append(run.decode_tps)
    return {
        "model": name, "dtype": loaded.dtype, "blas": backends.describe()["blas"], "load_s": round(load_seconds, 2),
        **{f"{who}_tok_per_s": round(statistics.median(values), 2) for who, values in speeds.items()},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", nargs="+", default=["quantized", "float32"])
    args = parser.parse_args()
    for dtype in args.dtype:
        print(json.dumps(measure(args.model, dtype, args.tokens, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
