"""How many tokens to draft: recent acceptance against the measured cost of wider passes.

With per-token acceptance a, a draft of n tokens yields (1 - a^(n+1)) / (1 - a) tokens
from one (n+1)-token pass. The policy picks the n with the most tokens per unit of time,
using this backend's cost curve; n = 0 (a plain step) wins when drafts rarely land.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from akunu.kv_cache import make_cache, rewind


def measure_cost_curve(model: nn.Module, max_width: int = 16, context: int = 64, repeats: int = 2) -> list[float]:
    """Seconds of one forward pass of k = 1..max_width tokens after `context` tokens, median of repeats."""
    cache = make_cache(model)
    mx.eval(model(mx.zeros((1, context), mx.uint32), cache=cache))
    timings = []
    for width in range(1, max_width + 1):
        tokens = mx.zeros((1, width), mx.uint32)
        samples = []
        for _ in range(repeats + 1):  # the first pass of each width is a warm-up
            start = time.perf_counter()
            mx.eval(model(tokens, cache=cache))
            samples.append(time.perf_counter() - start)
            rewind(cache, width)
        timings.append(sorted(samples[1:])[len(samples[1:]) // 2])
    return timings


def relative_costs(seconds: Sequence[float]) -> list[float]:
    """Cost of a k-token pass in units of a 1-token pass."""
    return [s / seconds[0] for s in seconds]


def expected_tokens(acceptance: float, drafted: int) -> float:
    """Tokens one verification yields: accepted drafts plus the target's own token."""
    if acceptance >= 1.0:
        return drafted + 1.0
    return (1.0 - acceptance ** (drafted + 1)) / (1.0 - acceptance)


class DraftLength:
    """Chooses the draft length each round; `adaptive=False` always asks for `max_draft`.

    Acceptance comes in runs (a copied passage is accepted token after token, then the text
    departs from it), so it is estimated separately after a fully accepted round ("hot") and
    after a rejection or a plain step ("cold"), each from discounted counts.
    """

    def __init__(
        self,
        max_draft: int,
        costs: Sequence[float] | None = None,
        *,
        adaptive: bool = True,
        decay: float = 0.8,
        prior: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        self.max_draft = max_draft
        # costs[k-1]: relative cost of a k-token pass. Without a measurement assume the
        # ~1.3x-for-5-tokens shape measured on CPU; a real curve should be passed in.
        self.costs = list(costs) if costs else [1.0 + 0.075 * k for k in range(max_draft + 1)]
        self.adaptive = adaptive
        self.decay = decay
        self.prior = prior
        self.hot = False  # was the last round's draft accepted whole?
        self.hits = {False: 0.0, True: 0.0}  # discounted accepted drafts, per state
        self.misses = {False: 0.0, True: 0.0}  # discounted rejections, per state

    @property
    def acceptance(self) -> float:
        hits, misses = self.hits[self.hot] + self.prior[0], self.misses[self.hot] + self.prior[1]
        return hits / (hits + misses)

    def choose(self) -> int:
        if not self.adaptive:
            return self.max_draft
        a = self.acceptance
        widths = range(min(self.max_draft, len(self.costs) - 1) + 1)
        return max(widths, key=lambda n: expected_tokens(a, n) / self.costs[n])

    def observe(self, drafted: int, accepted: int) -> None:
        # Old evidence decays, so after a run of plain steps the estimate drifts back to the
        # prior and drafting is tried again.
        state = self.hot
        for table in (self.hits, self.misses):
            table[state] *= self.decay
        self.hits[state] += accepted
        self.misses[state] += 1 if accepted < drafted else 0
        self.hot = drafted > 0 and accepted == drafted


def cached_cost_curve(model: nn.Module, key: str, directory: Path, max_width: int = 9) -> list[float]:
    """Relative pass costs for this model and backend, measured once and kept in `directory`.

    `key` names the model, dtype and backend (e.g. "smollm2-135m-float32-cpu-openblas"): the
    curve is a property of all three. Measuring takes a few seconds the first time.
    """
    path = directory / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', key)}.json"
    try:
        saved = json.loads(path.read_text())
        if len(saved["seconds"]) >= max_width:
            return relative_costs(saved["seconds"])
    except (OSError, ValueError, KeyError):
        pass
    seconds = measure_cost_curve(model, max_width)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "seconds": seconds}))
    tmp.replace(path)
    return relative_costs(seconds)
