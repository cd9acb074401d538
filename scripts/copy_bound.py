"""How much could any copying drafter get out of a benchmark's greedy answers?

    .venv/bin/python scripts/copy_bound.py BENCH.json [--draft-tokens 16] [--curve COSTS.json [--policy-context N]]

Reads the plain (greedy) answers an `akunu bench --json` run recorded and, per category and over
all prompts, prints the median over prompts (as `akunu bench` takes medians) of:
  copied    share of answer tokens inside a run of >= 8 tokens found earlier (prompt or answer)
  bound     tokens per pass if every pass accepted the longest next run (<= draft-tokens) found
            anywhere earlier: no drafter that copies runs of the context can beat it
  DRAFTER   tokens per pass of a shipped drafter drafting draft-tokens every round
  DRAFTER/adaptive, DRAFTER/modelled   with --curve (a JSON list of relative pass costs, k = 1..33,
            or the curves `akunu bench cost-curve` stores, read at each prompt's context plus half
            its answer): tokens per pass under the adaptive draft-length policy (ceiling 32), and
            the speedup the curve predicts for it (answer tokens / summed cost of its passes);
            --policy-context N makes the policy draft against the curve at N tokens instead
            (the cost is still read at the prompt's own context)
  DRAFTER/foreseen   with --curve: the curve's speedup for the drafter's own drafts (<= 32) cut to
            exactly what lands, as if the policy foresaw every rejection
  ceiling   with --curve: the curve's speedup for the anchored perfect copier drafting <= 32, each
            pass continuing an earlier occurrence of the sequence's last token: perfect choices
            and perfect lengths
Greedy speculation emits exactly the plain answer, so replaying it is an exact simulation.
The computation lives in akunu.bench.copy_bound; `akunu bench` shows the <= 16 bound per category.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import akunu  # noqa: F401  (preloads OpenBLAS before MLX)

# isort: split
from akunu.bench.copy_bound import (
    ANCHOR,
    bound_tokens_per_pass,
    copied_share,
    copier_widths,
    drafter_tokens_per_pass,
    foreseen_widths,
    replay,
)
from akunu.bench.engine import ModelEngine
from akunu.bench.workloads import load_workload, shipped_workload
from akunu.cost_curve import CostCurves, costs_at, read_curves
from akunu.draft_length import make_draft_length
from akunu.drafters import make_drafter
from akunu.models import load_model

CEILING = 32  # the most the shipped policy drafts, and so the what-ifs too


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json")
    parser.add_argument("--draft-tokens", type=int, default=16)
    parser.add_argument("--drafters", default="suffix+ngram,lookup+ngram,ngram")
    parser.add_argument(
        "--curve", help="relative pass costs (JSON list), or stored cost curves, for the adaptive replay"
    )
    parser.add_argument("--policy-context", type=int, help="the context whose curve the policy drafts against")
    args = parser.parse_args()
    record = json.load(open(args.bench_json))
    curves = load_curves(args.curve) if args.curve else None
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
        costs = costs_at(curves, len(context) + len(answer) // 2) if curves else None
        for spec in args.drafters.split(","):
            row[spec].append(drafter_tokens_per_pass(make_drafter(spec), context, answer, args.draft_tokens))
            if costs:
                policy = costs_at(curves, args.policy_context) if args.policy_context else costs
                widths = replay(make_drafter(spec), context, answer, make_draft_length("adaptive", CEILING, policy))
                row[f"{spec}/adaptive"].append(len(answer) / len(widths))
                row[f"{spec}/modelled"].append(modelled(answer, widths, costs))
                row[f"{spec}/foreseen"].append(
                    modelled(answer, foreseen_widths(make_drafter(spec), context, answer, CEILING), costs)
                )
        if costs:
            row["ceiling"].append(modelled(answer, copier_widths(context, answer, CEILING, ANCHOR), costs))
    overall: dict[str, list[float]] = defaultdict(list)
    for row in table.values():
        for key, values in row.items():
            overall[key] += values
    for category, row in [*table.items(), ("overall", overall)]:
        print(json.dumps({"category": category, **{k: round(statistics.median(v), 3) for k, v in row.items()}}))


def modelled(answer: list[int], widths: list[int], costs: list[float]) -> float:
    """The curve's speedup: answer tokens over the summed cost of the passes, in 1-token passes."""
    return len(answer) / sum(costs[w] for w in widths)


def load_curves(path: str) -> CostCurves | list[float]:
    record = json.load(open(path))
    return record if isinstance(record, list) else read_curves(Path(path))


if __name__ == "__main__":
    main()
