"""The decode loops: plain decoding, constrained decoding and speculative decoding.

Each generator yields (token, from_draft) forever; the caller decides when to stop. They
update `stats` in place and leave the cache holding every token they fed the model.
With `share=True` a loop also yields each forward pass it needs as a `Pass`, for its caller to run
(beside other requests' passes: akunu.shared_pass) before resuming it.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn

from akunu import backends
from akunu.draft_length import DraftLength, EntropyDraftLength
from akunu.drafters.base import Draft, Drafter
from akunu.drafters.recycle import Recycling
from akunu.drafters.tree import verify_tree_round
from akunu.forward import run
from akunu.grammar import Constraint, grammar_draft
from akunu.kv_cache import Snapshot, has_state, rewind
from akunu.sampling import Draws, SamplingParams, target_logprobs
from akunu.stats import GenerationStats
from akunu.verify import Verdict, verify_greedy, verify_sampled

# Rejections on a model with state layers leave accepted tokens owed to the next pass (`verify_round`);
# past this many, a round drafts nothing, so its pass feeds them and the debt is settled.
MAX_OWED = 16


class Pass:
    """A forward pass of `inputs` (1, n) on `cache` that a decode loop hands to its caller: the caller sets
    `logits` (n, V), then resumes the loop."""

    __slots__ = ("model", "inputs", "cache", "logits", "width")

    def __init__(self, model: nn.Module, inputs: mx.array, cache, width: PassWidth | None = None) -> None:
        self.model, self.inputs, self.cache, self.logits, self.width = model, inputs, cache, None, width


class PassWidth:
    """The width a request's draft-length policy chose for its pass, and the widest the other requests of its last
    shared pass chose (0 when it ran alone): that pass computes every row as wide, so drafts up to it cost nothing."""

    __slots__ = ("chosen", "others")

    def __init__(self) -> None:
        self.chosen = self.others = 0


def forward(model: nn.Module, inputs: mx.array, cache, share: bool, width: PassWidth | None = None):
    """The pass's logits (n, V), run here; or with `share`, yielded as a Pass for the caller to run (`yield from`)."""
    if not share:
        return run(model, inputs, cache)[0]
    shared = Pass(model, inputs, cache, width)
    yield shared
    return shared.logits


def pick_token(logits: mx.array, params: SamplingParams, draws: Draws | None = None) -> mx.array:
    """The next token from logits (..., V): argmax when greedy, else a sample of the target."""
    if params.greedy:
        return backends.argmax(logits)
    key = draws.key() if draws is not None else None
    return mx.random.categorical(target_logprobs(logits, params), axis=-1, key=key).astype(mx.uint32)


def plain_decode(
    model: nn.Module,
    cache: list,
    logits: mx.array,
    *,
    params: SamplingParams,
    stats: GenerationStats,
    rows: list | None = None,
    share: bool = False,
    draws: Draws | None = None,
) -> Iterator[tuple[int, bool]]:
    """One token per forward pass; the next pass is queued before this token is read.

    With a `rows` list, each token's logits row is appended to it just before the token is yielded.
    """  # fmt: skip
    y = pick_token(logits, params, draws)
    mx.async_eval(y)
    first = True
    while True:
        next_logits = (yield from forward(model, y.reshape(1, 1), cache, share))[-1]
        next_y = pick_token(next_logits, params, draws)
        mx.async_eval(next_y)
        if not first:
            stats.record_round(0, 0)
        first = False
        if rows is not None:
            rows.append(logits)
        yield y.item(), False
        y, logits = next_y, next_logits


def constrained_decode(
    model: nn.Module,
    cache: list,
    logits: mx.array,
    *,
    params: SamplingParams,
    stats: GenerationStats,
    constraint: Constraint,
    rows: list | None = None,
    share: bool = False,
    draws: Draws | None = None,
) -> Iterator[tuple[int, bool]]:
    """`plain_decode` under a grammar: each token is chosen from its logits masked by the grammar
    after the tokens before it; the grammar computes that mask while the token's pass runs."""  # fmt: skip
    first = True
    while True:
        y = pick_token(constraint.constrain(logits), params, draws).item()
        constraint.commit([y])
        next_logits = (yield from forward(model, mx.array([[y]], mx.uint32), cache, share))[-1]
        mx.async_eval(next_logits)
        if not first:
            stats.record_round(0, 0)
        first = False
        if rows is not None:
            rows.append(logits)
        yield y, False
        logits = next_logits


def speculative_decode(
    model: nn.Module,
    cache: list,
    logits: mx.array,
    *,
    params: SamplingParams,
    stats: GenerationStats,
    drafter: Drafter,
    draft_length: DraftLength | EntropyDraftLength,
    budget: int,
    rows: list | None = None,
    constraint: Constraint | None = None,
    share: bool = False,
    draws: Draws | None = None,
) -> Iterator[tuple[int, bool]]:
    """Draft, verify in one pass, accept the agreeing prefix plus one token, rewind the rest.

    Chains and token trees go through the same round. `budget` caps drafting so no pass
    computes tokens past the generation's end. Statistics count every tree node as drafted.
    With a `rows` list, each token's logits row (from the verification pass) is appended just before it is yielded.
    A `constraint` masks every verified position and checks and extends each draft (akunu.grammar).
    """
    keep = rows.append if rows is not None else lambda row: None
    token = pick_token(logits if constraint is None else constraint.constrain(logits), params, draws).item()
    if constraint is not None:
        constraint.commit([token])
    drafter.update([token])
    produced = 1
    keep(logits)
    yield token, False
    width = PassWidth() if share and not drafter.cost_per_token else None  # a model's drafts cost its own passes
    recycling = Recycling(drafter, stats) if drafter.top_k else None

    while True:
        owed = len(getattr(cache, "owed", ()))
        room = max(budget - produced - 1, 0) if owed < MAX_OWED else 0  # a plain step settles the debt
        if hasattr(model, "draft_room"):  # exact mode: the pass has a fixed width
            room = min(room, model.draft_room(cache))
        with stats.drafting():
            draft, chosen = propose(drafter, draft_length, room, free=width.others - 1 - owed if width else 0)
            own = draft.depth
            if constraint is not None:
                draft, own = grammar_draft(constraint, draft, min(draft_length.max_draft, room))
        if not draft and streams_plain_steps(model, draft_length, owed, width, constraint):
            steps = plain_steps(
                model, cache, token, params, draws, stats, drafter, draft_length, budget - produced, recycling
            )
            for token, row in steps:
                produced += 1
                keep(row)
                yield token, False
            continue
        if width is not None:
            width.chosen = owed + 1 + min(chosen, len(draft))
        accepted, token, round_rows = yield from verify_round(
            model, cache, token, draft, params, constraint, share, draws, width, recycling
        )
        stats.record_round(len(draft), len(accepted))
        draft_length.observe(own, min(len(accepted), own), round_rows[-1])
        if constraint is not None:
            constraint.commit([*accepted, token])
        with stats.drafting():
            drafter.update([*accepted, token])
        produced += len(accepted) + 1
        for t, row in zip(accepted, round_rows):
            keep(row)
            yield t, True
        keep(round_rows[-1])
        yield token, False


def streams_plain_steps(model: nn.Module, draft_length, owed: int, width: PassWidth | None, constraint) -> bool:
    """Whether rounds that draft nothing run as `plain_steps`: under the adaptive policy, on a pass of this loop's own
    (not shared, not fixed-width as in exact mode, where a pass costs as much whatever it drafts), unconstrained and
    owing no tokens to state layers."""
    adaptive = isinstance(draft_length, DraftLength) and draft_length.adaptive
    return adaptive and not owed and width is None and constraint is None and not hasattr(model, "draft_room")


def plain_steps(
    model: nn.Module,
    cache: list,
    token: int,
    params: SamplingParams,
    draws: Draws | None,
    stats: GenerationStats,
    drafter: Drafter,
    draft_length: DraftLength | EntropyDraftLength,
    wanted: int,
    recycling: Recycling | None = None,
) -> Iterator[tuple[int, mx.array]]:
    """Plain steps from `token`, whose round drafted nothing, for as long as rounds would draft nothing: each step's
    pass is queued before the token it feeds is read (as in `plain_decode`), so drafting and graph building overlap
    the passes instead of adding to them. Yields each token with its logits row; `wanted`: tokens the generation
    still wants. A draft that pays after a token costs one plain pass already queued, which the next round follows."""
    logits = forward_now(model, token, cache)
    y = pick_token(logits[-1], params, draws)
    mx.async_eval(y)
    ranked = recycling.rank(logits) if recycling is not None else None
    fed, late = token, Draft([])  # late: the draft a round after the token before y would verify (y its guess)
    while True:
        wanted -= 1
        queued = not late and wanted > 0
        if queued:  # y's pass, queued before y is read
            next_logits = forward_now(model, y, cache)
            next_y = pick_token(next_logits[-1], params, draws)
            mx.async_eval(next_y)
            next_ranked = recycling.rank(next_logits) if recycling is not None else None
        token = y.item()
        stats.record_round(0, 0)
        if recycling is not None:
            recycling.hear([fed], ranked, logits.shape[-1])
        # A late draft's first token meets y here, so the policy still learns how drafts land.
        draft_length.observe(min(late.depth, 1), int(bool(late) and late.tokens[0] == token), logits[-1])
        with stats.drafting():
            drafter.update([token])
        yield token, logits[-1]
        if not queued:
            return
        with stats.drafting():
            late = propose(drafter, draft_length, wanted - 1)[0]
        fed, logits, y, ranked = token, next_logits, next_y, next_ranked


def forward_now(model: nn.Module, token: int | mx.array, cache) -> mx.array:
    """The logits (1, V) of one token's pass (the token may be a lazy array, the step's own pick)."""
    inputs = token.reshape(1, 1) if isinstance(token, mx.array) else mx.array([[token]], mx.uint32)
    return run(model, inputs, cache)[0]


def propose(
    drafter: Drafter, draft_length: DraftLength | EntropyDraftLength, room: int, free: int = 0
) -> tuple[Draft, int]:
    """The round's draft, as long as the policy allows or as a shared pass computes anyway (`free` tokens), and as
    the generation has room for; and the length the policy chose."""
    n = min(max(draft_length.limit(), free), room)
    if not n:
        return Draft([]), 0
    drafted = drafter.draft(n)
    chosen = draft_length.cut(drafted)
    filled = min(free, drafted.depth)
    return (chosen if chosen.depth >= filled else drafted.truncated(filled)), chosen.depth


def verify_round(
    model: nn.Module,
    cache: list,
    token: int,
    draft: Draft,
    params: SamplingParams,
    constraint: Constraint | None = None,
    share: bool = False,
    draws: Draws | None = None,
    width: PassWidth | None = None,
    recycling: Recycling | None = None,
):
    """One forward pass over `token` and the draft; the cache keeps only what was accepted (a generator: `yield from`
    it; it yields the pass when `share`, see `forward`; a token tree's pass is always run here).

    Position layers drop the rejected drafts. State layers cannot: the pass's state is kept
    only if every draft was accepted; otherwise it goes back to its snapshot from before the
    pass, and the tokens it should have kept are owed (`cache.owed`) and fed again at the
    head of the next pass, which costs that pass width but no pass of its own.
    Returns the accepted drafts, the target's own next token and the logits rows each of them came from (n + 1, V).
    A `constraint` masks the logits the verdict reads (the returned rows stay unmasked); the grammar
    computes its masks while the pass runs. `recycling` hears every row of the pass, rejected drafts' too.
    """
    if draft and draft.parents is not None:
        return verify_tree_round(model, cache, token, draft, params, draws, recycling)
    owed = getattr(cache, "owed", [])
    inputs = [*owed, token, *draft.tokens]
    snapshot = Snapshot(cache) if draft and has_state(cache) else None
    logits = (yield from forward(model, mx.array([inputs], mx.uint32), cache, share, width))[len(owed) :]  # (n+1, V)
    ranked = recycling.rank(logits) if recycling is not None else None
    scored = logits
    if constraint is not None:
        mx.async_eval(logits)
        scored = constraint.constrain(logits, draft.tokens)
    if not draft:
        verdict = Verdict(0, pick_token(scored[0], params, draws).item())
    elif params.greedy:
        verdict = verify_greedy(scored, draft.tokens)
    else:
        verdict = verify_sampled(target_logprobs(scored, params), draft.tokens, draft.probs, draws)
    if recycling is not None:
        recycling.hear([token, *draft.tokens], ranked, logits.shape[-1])
    kept = len(inputs) - len(draft) + verdict.accepted
    if snapshot is None or kept == len(inputs):
        rewind(cache, len(inputs) - kept)  # drop rejected drafts' KV entries
        owed = []
    else:
        rewind(cache, len(inputs))
        snapshot.restore(cache)
        owed = inputs[:kept]
    if hasattr(cache, "owed"):
        cache.owed = owed
    return draft.tokens[: verdict.accepted], verdict.next_token, logits[: verdict.accepted + 1]
