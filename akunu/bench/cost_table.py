"""`akunu bench cost-curve`: the measured curves as table rows, measured afresh and stored.

They are stored where adaptive drafting reads them (`akunu.cost_curve`), under the same key.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from akunu import cost_curve

Row = tuple[int, list[float], list[float], list[float], list[float]]


def cost_table_rows(curves: cost_curve.CostCurves) -> Iterator[Row]:
    """(k, ms of a k-token pass, its cost relative to a 1-token pass, then the same two for a k-token tree pass),
    each by context, ascending (the tree's lists empty where trees were not measured)."""
    contexts = sorted(curves.seconds)
    relative = {c: cost_curve.relative_costs(curves.seconds[c]) for c in contexts}
    trees = sorted(curves.tree_seconds) if curves.has_trees else []
    for i in range(curves.widths):
        tree_ms = [curves.tree_seconds[c][i] * 1000 for c in trees]
        tree_relative = [curves.tree_seconds[c][i] / curves.seconds[c][0] for c in trees]
        yield (
            i + 1,
            [curves.seconds[c][i] * 1000 for c in contexts],
            [relative[c][i] for c in contexts],
            tree_ms,
            tree_relative,
        )


def measure_and_save(model, key: str, directory: Path, contexts: Sequence[int]) -> tuple[cost_curve.CostCurves, Path]:
    """Measure afresh (the cache is overwritten, not consulted) and store the result."""
    curves = cost_curve.measure_curves(model, cost_curve.MAX_WIDTH, contexts=contexts)
    return curves, cost_curve.save(key, curves, directory)
