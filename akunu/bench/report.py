"""The raw record of a benchmark (`--json`) and its chart (`--plot`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from akunu.bench.runner import SPEC, SPEC_FIXED, BenchResult
from akunu.bench.summary import OVERALL, CategorySummary, accepted_length_histogram
from akunu.errors import OptionsError


def result_record(result: BenchResult, summaries: list[CategorySummary], machine: dict, settings: dict) -> dict:
    return {
        "machine": machine,
        "settings": settings,
        "summary": [s.to_dict() for s in summaries],
        "mismatches": [asdict(m) for m in result.mismatches],
        "measurements": [m.to_dict() for m in result.measurements],
    }


def write_json(path: Path, record: dict) -> None:
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def require_matplotlib():
    """The matplotlib module, or an error saying how to install it (`--plot` is optional)."""
    try:
        import matplotlib
    except ImportError:
        raise OptionsError("--plot needs matplotlib: pip install 'akunu[plot]'") from None
    return matplotlib


def write_plot(path: Path, result: BenchResult, summaries: list[CategorySummary], title: str = "") -> None:
    """Speedup by category (adaptive and fixed drafting) beside the accepted-length histogram."""
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    figure, (speed, lengths) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = [s for s in summaries if s.category != OVERALL] + [s for s in summaries if s.category == OVERALL]
    positions = range(len(rows))
    width = 0.38
    speed.bar([p - width / 2 for p in positions], [s.speedup or 0 for s in rows], width, label="speculative (adaptive)")
    speed.bar(
        [p + width / 2 for p in positions], [s.fixed_speedup or 0 for s in rows], width, label="speculative (fixed)"
    )
    speed.axhline(1.0, color="black", linewidth=0.8)
    speed.set_xticks(list(positions), [s.category for s in rows])
    speed.set_ylabel("decode speedup vs plain (median of per-prompt ratios)")
    speed.legend()
    for method, offset in ((SPEC, -width / 2), (SPEC_FIXED, width / 2)):
        histogram = accepted_length_histogram(result.measurements, method)
        lengths.bar([k + offset for k in histogram], list(histogram.values()), width, label=method)
    lengths.set_xlabel("drafted tokens accepted in one verification")
    lengths.set_ylabel("verifications")
    lengths.legend()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
