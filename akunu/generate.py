"""Streaming generation: prompt in, text segments and live statistics out.

`stream_generate` picks the decode loop (plain or speculative), applies the stopping rules
(EOS ids, stop strings, max tokens, context length) and keeps the timing honest: prefill
ends when the first token is known, decode tok/s counts the tokens after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn

from akunu.cost_curve import CostCurves, costs_at, round_cost_at, tree_costs_at
from akunu.decode import Pass, constrained_decode, plain_decode, speculative_decode
from akunu.draft_length import make_draft_length
from akunu.drafters.base import Drafter
from akunu.drafters.specs import DraftLengthPolicy
from akunu.drafters.tree import check_tree_support
from akunu.errors import OptionsError, PromptError
from akunu.exact import exact_model, flat_costs
from akunu.forward import PrefillChunk
from akunu.grammar import Constraint
from akunu.kv_cache import has_state
from akunu.logprobs import TokenLogprobs, token_logprobs
from akunu.prompt_cache import PromptCache
from akunu.sampling import Draws, SamplingParams
from akunu.stats import GenerationStats


@dataclass(frozen=True)
class SpecConfig:
    enabled: bool = True
    draft_tokens: int = 32  # the most tokens drafted per round (adaptive: the cost curve may set fewer)
    draft_length: DraftLengthPolicy = DraftLengthPolicy.adaptive  # how many of them a round drafts
    ngram_order: int = 4
    window: int = 512
    exact: bool = (
        False  # exact mode (akunu.exact): passes padded to draft_tokens + 1, so logits never depend on the pass
    )


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    spec: SpecConfig = field(default_factory=SpecConfig)
    stop: tuple[str, ...] = ()
    prefill_step: int | None = None  # prompt tokens per prefill pass (None: the backend's, akunu.backends.prefill_step)
    logprobs: int | None = None  # per-token log-probabilities with this many alternatives (None: off)
    grammar: str | None = None  # an llguidance grammar the output must follow (akunu.grammar: JSON schemas, tool calls)


@dataclass
class GenerationResponse:
    text: str  # the new text segment; may be empty while a character or stop string is pending
    token: int | None  # None on a final response that only flushes text
    from_draft: bool
    stats: GenerationStats  # this generation's statistics as of this response (a copy of its own)
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length" on the last response
    logprobs: TokenLogprobs | None = None  # this token's, when the config asks for them


class _StopStrings:
    """Holds back text that may be the start of a stop string until it is decided."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """The text decided so far, and the stop string it ended on (None while none is found)."""
        self.pending += text
        hits = [(at, stop) for stop in self.stops if (at := self.pending.find(stop)) >= 0]
        if hits:
            at, stop = min(hits)
            out, self.pending = self.pending[:at], ""
            return out, stop
        hold = max(
            (
                k
                for s in self.stops
                for k in range(1, min(len(s), len(self.pending)) + 1)
                if self.pending.endswith(s[:k])
            ),
            default=0,
        )
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _check_prompt(prompt: Sequence[int], config: GenerationConfig, context_length: int | None) -> None:
    if not prompt:
        raise PromptError("the prompt is empty")
    if context_length and len(prompt) >= context_length:
        raise PromptError(f"the prompt has {len(prompt)} tokens but the model's context is {context_length}")
    if config.max_tokens < 1:
        raise OptionsError(f"--max-tokens must be at least 1 (got {config.max_tokens})")
    if config.spec.draft_tokens < 1:
        raise OptionsError(f"--draft-tokens must be at least 1 (got {config.spec.draft_tokens})")


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: Sequence[int],
    config: GenerationConfig = GenerationConfig(),
    *,
    prompt_cache: PromptCache | None = None,
    context_length: int | None = None,
    drafter: Drafter | None = None,
    costs: CostCurves | Sequence[float] | None = None,
    constraint: Constraint | None = None,
    between_chunks: Callable[[], None] | None = None,
    share_passes: bool = False,
    prefill_turns: bool = False,
) -> Iterator[GenerationResponse | Pass | PrefillChunk]:
    """Generate from token ids, yielding a response per token (and a final flush).

    `tokenizer` needs `eos_ids` and `detokenizer()`. `prompt_cache` carries the KV cache
    across calls (chat); `costs` holds the pass costs adaptive drafting weighs (measured curves,
    read at this generation's context, or one relative curve). A `constraint` (akunu.grammar)
    keeps the output inside its grammar, e.g. a JSON schema; without one, `config.grammar` makes one.
    `between_chunks()` runs between the prompt's prefill chunks and may raise to stop the prefill there.
    With `share_passes`, each decode pass is yielded as a `Pass` for the caller to run, maybe beside other
    generations' (akunu.shared_pass), before it asks for the next response. With `prefill_turns` each prefill chunk
    ends with a `PrefillChunk` (akunu.forward), where the caller may run other requests' steps.
    """
    _check_prompt(prompt, config, context_length)
    params = config.sampling
    if config.spec.exact:  # plain steps too, so that plain and speculative output compare exactly
        model = exact_model(model, config.spec.draft_tokens)
        costs = flat_costs(model.width)
        config = replace(config, spec=replace(config.spec, draft_tokens=model.width - 1))  # no draft outgrows a pass
    prompt_cache = prompt_cache or PromptCache(model)
    if constraint is None and config.grammar is not None:
        constraint = Constraint(config.grammar, tokenizer)
    if constraint is not None:
        constraint.reset()
    budget = config.max_tokens
    if context_length:
        budget = min(budget, context_length - len(prompt))
    stats = GenerationStats(prompt_tokens=len(prompt))
    mx.reset_peak_memory()

    start = time.perf_counter()
    to_feed = prompt_cache.reuse(prompt)
    stats.prefilled_tokens = len(to_feed)
    logits = yield from _prefill(
        prompt_cache.prefill(model, to_feed, config.prefill_step), between_chunks, prefill_turns
    )
    rows = [] if config.logprobs is not None else None  # each token's logits row, appended as it is yielded
    tokens = _decode_loop(
        model, prompt_cache.cache, logits, prompt, config, stats=stats, drafter=drafter, costs=costs, budget=budget,
        rows=rows, constraint=constraint, share=share_passes, draws=Draws(params.seed),
    )  # fmt: skip

    detokenizer, stops = tokenizer.detokenizer(), _StopStrings(config.stop)
    decode_start = None
    for item in tokens:
        if isinstance(item, Pass):
            yield item
            continue
        token, from_draft = item
        now = time.perf_counter()
        if decode_start is None:
            stats.prefill_seconds, decode_start = now - start, now
        stats.decode_seconds = now - decode_start
        stats.peak_memory_mb = mx.get_peak_memory() / 1e6
        prompt_cache.tokens.append(token)
        if token in tokenizer.eos_ids:
            stats.finish_reason, stats.ended_on_eos = "stop", True
            break
        text, stats.stop_string = stops.feed(detokenizer.add(token))
        if stats.stop_string is not None:
            stats.finish_reason = "stop"
        elif stats.generated_tokens + 1 >= budget:
            stats.finish_reason = "length"
        stats.generated_tokens += 1  # counted as it is handed over, so an interrupt never over-counts
        logprobs = token_logprobs(rows.pop(), token, config.logprobs) if rows is not None else None
        yield GenerationResponse(text, token, from_draft, stats.snapshot(), logprobs=logprobs)
        if stats.finish_reason:
            break
    tail = ""
    if stats.stop_string is None:  # text after a stop string is dropped; anything else still pending is emitted
        tail = stops.feed(detokenizer.flush())[0] + stops.flush()
    yield GenerationResponse(tail, None, False, stats.snapshot(), stats.finish_reason)


def _prefill(chunks, between_chunks, turns: bool):
    """Run a prefill's chunks (`yield from`), `between_chunks()` after each; with `turns` each PREFILL_CHUNK is
    handed on too, so the caller may give other requests a turn there. Returns the logits."""
    while True:
        try:
            chunk = next(chunks)
        except StopIteration as done:
            return done.value
        if between_chunks is not None:
            between_chunks()
        if turns:
            yield chunk


def _decode_loop(
    model, cache, logits, prompt, config: GenerationConfig, *, stats, drafter: Drafter | None, costs, budget: int,
    rows: list | None = None, constraint: Constraint | None = None, share: bool = False, draws: Draws | None = None,
):  # fmt: skip
    speculation, params = config.spec, config.sampling
    if not speculation.enabled and constraint is not None:
        return constrained_decode(
            model, cache, logits, params=params, stats=stats, constraint=constraint, rows=rows, share=share, draws=draws
        )
    if not speculation.enabled:
        return plain_decode(model, cache, logits, params=params, stats=stats, rows=rows, share=share, draws=draws)
    if drafter is None:
        from akunu.drafters import DEFAULT_SPEC, make_drafter

        drafter = make_drafter(DEFAULT_SPEC, ngram_order=speculation.ngram_order, window=speculation.window)
    if drafter.tree_nodes:
        if constraint is not None:
            raise OptionsError("structured output verifies linear drafts; a token-tree drafter cannot be used with it")
        if speculation.exact:
            raise OptionsError("--exact verifies linear drafts; a token-tree drafter has its own pass shapes")
        check_tree_support(model)
    drafter.start(prompt)
    halfway = len(prompt) + budget // 2  # the context the answer's passes run at, on average
    streams = not share and constraint is None and not speculation.exact  # plain steps stream (`plain_steps`)
    draft_length = make_draft_length(
        speculation.draft_length, speculation.draft_tokens, costs_at(costs, halfway), draft_cost=drafter.cost_per_token,
        refeed=has_state(cache), tree_costs=tree_costs_at(costs, halfway),
        round_cost=round_cost_at(costs, halfway) if streams else 0.0,
    )  # fmt: skip
    return speculative_decode(
        model, cache, logits, params=params, stats=stats, drafter=drafter, draft_length=draft_length, budget=budget,
        rows=rows, constraint=constraint, share=share, draws=draws,
    )  # fmt: skip


def generate(
    model: nn.Module, tokenizer, prompt: Sequence[int], config: GenerationConfig = GenerationConfig(), **kwargs
):
    """Run `stream_generate` to the end; return (text, token ids, stats)."""
    text, ids, stats = [], [], None
    for response in stream_generate(model, tokenizer, prompt, config, **kwargs):
        text.append(response.text)
        if response.token is not None:
            ids.append(response.token)
        stats = response.stats
    return "".join(text), ids, stats
