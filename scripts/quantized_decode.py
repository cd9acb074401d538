"""Plain greedy decode speed and peak memory of one model held quantized or in float32 (one process per run).

    for d in quantized float32 quantized float32; do .venv/bin/python scripts/quantized_decode.py --dtype $d; done
    .venv/bin/python scripts/quantized_decode.py --model /work/models/qwen2.5-coder-0.5b-instruct.gguf --dtype quantized
    .venv/bin/python scripts/quantized_decode.py --llama-cpp     # then llama.cpp on the same GGUF and prompt ids

Prints decode tok/s (best of --reps runs of --tokens tokens after a warm-up), the prefill rate, the
weights' bytes in memory and the process's peak resident memory. Run the dtypes alternately: the
machine's load drifts.
"""

from __future__ import annotations

import argparse
import resource

import akunu  # noqa: F401  (must precede mlx)

# isort: split
import mlx.core as mx

from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.models import load_model

PROMPT = "# Fibonacci numbers, three ways\n\ndef fib_recursive(n):\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="quantized", choices=["quantized", "float32", "auto"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--llama-cpp", action="store_true", help="then time llama.cpp's plain decoding of the same GGUF"
    )
    args = parser.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    prompt = loaded.tokenizer.encode(PROMPT)
    config = GenerationConfig(max_tokens=args.tokens, spec=SpecConfig(enabled=False))
    generate(loaded.model, loaded.tokenizer, prompt, GenerationConfig(max_tokens=4, spec=SpecConfig(enabled=False)))
    runs = [generate(loaded.model, loaded.tokenizer, prompt, config)[2] for _ in range(args.reps)]
    weights = sum(a.nbytes for _, a in _leaves(loaded.model.parameters()))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    best = max(runs, key=lambda s: s.decode_tps)  # a run that met EOS early says so in its token count
    print(
        f"{args.model} {loaded.dtype}: decode {best.decode_tps:.1f} tok/s ({best.generated_tokens} tokens), prefill {best.prefill_tps:.0f} tok/s, "
        f"weights {weights / 2**20:.0f} MiB, peak RSS {peak:.0f} MiB ({mx.default_device()})"
    )
    if args.llama_cpp:
        print_llama_cpp(loaded, prompt, args.tokens, args.reps)


def print_llama_cpp(loaded, prompt: list[int], tokens: int, reps: int) -> None:
    """llama.cpp (llama-cpp-python) on the same file and prompt ids, timed like akunu's runs (best of `reps`)."""
    from akunu.bench.llama_cpp import LlamaCppEngine, llama_cpp_version

    llama = LlamaCppEngine(loaded.path, max_tokens=tokens, stop_ids=loaded.tokenizer.eos_ids)
    llama.run(prompt)  # warm-up
    best = max((llama.run(prompt) for _ in range(reps)), key=lambda r: r.decode_tps)
    print(
        f"llama.cpp (llama-cpp-python {llama_cpp_version()}, {llama.threads} threads): decode {best.decode_tps:.1f} tok/s "
        f"({best.generated} tokens), prefill {best.prefill_tps:.0f} tok/s"
    )


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}{i}.")
    else:
        yield prefix, tree


if __name__ == "__main__":
    main()
