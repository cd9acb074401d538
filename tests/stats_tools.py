"""Goodness-of-fit helpers for the distribution tests (no scipy needed)."""

from __future__ import annotations

import math
from collections import Counter


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z=3.719 is a 1e-4 tail."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square_gof(observed: Counter, expected_probs: dict, n: int, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; cells expected below `min_expected` are pooled."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for outcome, prob in expected_probs.items():
        exp = prob * n
        if exp < min_expected:
            pooled_obs, pooled_exp = pooled_obs + observed.get(outcome, 0), pooled_exp + exp
            continue
        stat += (observed.get(outcome, 0) - exp) ** 2 / exp
        cells += 1
    unexplained = n - sum(observed.get(o, 0) for o in expected_probs)  # outcomes with zero probability
    pooled_obs, pooled_exp = pooled_obs + unexplained, pooled_exp
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    elif pooled_obs:
        return math.inf, cells
    return stat, max(cells - 1, 1)


def fits(observed: Counter, expected_probs: dict, n: int) -> tuple[bool, float, float]:
    stat, df = chi_square_gof(observed, expected_probs, n)
    critical = chi_square_critical(df)
    return stat < critical, stat, critical
