"""A GGUF model's logits held quantized (akunu's CPU kernel) against the same file dequantized to float32.

    .venv/bin/python scripts/quantized_vs_float32.py [--model /work/models/qwen2.5-coder-0.5b-instruct.gguf]

The quantized weights are llama.cpp's values exactly (models/ggml_blocks.py), so the two differ only by
the order of each dot product's additions. Also checks that 1-token steps give the logits one pass over
the prompt gives (the kernel computes each row alone).
"""

from __future__ import annotations

import argparse

import akunu  # noqa: F401  (must precede mlx)

# isort: split
import mlx.core as mx
import numpy as np

from akunu.kv_cache import make_cache
from akunu.models import load_model

TEXT = "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"


def logits(model_path: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    loaded = load_model(model_path, dtype=dtype)
    ids = loaded.tokenizer.encode(TEXT)
    one_pass = np.array(loaded.model(mx.array([ids]))[0])
    cache = make_cache(loaded.model)
    steps = np.stack([np.array(loaded.model(mx.array([[t]]), cache=cache)[0, -1]) for t in ids])
    return one_pass, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/work/models/qwen2.5-coder-0.5b-instruct.gguf")
    args = parser.parse_args()
    quantized, steps = logits(args.model, "quantized")
    float32, _ = logits(args.model, "float32")
    print(
        f"{len(quantized)} positions: max |quantized - float32| {np.abs(quantized - float32).max():.3g}, "
        f"argmax agreement {(quantized.argmax(-1) == float32.argmax(-1)).mean():.3f}, "
        f"max |1-token steps - one pass| {np.abs(steps - quantized).max():.3g}"
    )


if __name__ == "__main__":
    main()
