"""Per-token log-probabilities for an API's `logprobs`: the model's own distribution at each generated token.

They are read from the logits row each token was chosen from (the verification pass's row for a
speculative token), so speculative and plain decoding report the same numbers up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class TokenLogprobs:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens at this position, most likely first


def token_logprobs(row: mx.array, token: int, top: int) -> TokenLogprobs:
    """`row`: the (V,) logits the token was chosen from; `top`: how many alternatives to list (0: none)."""
    logprobs = row.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1)
    chosen = logprobs[token]
    if top <= 0:
        return TokenLogprobs(token, chosen.item(), ())
    top = min(top, logprobs.size)
    ids = mx.argpartition(-logprobs, top - 1)[:top]
    values = logprobs[ids]
    order = mx.argsort(-values)
    mx.eval(chosen, ids, values, order)
    ids, values = ids[order].tolist(), values[order].tolist()
    return TokenLogprobs(token, chosen.item(), tuple(zip(ids, values)))
