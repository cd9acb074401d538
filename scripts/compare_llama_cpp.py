"""Teacher-forced agreement and perplexity of akunu against llama.cpp on one GGUF and one text.

    .venv/bin/python scripts/compare_llama_cpp.py /work/models/qwen2.5-coder-0.5b-instruct.gguf \\
        [--text benchmarks/texts/declaration-of-independence.txt] [--dtype float32]

Both read the same token ids (llama.cpp's tokenization of the text; akunu's is printed beside it): at
every position, does akunu's top token equal llama.cpp's, and what is each one's perplexity on the text.
llama.cpp runs in its own environment through scripts/llama_cpp_worker.py.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.record_llama_cpp_fixtures import LLAMA_PYTHON, run_llama_cpp  # noqa: E402

DEFAULT_TEXT = ROOT / "benchmarks" / "texts" / "declaration-of-independence.txt"


def akunu_teacher_forced(model, ids: list[int], chunk: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """akunu's top token and the log-probability of the actual next token, per position, chunk by chunk."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    top, logprob = [], []
    for start in range(0, len(ids) - 1, chunk):
        stop = min(start + chunk, len(ids) - 1)
        logits = model(mx.array(ids[start:stop])[None], cache=cache)[0].astype(mx.float32)
        log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        next_ids = mx.array(ids[start + 1 : stop + 1])
        top.append(np.array(mx.argmax(logits, axis=-1)))
        logprob.append(np.array(mx.take_along_axis(log_probs, next_ids[:, None], axis=-1)[:, 0]))
    return np.concatenate(top), np.concatenate(logprob).astype(np.float64)


def perplexity(logprob: np.ndarray) -> float:
    return math.exp(-float(np.mean(logprob)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--dtype", default="float32", help="akunu's --dtype (auto, float32, quantized, ...)")
    parser.add_argument("--llama-python", default=LLAMA_PYTHON)
    args = parser.parse_args()

    import akunu  # noqa: F401  (before mlx)
    from akunu.models import load_model

    text = args.text.read_text()
    reference = run_llama_cpp(
        args.llama_python, {"gguf": str(args.gguf), "context": 4096, "text": text, "teacher_forced": True}
    )
    ids = reference["ids"].tolist()
    loaded = load_model(str(args.gguf), dtype=args.dtype)
    own_ids = loaded.tokenizer.encode(text)
    top, logprob = akunu_teacher_forced(loaded.model, ids)
    agreement = float(np.mean(top == reference["top"]))
    ours, theirs = perplexity(logprob), perplexity(reference["logprob"])
    print(
        f"text: {args.text.name}, {len(ids)} tokens ({len(ids) - 1} positions); akunu's tokenizer "
        f"{'gives the same ids' if own_ids == ids else 'differs'}"
    )
    print(f"akunu dtype: {loaded.dtype}")
    print(f"next-token agreement with llama.cpp: {agreement:.2%} ({int(np.sum(top == reference['top']))}/{len(top)})")
    print(f"perplexity: akunu {ours:.4f}, llama.cpp {theirs:.4f} ({(ours / theirs - 1):+.2%})")


if __name__ == "__main__":
    main()
