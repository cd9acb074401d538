"""Acceptance rules: which drafted tokens the target model agrees with.

Both rules look at the target's predictions for positions [last, d0 .. d(n-1)] from one
forward pass and return how many drafts to keep plus the token that follows them. Each
does exactly one host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from akunu import backends
from akunu.sampling import Draws


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafts kept, 0..n
    next_token: int  # the target's own token after them (correction or bonus)


def verify_greedy(logits: mx.array, draft: list[int]) -> Verdict:
    """Keep the longest prefix of `draft` equal to the argmax. logits: (n+1, V)."""
    choices = backends.argmax(logits).tolist()
    accepted = 0
    while accepted < len(draft) and choices[accepted] == draft[accepted]:
        accepted += 1
    return Verdict(accepted, choices[accepted])


def verify_sampled(
    target_logprobs: mx.array, draft: list[int], draft_probs: mx.array | None = None, draws: Draws | None = None
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023), exact in distribution.

    target_logprobs: (n+1, V), the processed target distribution p at each position.
    draft_probs: (n, V), the proposal q each draft was sampled from; None means one-hot
    on the draft (a deterministic drafter such as the n-gram predictor), so q(d) = 1.
    Draft i is accepted with probability min(1, p(d)/q(d)); the first rejection is
    replaced by a sample from max(p - q, 0) renormalised; if all pass, the bonus is from p.
    `draws` gives a seeded generation random keys of its own (akunu.sampling.Draws).
    """
    n = len(draft)
    d = mx.array(draft, dtype=mx.uint32)[:, None]  # (n, 1)
    p = mx.exp(target_logprobs[:n])  # (n, V)
    p_draft = mx.take_along_axis(p, d, axis=-1)[:, 0]
    if draft_probs is None:
        q_draft = mx.ones_like(p_draft)
        residual = mx.where(mx.arange(p.shape[-1])[None] == d, 0.0, p)
    else:
        q_draft = mx.take_along_axis(draft_probs, d, axis=-1)[:, 0]
        residual = mx.maximum(p - draft_probs, 0.0)
    uniform_key, corrections_key, bonus_key = (draws or Draws()).keys(3)
    accept = mx.random.uniform(shape=(n,), key=uniform_key) * q_draft < p_draft  # u < p/q without dividing
    corrections = mx.random.categorical(mx.log(residual), axis=-1, key=corrections_key)  # (n,)
    bonus = mx.random.categorical(target_logprobs[n], key=bonus_key)[None]  # (1,)
    accept, tokens = mx.concatenate([accept, mx.array([False])]), mx.concatenate([corrections, bonus])
    mx.eval(accept, tokens)
    accept, tokens = accept.tolist(), tokens.tolist()
    accepted = accept.index(False)
    return Verdict(accepted, tokens[accepted])
