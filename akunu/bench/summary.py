"""Per-category statistics from raw measurements.

Speedups are the median of per-prompt ratios, each ratio taken between runs of the same
prompt and pass, so a long prompt or a slow moment weighs no more than any other prompt.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from akunu.bench.copy_bound import ANCHOR, bound_tokens_per_pass
from akunu.bench.runner import (
    DRAFTER_PREFIX,
    LLAMA_CPP,
    MLX_LM,
    PLAIN,
    PLAIN_EXACT,
    SPEC,
    SPEC_EXACT,
    SPEC_FIXED,
    BenchResult,
    Measurement,
)  # fmt: skip

OVERALL = "overall"


@dataclass
class CategorySummary:
    category: str
    prompts: int
    plain_tps: float | None  # median over prompts of decode tok/s
    spec_tps: float | None
    speedup: float | None  # spec vs plain: median of per-prompt ratios
    acceptance: float | None  # accepted / drafted, pooled over the category's spec runs
    tokens_per_pass: float | None  # decoded tokens / decode passes, pooled
    copy_bound: float | None  # the same, for a perfect copier drafting <= 16 on the plain answers (pooled)
    anchored_bound: float | None  # the same, copying only runs that continue the sequence's last token
    drafting_share: float | None  # drafter time / decode time, pooled
    fixed_speedup: float | None  # fixed-length spec vs plain
    mlx_tps: float | None
    vs_mlx: float | None  # our plain vs mlx-lm plain
    prefill_tps: float | None  # our plain prefill
    mlx_prefill_tps: float | None
    llama_cpp_tps: float | None  # llama.cpp's plain decoding of the same GGUF
    vs_llama_cpp: float | None  # our plain vs llama.cpp
    spec_vs_llama_cpp: float | None  # our speculative vs llama.cpp's plain
    mismatches: int
    mlx_mismatches: int  # information only
    llama_cpp_mismatches: int  # information only

    def to_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def median(values: Iterable[float]) -> float | None:
    """The median; None when there are no values (a method that did not run)."""
    values = list(values)
    return statistics.median(values) if values else None


median_of_ratios = median  # speedups are medians of per-prompt ratios, never ratios of medians


def _decode_tps_by_pass(measurements: Sequence[Measurement], method: str) -> dict[tuple[str, int], float]:
    return {(m.prompt_id, m.repeat): m.run.decode_tps for m in measurements if m.method == method}


def per_prompt_ratios(measurements: Sequence[Measurement], numerator: str, denominator: str) -> dict[str, float]:
    """For each prompt, the median over its passes of numerator tok/s / denominator tok/s."""
    top, bottom = _decode_tps_by_pass(measurements, numerator), _decode_tps_by_pass(measurements, denominator)
    by_prompt: dict[str, list[float]] = defaultdict(list)
    for key, value in top.items():
        if bottom.get(key):
            by_prompt[key[0]].append(value / bottom[key])
    return {prompt: statistics.median(values) for prompt, values in by_prompt.items()}


def per_prompt_tps(measurements: Sequence[Measurement], method: str, *, prefill: bool = False) -> dict[str, float]:
    by_prompt: dict[str, list[float]] = defaultdict(list)
    for m in measurements:
        if m.method == method:
            by_prompt[m.prompt_id].append(m.run.prefill_tps if prefill else m.run.decode_tps)
    return {prompt: statistics.median(values) for prompt, values in by_prompt.items()}


def _pooled(measurements: Sequence[Measurement], method: str) -> tuple[float | None, float | None, float | None]:
    """Acceptance rate, tokens per pass and drafting share of decode time over all runs of `method`."""
    runs = [m.run for m in measurements if m.method == method]
    drafted = sum(r.drafted for r in runs)
    passes = sum(r.forward_passes for r in runs)
    decoded = sum(max(r.generated - 1, 0) for r in runs)
    decode_seconds = sum(r.decode_seconds for r in runs)
    acceptance = sum(r.accepted for r in runs) / drafted if drafted else (0.0 if runs else None)
    drafting = sum(r.drafting_seconds for r in runs) / decode_seconds if decode_seconds else None
    return acceptance, (decoded / passes if passes else None), drafting


def pooled_copy_bound(result: BenchResult, measurements: Sequence[Measurement], anchor: int = 0) -> float | None:
    """Tokens per decode pass of the perfect copier (`copy_bound`) on the plain answers of these runs.

    Like the engine's tokens per pass it leaves out the first token, which prefill produces.
    """
    tokens = passes = 0.0
    for m in measurements:
        context = result.prompt_ids.get(m.prompt_id)
        if m.method != PLAIN or m.repeat != 0 or context is None or m.run.generated < 2:
            continue
        answer = m.run.tokens[1:]
        tokens += len(answer)
        passes += len(answer) / bound_tokens_per_pass([*context, m.run.tokens[0]], answer, anchor=anchor)
    return tokens / passes if passes else None


def summarize_group(name: str, result: BenchResult, measurements: Sequence[Measurement]) -> CategorySummary:
    prompt_ids = {m.prompt_id for m in measurements}
    mismatches = [m for m in result.mismatches if m.prompt_id in prompt_ids]
    acceptance, tokens_per_pass, drafting_share = _pooled(measurements, SPEC)
    return CategorySummary(
        category=name,
        prompts=len(prompt_ids),
        plain_tps=median(per_prompt_tps(measurements, PLAIN).values()),
        spec_tps=median(per_prompt_tps(measurements, SPEC).values()),
        speedup=median_of_ratios(per_prompt_ratios(measurements, SPEC, PLAIN).values()),
        acceptance=acceptance,
        tokens_per_pass=tokens_per_pass,
        copy_bound=pooled_copy_bound(result, measurements),
        anchored_bound=pooled_copy_bound(result, measurements, anchor=ANCHOR),
        drafting_share=drafting_share,
        fixed_speedup=median_of_ratios(per_prompt_ratios(measurements, SPEC_FIXED, PLAIN).values()),
        mlx_tps=median(per_prompt_tps(measurements, MLX_LM).values()),
        vs_mlx=median_of_ratios(per_prompt_ratios(measurements, PLAIN, MLX_LM).values()),
        prefill_tps=median(per_prompt_tps(measurements, PLAIN, prefill=True).values()),
        mlx_prefill_tps=median(per_prompt_tps(measurements, MLX_LM, prefill=True).values()),
        llama_cpp_tps=median(per_prompt_tps(measurements, LLAMA_CPP).values()),
        vs_llama_cpp=median_of_ratios(per_prompt_ratios(measurements, PLAIN, LLAMA_CPP).values()),
        spec_vs_llama_cpp=median_of_ratios(per_prompt_ratios(measurements, SPEC, LLAMA_CPP).values()),
        mismatches=sum(not m.informational for m in mismatches),
        mlx_mismatches=sum(m.method == MLX_LM for m in mismatches),
        llama_cpp_mismatches=sum(m.method == LLAMA_CPP for m in mismatches),
    )


def summarize(result: BenchResult) -> list[CategorySummary]:
    """One summary per category in order of appearance, then the overall row over every prompt."""
    by_category: dict[str, list[Measurement]] = defaultdict(list)
    for m in result.measurements:
        by_category[m.category].append(m)
    rows = [summarize_group(name, result, group) for name, group in by_category.items()]
    if result.measurements:
        rows.append(summarize_group(OVERALL, result, result.measurements))
    return rows


def accepted_length_histogram(measurements: Iterable[Measurement], method: str = SPEC) -> dict[int, int]:
    """How many verifications accepted 0, 1, 2, ... drafted tokens, over all runs of `method`."""
    histogram: dict[int, int] = defaultdict(int)
    for m in measurements:
        if m.method == method:
            for length, count in m.run.accepted_lengths.items():
                histogram[int(length)] += count
    return dict(sorted(histogram.items()))


@dataclass
class DrafterSummary:
    """One `drafter:SPEC` method in one category, against plain decoding and the default drafter."""

    category: str
    drafter: str  # the spec, e.g. "layer-skip:8"
    tps: float | None
    speedup: float | None  # vs plain: median of per-prompt ratios
    vs_default: float | None  # vs the default drafter's adaptive run (SPEC)
    acceptance: float | None
    tokens_per_pass: float | None
    mismatches: int

    def to_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def summarize_drafters(result: BenchResult) -> list[DrafterSummary]:
    """A row per category and drafter method, then per drafter over every prompt."""
    methods = list(dict.fromkeys(m.method for m in result.measurements if m.method.startswith(DRAFTER_PREFIX)))
    rows = []
    for name, group in _groups(result):
        prompt_ids = {m.prompt_id for m in group}
        for method in methods:
            acceptance, tokens_per_pass, _ = _pooled(group, method)
            rows.append(
                DrafterSummary(
                    category=name,
                    drafter=method[len(DRAFTER_PREFIX) :],
                    tps=median(per_prompt_tps(group, method).values()),
                    speedup=median_of_ratios(per_prompt_ratios(group, method, PLAIN).values()),
                    vs_default=median_of_ratios(per_prompt_ratios(group, method, SPEC).values()),
                    acceptance=acceptance,
                    tokens_per_pass=tokens_per_pass,
                    mismatches=sum(m.method == method and m.prompt_id in prompt_ids for m in result.mismatches),
                )
            )
    return rows


def _groups(result: BenchResult) -> list[tuple[str, list[Measurement]]]:
    """The measurements by category, in order of appearance, then all of them as the overall group."""
    by_category: dict[str, list[Measurement]] = defaultdict(list)
    for m in result.measurements:
        by_category[m.category].append(m)
    return list(by_category.items()) + [(OVERALL, list(result.measurements))]


@dataclass
class ExactSummary:
    """Exact mode against the default in one category: what it costs, and the greedy mismatches in each mode."""

    category: str
    plain_tps: float | None
    plain_exact_tps: float | None
    spec_tps: float | None
    spec_exact_tps: float | None
    plain_cost: float | None  # exact plain vs plain: median of per-prompt ratios
    spec_cost: float | None  # exact spec vs spec
    exact_speedup: float | None  # exact spec vs exact plain
    mismatches: int  # default mode: spec vs plain
    near_ties: int  # of those, at a near-tie
    exact_mismatches: int  # exact mode: exact spec vs exact plain

    def to_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def summarize_exact(result: BenchResult) -> list[ExactSummary]:
    """A row per category, then the overall row."""
    rows = []
    for name, group in _groups(result):
        prompt_ids = {m.prompt_id for m in group}
        mismatches = [m for m in result.mismatches if m.prompt_id in prompt_ids]
        default = [m for m in mismatches if m.method == SPEC]
        ratio = lambda top, bottom, group=group: median_of_ratios(per_prompt_ratios(group, top, bottom).values())  # noqa: E731
        rows.append(
            ExactSummary(
                category=name,
                plain_tps=median(per_prompt_tps(group, PLAIN).values()),
                plain_exact_tps=median(per_prompt_tps(group, PLAIN_EXACT).values()),
                spec_tps=median(per_prompt_tps(group, SPEC).values()),
                spec_exact_tps=median(per_prompt_tps(group, SPEC_EXACT).values()),
                plain_cost=ratio(PLAIN_EXACT, PLAIN),
                spec_cost=ratio(SPEC_EXACT, SPEC),
                exact_speedup=ratio(SPEC_EXACT, PLAIN_EXACT),
                mismatches=len(default),
                near_ties=sum(m.near_tie for m in default),
                exact_mismatches=sum(m.method == SPEC_EXACT for m in mismatches),
            )
        )
    return rows
