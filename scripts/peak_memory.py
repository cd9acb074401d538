"""Peak resident memory of loading a model and a 64-token greedy generate, stage by stage (one process per run).

    .venv/bin/python scripts/peak_memory.py --model /work/models/qwen2.5-coder-0.5b-instruct.gguf
    .venv/bin/python scripts/peak_memory.py --model smollm2-135m --dtype float32

Prints, after each stage (imports, load, generate), the resident memory now and the process's peak
so far, and the peak against the GGUF file's size (the issue's target is at most 1.5x).
"""

from __future__ import annotations

import argparse
import resource
from pathlib import Path

import akunu  # noqa: F401  (must precede mlx)

# isort: split
import mlx.core as mx

from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.models import load_model

PROMPT = "# Fibonacci numbers, three ways\n\ndef fib_recursive(n):\n"
MIB = 2**20


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def report(stage: str) -> None:
    print(f"{stage:>9}: RSS {resident_mib():6.0f} MiB, peak {peak_mib():6.0f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/work/models/qwen2.5-coder-0.5b-instruct.gguf")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    mx.eval(mx.zeros(1))
    report("imports")
    loaded = load_model(args.model, dtype=args.dtype)
    report("load")
    prompt = loaded.tokenizer.encode(PROMPT)
    generate(
        loaded.model, loaded.tokenizer, prompt, GenerationConfig(max_tokens=args.tokens, spec=SpecConfig(enabled=False))
    )
    report("generate")
    size = loaded.path.stat().st_size / MIB
    print(
        f"{args.model} {loaded.dtype} ({loaded.dtype_reason}): file {size:.0f} MiB, peak {peak_mib() / size:.2f}x its size"
    )


if __name__ == "__main__":
    main()
