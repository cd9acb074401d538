"""A hybrid model (gated-delta linear attention + full attention, Qwen3-Next) through every front end's engine path:
sampled speculation keeps the distribution, and a chat's and a server's prompt caches are reused across
turns and requests (state layers restored from snapshots) with output equal to a fresh run's."""

import itertools
from collections import Counter
from dataclasses import replace

import mlx.core as mx
import pytest

from akunu.drafters.specs import DraftLengthPolicy
from akunu.exact import FixedWidthModel
from akunu.forward import run
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.kv_cache import cache_length, has_state, make_cache
from akunu.prompt_cache import PromptCache
from akunu.sampling import SamplingParams
from tests.fakes import FakeTokenizer
from tests.greedy_checks import OracleDrafter, assert_same_or_near_tie
from tests.stats_tools import PROMPT, exact_model_probs, fits
from tests.tiny_archs import tiny_model

TOKENIZER = FakeTokenizer()
SPEC = SpecConfig(draft_tokens=4, draft_length=DraftLengthPolicy.fixed)


def hybrid(**overrides):
    model = tiny_model("qwen3_next", seed=3, **overrides)
    assert has_state(PromptCache(model).cache)
    return model


def answer(model, prompt, cache=None, spec=SPEC, max_tokens=12):
    _, tokens, stats = generate(
        model, TOKENIZER, prompt, GenerationConfig(max_tokens=max_tokens, spec=spec), prompt_cache=cache
    )
    return tokens, stats


def test_a_three_turn_chat_reuses_the_cache_and_answers_as_a_fresh_run():
    model, history = hybrid(), [7, 3, 9, 3, 7, 3, 9]
    cache = PromptCache(model)
    for turn, user in enumerate(([5, 6, 7, 5, 6, 7], [1, 2, 1, 2], [9, 9, 8])):
        prompt = history + user
        reused, stats = answer(model, prompt, cache)
        fresh, _ = answer(model, prompt)
        assert reused == fresh, f"turn {turn}"
        if turn:
            assert stats.prefilled_tokens == len(user) + 1  # the answer's last token and this turn: the rest was held
        history = prompt + reused
        assert cache_length(cache.cache) <= len(history)


def test_a_server_reuses_a_shared_system_prompt_from_a_snapshot():
    model = hybrid()
    system = [11, 12, 13, 14, 15, 16, 17, 18]
    cache = PromptCache(model)
    for i, user in enumerate(([1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 2, 3])):
        prompt = system + user
        reused, stats = answer(model, prompt, cache)
        assert reused == answer(model, prompt)[0], f"request {i}"
        if i >= 2:  # the second request parted from the first at the system prompt's end and kept a snapshot there
            assert stats.prefilled_tokens == len(user), f"request {i}"


def test_a_rejected_draft_leaves_the_state_where_plain_decoding_has_it():
    model = hybrid()
    prompt = [4, 4, 5] * 4  # its first round drafts the pattern, which this model does not continue
    cache = PromptCache(model)
    fast, stats = answer(model, prompt, cache, max_tokens=20)
    assert stats.drafted > stats.accepted  # drafts were rolled back
    cont = prompt + fast + [2, 3]  # a next request continues from whatever the cache holds
    assert answer(model, cont, cache)[0] == answer(model, cont)[0]


@pytest.mark.slow
def test_sampled_speculation_through_a_hybrid_keeps_the_distribution():
    # One gated-delta layer and one attention layer; resampling from p on rejection still fails at 1,500 runs
    # (chi2 144 against a critical 95; 98 against 77 at 1,000).
    model = hybrid(vocab_size=8, num_hidden_layers=2, full_attention_interval=2)
    params = SamplingParams(temp=1.0)
    exact, runs = exact_model_probs(model, params, length=4), 1500
    config = GenerationConfig(
        max_tokens=4, sampling=params, spec=SpecConfig(draft_tokens=3, draft_length=DraftLengthPolicy.fixed)
    )
    mx.random.seed(99)
    counts = Counter(tuple(generate(model, TOKENIZER, PROMPT, config)[1]) for _ in range(runs))
    ok, stat, critical = fits(counts, exact, runs)
    assert ok, f"chi2 {stat:.1f} >= {critical:.1f}"


def test_the_length_policy_charges_a_state_model_for_refeeding_after_a_rejection():
    from akunu.draft_length import best_length

    costs = [1.0 + 0.1 * k for k in range(17)]
    assert best_length(1.0, costs, 16, refeed=True) == best_length(1.0, costs, 16) == 16  # nothing is ever refed
    lengths = [(best_length(a, costs, 16, refeed=True), best_length(a, costs, 16)) for a in (0.5, 0.7, 0.8, 0.9)]
    assert all(with_refeed <= without for with_refeed, without in lengths)
    assert any(with_refeed < without for with_refeed, without in lengths)


def test_owed_tokens_stay_bounded_when_drafts_keep_being_rejected():
    from akunu.decode import MAX_OWED
    from akunu.drafters.base import Draft, Drafter

    class RightThenWrong(Drafter):  # the model's own next token, then one it never picks
        def start(self, context):
            self.last = context[-1]

        def update(self, tokens):
            self.last = tokens[-1]

        def draft(self, n):
            return Draft([following.get(self.last, 0), 63][:n])

    class Widths:  # the model, noting each pass's width
        def __init__(self, model):
            self.model, self.widths = model, []

        def __getattr__(self, name):
            return getattr(self.model, name)

        def __call__(self, inputs, cache):
            self.widths.append(inputs.shape[1])
            return self.model(inputs, cache=cache)

    model, prompt = hybrid(), [3, 1, 4, 1, 5]
    plain, _ = answer(model, prompt, spec=SpecConfig(enabled=False), max_tokens=40)
    following = dict(zip([prompt[-1], *plain], plain))
    spy = Widths(model)
    _, fast, stats = generate(
        spy, TOKENIZER, prompt, GenerationConfig(max_tokens=40, spec=SPEC), drafter=RightThenWrong()
    )
    assert_same_or_near_tie(model, prompt, plain, fast)
    assert stats.drafted > stats.accepted > 0
    assert max(spy.widths[2:]) <= MAX_OWED + 1 + 2  # past the prefill: the debt, the last token and a draft


def _logits_in_passes(model, prompt, tokens, widths):
    """Logits after each of `tokens`, fed in passes of the given widths in turn after `prompt`."""
    cache = make_cache(model)
    model(mx.array([prompt]), cache=cache)
    rows, start = [], 0
    for width in itertools.cycle(widths):
        if start >= len(tokens):
            return mx.concatenate(rows)
        rows.append(run(model, mx.array([tokens[start : start + width]]), cache)[0])
        start += width


# a gated-delta scan; a chunked SSD scan; a chunked SSD scan beside attention mlx-lm computes inline
@pytest.mark.parametrize("name", ["qwen3_next", "mamba2", "plamo2"])
def test_exact_mode_gives_a_token_the_same_logits_in_every_pass(name):
    model = tiny_model(name, seed=5)  # by default a 4-token pass rounds differently here
    exact = FixedWidthModel(model, width=4)
    prompt, tokens = [3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    steps = _logits_in_passes(exact, prompt, tokens, [1])
    for widths in ([4], [3, 1, 2]):  # blocks filled in one pass; passes that part blocks
        assert mx.array_equal(_logits_in_passes(exact, prompt, tokens, widths), steps).item(), widths
    plain = _logits_in_passes(model, prompt, tokens, [1])
    assert mx.allclose(steps, plain, atol=1e-4, rtol=1e-4).item()  # and they are the model's logits


def test_an_exact_chat_speculates_bit_for_bit_as_it_decodes_plainly_across_turns():
    model, history = hybrid(), [7, 3, 9, 3, 7, 3, 9]
    plain_cache, fast_cache = PromptCache(model), PromptCache(model)  # each keeps its state's blocks across turns
    plain_spec = SpecConfig(enabled=False, draft_tokens=3, exact=True)
    for turn, user in enumerate(([5, 6, 7, 5, 6, 7], [1, 2, 1, 2], [9, 9, 8])):
        prompt = history + user
        plain, _ = answer(model, prompt, plain_cache, spec=plain_spec)
        _, fast, stats = generate(
            model, TOKENIZER, prompt, GenerationConfig(max_tokens=12, spec=replace(SPEC, draft_tokens=3, exact=True)),
            prompt_cache=fast_cache, drafter=OracleDrafter(prompt, plain, every=2, seed=turn),
        )  # fmt: skip
        assert fast == plain, f"turn {turn}"
        assert stats.drafted > stats.accepted > 0
        if turn:
            assert stats.prefilled_tokens == len(user) + 1
        history = prompt + plain
