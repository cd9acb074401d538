"""Where a speculative round's time goes: the verification pass, and the host work around it.

    .venv/bin/python scripts/round_time.py [--model smollm2-135m] [--categories rag,json] [--limit 8] [--max-tokens 128]

Runs akunu's default speculative decoding (greedy, the stored cost curves, as `akunu generate`
does) on shipped prompts and times every verification pass inside the loop. A round's pass cannot
be queued before the last one is read (its draft depends on what was accepted), so whatever the
host does between passes (drafting, the length policy, rewinding, the generator and its consumer)
adds to decode time. Prints one JSON line per category and one for all prompts:
  passes_share     share of decode time spent inside verification passes
  host_ms_round    decode time outside passes, per round
and then one line per draft length: the median pass inside the loop, relative to the loop's median
1-token pass, beside the cost curve's relative cost at the passes' contexts (`akunu bench
--cost-curve` times passes alone). The replay in `scripts/copy_bound.py` prices rounds by that
curve, so the two should agree.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict

import akunu  # noqa: F401  (preloads OpenBLAS before MLX)

# isort: split
from shipped_runs import load_with_curves, options

import akunu.decode
from akunu import cost_curve
from akunu.bench.workloads import select, shipped_workload
from akunu.generate import GenerationConfig, SpecConfig, generate


class PassTimer:
    """Wraps the loop's `verify_round`: (draft length, seconds, context before the pass) per pass."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float, int]] = []
        self.verify_round = akunu.decode.verify_round

    def __call__(self, model, cache, token, draft, *rest):
        context, start = cache[0].offset, time.perf_counter()
        result = self.verify_round(model, cache, token, draft, *rest)  # returns once the verdict is read
        self.passes.append((len(draft), time.perf_counter() - start, context))
        return result


def main() -> None:
    args = options(__doc__.splitlines()[0], "code-edit,summarize,rag,json,chat").parse_args()
    loaded, curves = load_with_curves(args.model)
    config = GenerationConfig(max_tokens=args.max_tokens, spec=SpecConfig(enabled=True))
    timer = PassTimer()
    akunu.decode.verify_round = timer
    rows: dict[str, list[dict]] = defaultdict(list)
    for prompt in select(shipped_workload(), args.categories.split(","), args.limit):
        ids = loaded.tokenizer.encode_chat([{"role": "user", "content": prompt.text}])
        generate(loaded.model, loaded.tokenizer, ids, config, costs=curves)  # warm: traces, caches
        timer.passes.clear()
        _, _, stats = generate(loaded.model, loaded.tokenizer, ids, config, costs=curves)
        rows[prompt.category].append({"decode": stats.decode_seconds, "passes": list(timer.passes)})
    everything = [run for category_runs in rows.values() for run in category_runs]
    for category, runs in [*rows.items(), ("overall", everything)]:
        print(json.dumps({"category": category, **time_split(runs)}))
    for record in by_draft_length([run["passes"] for run in everything], curves):
        print(json.dumps(record))


def time_split(runs: list[dict]) -> dict:
    """How much of the runs' decode time their passes took, and the host time per round besides."""
    decode = sum(run["decode"] for run in runs)
    in_passes = sum(seconds for run in runs for _, seconds, _ in run["passes"])
    rounds = sum(len(run["passes"]) for run in runs)
    host_ms = (decode - in_passes) / rounds * 1e3
    return {
        "prompts": len(runs),
        "rounds": rounds,
        "passes_share": round(in_passes / decode, 4),
        "host_ms_round": round(host_ms, 3),
    }


def by_draft_length(runs: list[list[tuple[int, float, int]]], curves) -> list[dict]:
    """Per draft length, the median pass in the loop (also relative to the loop's median 1-token
    pass) beside the median of the curve's relative costs at the passes' contexts."""
    passes = defaultdict(list)  # draft length -> (seconds in the loop, the curve's relative cost)
    for drafted, seconds, context in (p for run in runs for p in run):
        passes[drafted].append((seconds, cost_curve.costs_at(curves, context)[drafted]))
    plain_steps = passes.get(0)  # None: no round went undrafted, so nothing to be relative to
    one_token = statistics.median(seconds for seconds, _ in plain_steps) if plain_steps else None
    records = []
    for drafted, pairs in sorted(passes.items()):
        in_loop = statistics.median(seconds for seconds, _ in pairs)
        records.append({
            "drafted": drafted, "passes": len(pairs), "in_loop_ms": round(in_loop * 1e3, 2),
            "in_loop_relative": round(in_loop / one_token, 3) if one_token else None,
            "curve_relative": round(statistics.median(cost for _, cost in pairs), 3),
        })  # fmt: skip
    return records


if __name__ == "__main__":
    main()
