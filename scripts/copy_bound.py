"""How much could any copying drafter get out of a benchmark's greedy answers?

    .venv/bin/python scripts/copy_bound.py BENCH.json [--draft-tokens 16]

Reads the plain (greedy) answers an `akunu bench --json` run recorded and, per category, prints:
  copied    share of answer tokens inside a run of >= 8 tokens found earlier (prompt or answer)
  bound     tokens per pass if every pass accepted the longest next run (<= draft-tokens) found
            anywhere earlier: no drafter that copies runs of the context can beat it
  DRAFTER   tokens per pass of a shipped drafter drafting draft-tokens every round
Greedy speculation emits exactly the plain answer, so replaying it is an exact simulation.
The computation lives in akunu.bench.copy_bound; `akunu bench` shows the <= 16 bound per category.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import akunu  # noqa: F401  (preloads OpenBLAS before MLX)
from akunu.bench.copy_bound import bound_tokens_per_pass, copied_share, drafter_tokens_per_pass
from akunu.bench.engine import ModelEngine
from akunu.bench.workloads import load_workload, shipped_workload
from akunu.drafters import make_drafter
from akunu.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json")
    parser.add_argument("--draft-tokens", type=int, default=16)
    parser.add_argument("--drafters", default="suffix+ngram,lookup+ngram,ngram")
    args = parser.parse_args()
    record = json.load(open(args.bench_json))
    workload = record["settings"]["workload"]
    prompts = shipped_workload() if workload == "shipped" else load_workload(workload)
    loaded = load_model(record["machine"]["model"], dtype="quantized")  # only the tokenizer is used
    engine = ModelEngine(loaded.model, loaded.tokenizer)
    contexts = {p.id: engine.encode(p) for p in prompts}
    table: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for m in record["measurements"]:
        if m["method"] != "plain" or m["repeat"] != 0:
            continue
        context, answer, row = contexts[m["prompt_id"]], m["run"]["tokens"], table[m["category"]]
        row["copied"].append(copied_share(context, answer))
        row["bound"].append(bound_tokens_per_pass(context, answer, args.draft_tokens))
        for spec in args.drafters.split(","):
            row[spec].append(drafter_tokens_per_pass(make_drafter(spec), context, answer, args.draft_tokens))
    for category, row in table.items():
        print(json.dumps({"category": category, **{k: round(statistics.mean(v), 3) for k, v in row.items()}}))


if __name__ == "__main__":
    main()
