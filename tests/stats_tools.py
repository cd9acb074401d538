"""For the distribution tests: goodness of fit (no scipy needed), exact sequence probabilities
of a model, and a deliberately wrong verification rule the tests must catch."""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx

from akunu.sampling import SamplingParams, target_logprobs
from akunu.verify import Verdict, verify_sampled


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


# Exact probabilities of the engine's sampled generation on a tiny model.

PROMPT = list(range(8)) * 2 + [0, 1]  # every token has a seen continuation, so each round drafts
SETTINGS = [
    SamplingParams(temp=1.0),
    SamplingParams(temp=0.7, top_k=5, top_p=0.9, min_p=0.05),
]


def exact_model_probs(model, params: SamplingParams, length: int = 3, prompt: list[int] = PROMPT) -> dict:
    """P(t1..tL | prompt) under the processed target distribution, by enumeration."""
    vocab = model.args.vocab_size
    probs = {(): 1.0}
    for _ in range(length):
        prefixes = list(probs)
        batch = mx.array([prompt + list(p) for p in prefixes])
        step = mx.exp(target_logprobs(model(batch)[:, -1], params)).tolist()
        probs = {
            p + (t,): probs[p] * step[i][t] for i, p in enumerate(prefixes) for t in range(vocab) if step[i][t] > 0
        }
    return probs


def resample_from_p_on_rejection(target_logprobs, draft, draft_probs=None, draws=None):
    """Broken: on rejection draws from p instead of max(p - q, 0), over-weighting the draft."""
    v = verify_sampled(target_logprobs, draft, draft_probs, draws)
    if v.accepted < len(draft):
        return Verdict(v.accepted, mx.random.categorical(target_logprobs[v.accepted]).item())
    return v
