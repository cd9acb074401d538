"""The target distribution: temperature and top-k / top-p / min-p filters over the logits.

Plain sampling and speculative verification both draw from `target_logprobs`, so the
speculative rule preserves exactly the distribution plain decoding samples from. The
filters are mlx-lm's, applied in the order its `make_sampler` uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

# Sampling stays finite at every accepted value: below MIN_TEMP, 1/temp would overflow float32, and the
# likeliest token is all but certain anyway, so it is greedy; a top-p below MIN_TOP_P (under float32's
# reach) keeps the likeliest token alone, as any top-p under its probability does; above MAX_TEMP every
# kept token is equally likely, and the scale stays above zero so that dropped tokens stay at -inf.
MIN_TEMP = 1e-5
MAX_TEMP = 1e30
MIN_TOP_P = 1e-9


class Draws:
    """Where one generation's random draws come from: a key of its own when seeded, split at each draw, so that
    generations served side by side never move each other's draws; else MLX's global generator (key None)."""

    def __init__(self, seed: int | None = None) -> None:
        self._key = None if seed is None else mx.random.key(seed)

    @classmethod
    def for_drafts(cls, seed: int | None) -> Draws:
        """A draft model's own draws: a key apart from `Draws(seed)`'s, as acceptance by min(1, p/q) needs
        uniforms independent of the drafts."""
        draws = cls()
        draws._key = None if seed is None else mx.random.split(mx.random.key(seed), 3)[2]
        return draws

    def key(self) -> mx.array | None:
        if self._key is None:
            return None
        self._key, key = mx.random.split(self._key)
        return key

    def keys(self, count: int) -> list:
        """`count` keys for one round's separate draws."""
        key = self.key()
        return [None] * count if key is None else list(mx.random.split(key, count))


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temp < MIN_TEMP or self.top_p <= 0  # a top-p of 0 keeps the likeliest token alone

    def validate(self, vocab_size: int) -> None:
        from akunu.errors import OptionsError

        if self.temp < 0:
            raise OptionsError(f"--temp must be >= 0 (got {self.temp})")
        if not 0 <= self.top_k < vocab_size:
            raise OptionsError(f"--top-k must be in [0, {vocab_size}) (got {self.top_k})")
        if not 0 <= self.top_p <= 1:
            raise OptionsError(f"--top-p must be in [0, 1] (got {self.top_p})")
        if not 0 <= self.min_p <= 1:
            raise OptionsError(f"--min-p must be in [0, 1] (got {self.min_p})")


def target_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Normalised log-probabilities to sample from. logits: (..., V) -> (..., V) float32."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if params.greedy:
        return logprobs
    if 0 < params.top_p < 1:
        logprobs = apply_top_p(logprobs, max(params.top_p, MIN_TOP_P))
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    scaled = logprobs * (1.0 / min(params.temp, MAX_TEMP))
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
