"""`akunu bench --cost-curve`: the measured curve as table rows, measured afresh and stored.

It is stored where adaptive drafting reads it (`akunu.cost_curve`), under the same key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from akunu import cost_curve


@dataclass(frozen=True)
class CostRow:
    tokens: int  # k, the width of the pass
    seconds: float
    relative: float  # against a 1-token pass

    @property
    def ms(self) -> float:
        return self.seconds * 1000

    @property
    def ms_per_token(self) -> float:
        return self.ms / self.tokens


def cost_rows(seconds: list[float]) -> list[CostRow]:
    relative = cost_curve.relative_costs(seconds)
    return [CostRow(k, s, r) for k, (s, r) in enumerate(zip(seconds, relative), start=1)]


def measure_and_save(model, key: str, directory: Path) -> tuple[list[CostRow], Path]:
    """Measure afresh (the cache is overwritten, not consulted) and store the result."""
    seconds = cost_curve.measure(model, cost_curve.MAX_WIDTH)
    return cost_rows(seconds), cost_curve.save(key, seconds, directory)
