"""Prefill speed of akunu and of llama.cpp on the same GGUF, prompt ids and machine, in turns.

    .venv/bin/python scripts/prefill_vs_llama_cpp.py --model qwen2.5-coder-0.5b [--lengths 2000,4000] [--reps 2]

Each length's prompt is the shipped workloads' text, tokenized and cut to that many ids. Every repetition
runs akunu (plain decoding: from the call to the first token) and then llama.cpp (the same ids, as
`akunu bench` runs it), after one warm-up of each, and the fastest run of each counts. Prints one JSON line
per length. AKUNU_CPU_ISA picks akunu's instruction set; llama.cpp runs as it was built.
Needs llama-cpp-python (`pip install -e '.[llama-cpp]'`).
"""

from __future__ import annotations

import argparse
import json

import akunu  # noqa: F401  (preloads OpenBLAS before MLX)
from akunu.bench.engine import ModelEngine
from akunu.bench.llama_cpp import LlamaCppEngine
from akunu.bench.workloads import shipped_workload
from akunu.models import load_model


def prompt_of(tokenizer, length: int) -> list[int]:
    """`length` ids of the shipped workloads' text, repeated as need be."""
    ids = tokenizer.encode("\n\n".join(p.text for p in shipped_workload()))
    return (ids * (length // len(ids) + 1))[:length]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--lengths", default="2000,4000", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype="quantized")
    akunu_engine = ModelEngine(loaded.model, loaded.tokenizer, max_tokens=1, context_length=loaded.context_length)
    lengths = [int(n) for n in args.lengths.split(",")]
    llama = LlamaCppEngine(loaded.path, max_tokens=1, stop_ids=(), context_length=loaded.context_length)
    llama.open(max(lengths))
    for length in lengths:
        ids = prompt_of(loaded.tokenizer, length)
        fastest = {"akunu": float("inf"), "llama.cpp": float("inf")}
        for rep in range(args.reps + 1):  # repetition 0 warms both up
            for name in fastest:
                seconds = (akunu_engine.run("plain", ids) if name == "akunu" else llama.run(ids)).prefill_seconds
                if rep:
                    fastest[name] = min(fastest[name], seconds)
        rates = {name: length / seconds for name, seconds in fastest.items()}
        record = {"model": loaded.name, "tokens": length, **{f"{k} tok/s": round(v, 1) for k, v in rates.items()}}
        print(json.dumps({**record, "akunu / llama.cpp": round(rates["akunu"] / rates["llama.cpp"], 3)}), flush=True)


if __name__ == "__main__":
    main()
