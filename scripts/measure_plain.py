"""Issue 19's targets in one command: akunu's plain decoding against mlx-lm's, short and long prompts.

    .venv/bin/python scripts/measure_plain.py [--model smollm2-135m] [--limit 2] [--long N] [--tokens 48]

On one loaded model (float32 by default), for each prompt of the shipped short workloads
(chat, code-edit: 40-550 tokens) and of benchmarks/long-context.jsonl (shipped summarize and
rag prompts joined: 1.3-1.8k tokens), runs in turn: akunu plain
with the fast step (akunu/backends/cpu/fast_step.py), akunu plain without it, and mlx-lm's
`stream_generate` (always with mlx-lm's own attention). Prints one JSON line per group with
the median decode tok/s of each and the ratios the issue asks for.
"""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import nullcontext
from pathlib import Path

import akunu  # noqa: F401  (preloads OpenBLAS before MLX)

# isort: split
from akunu import backends
from akunu.bench.engine import ModelEngine
from akunu.bench.workloads import load_workload, select, shipped_workload
from akunu.models import load_model

LONG_PROMPTS = Path(__file__).resolve().parent.parent / "benchmarks" / "long-context.jsonl"


def measure(engine: ModelEngine, ids: list[int], mirrored: bool) -> dict[str, float]:
    """Each way once, in mirrored order on alternate prompts (the shared machine's speed drifts)."""
    ways = {"fast": "plain", "unpatched": "plain", "mlx-lm": "mlx-lm"}
    speeds = {}
    for name in reversed(ways) if mirrored else ways:
        with backends.unpatched(engine.model) if name == "unpatched" else nullcontext():
            speeds[name] = engine.run(ways[name], ids).decode_tps
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--limit", type=int, default=2, help="prompts per category")
    parser.add_argument("--long", type=int, help="long prompts (default: twice --limit)")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    engine = ModelEngine(loaded.model, loaded.tokenizer, max_tokens=args.tokens, context_length=loaded.context_length)
    groups = {
        "short": select(shipped_workload(), ("chat", "code-edit"), args.limit),
        "long": load_workload(LONG_PROMPTS)[: 2 * args.limit if args.long is None else args.long],
    }
    measure(engine, engine.encode(groups["short"][0]), False)  # warm-up
    overall: dict[str, list[float]] = {}
    for group, prompts in groups.items():
        speeds: dict[str, list[float]] = {}
        lengths = []
        for i, prompt in enumerate(prompts):
            ids = engine.encode(prompt)
            lengths.append(len(ids))
            for name, value in measure(engine, ids, mirrored=i % 2 == 1).items():
                speeds.setdefault(name, []).append(value)
                overall.setdefault(name, []).append(value)
        print(json.dumps({"group": group, "prompt_tokens": lengths, **summary(speeds)}), flush=True)
    print(json.dumps({"group": "overall", **summary(overall)}), flush=True)


def summary(speeds: dict[str, list[float]]) -> dict[str, float]:
    median = {name: statistics.median(values) for name, values in speeds.items()}
    return {
        **{f"{name}_tok_per_s": round(value, 2) for name, value in median.items()},
        "fast_vs_mlx_lm": round(median["fast"] / median["mlx-lm"], 3),
        "unpatched_vs_mlx_lm": round(median["unpatched"] / median["mlx-lm"], 3),
        "fast_vs_unpatched": round(median["fast"] / median["unpatched"], 3),
    }


if __name__ == "__main__":
    main()
