"""`akunu bench --cost-curve`: time a forward pass of k = 1..16 tokens and store the curve adaptive drafting reads.

The cache file is the one `akunu.draft_length.cached_cost_curve` reads, under the same key
as the CLI's `runtime.cost_curve`: model name, dtype, device type and BLAS.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

MAX_WIDTH = 16


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


def cost_curve_key(model_name: str, dtype: str) -> str:
    """e.g. "smollm2-135m-float32-cpu-openblas": the curve belongs to model, dtype and backend together."""
    import mlx.core as mx

    from akunu import _blas

    backend = str(mx.default_device()).replace("Device(", "").split(",")[0].strip(" )")
    blas = _blas.describe().split()[0].lower()
    return f"{model_name}-{dtype}-{backend}-{blas}"


def cost_curve_dir() -> Path:
    from akunu.models import catalogue

    return catalogue.home() / "cost_curves"


def cost_curve_path(key: str, directory: Path) -> Path:
    return directory / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', key)}.json"


def save_cost_curve(key: str, seconds: list[float], directory: Path) -> Path:
    """Write the curve where `cached_cost_curve` finds it, replacing any earlier measurement."""
    path = cost_curve_path(key, directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "seconds": seconds}))
    tmp.replace(path)
    return path


def cost_rows(seconds: list[float]) -> list[CostRow]:
    return [CostRow(k, s, s / seconds[0]) for k, s in enumerate(seconds, start=1)]


def best_draft_length(acceptance: float, costs: list[float], max_draft: int) -> int:
    """The draft length with the most tokens per unit of pass time at this per-token acceptance."""
    from akunu.draft_length import expected_tokens

    widths = range(min(max_draft, len(costs) - 1) + 1)
    return max(widths, key=lambda n: expected_tokens(acceptance, n) / costs[n])


def measure_and_save(
    model, key: str, directory: Path, max_width: int = MAX_WIDTH, repeats: int = 9
) -> tuple[list[CostRow], Path]:
    """Measure afresh (the cache is overwritten, not consulted) and store the result."""
    from akunu.draft_length import measure_cost_curve

    seconds = measure_cost_curve(model, max_width, repeats=repeats)
    return cost_rows(seconds), save_cost_curve(key, seconds, directory)
