"""Draft-model, layer-skip, lookup and hybrid drafters: greedy identity, cache bookkeeping, refusals."""

import random
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx.utils import tree_map

from akunu.drafters import DEFAULT_SPEC, make_drafter
from akunu.drafters.base import Draft, Drafter, NGramDrafter
from akunu.drafters.draft_model import check_same_vocabulary, model_drafter
from akunu.drafters.hybrid import HybridDrafter
from akunu.drafters.layer_skip import layer_skip_drafter
from akunu.drafters.lookup import LookupDrafter
from akunu.drafters.suffix import SuffixDrafter
from akunu.errors import OptionsError
from akunu.forward import prefill
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.kv_cache import make_cache
from tests.fakes import FakeTokenizer
from tests.greedy_checks import assert_same_or_near_tie
from tests.tiny import tiny_gemma3, tiny_llama

TOKENIZER = FakeTokenizer()


def perturbed(model_fn, seed, noise):
    """The same random model (`seed`) with noise on every weight: a draft that agrees often."""
    model = model_fn(seed=seed)
    mx.random.seed(seed + 100)
    model.update(tree_map(lambda p: p + noise * mx.random.normal(p.shape), model.parameters()))
    mx.eval(model.parameters())
    return model


def free(drafter):
    """The drafter with its cost ignored, so a hybrid always asks it (these tests are about exactness)."""
    drafter.cost_per_token = 0.0
    return drafter


def run(model, prompt, spec=SpecConfig(draft_tokens=4), max_tokens=30, drafter=None):
    config = GenerationConfig(max_tokens=max_tokens, spec=spec)
    return generate(model, TOKENIZER, prompt, config, drafter=drafter)


def prompts(count, vocab=64, seed=0):
    rng = random.Random(seed)
    for i in range(count):
        if i % 2:
            yield [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        else:
            motif = [rng.randrange(vocab) for _ in range(rng.randint(3, 8))]
            yield (motif * 4)[: rng.randint(6, 30)]


DRAFTERS = {
    "ngram": lambda target, fn: NGramDrafter(),
    "lookup": lambda target, fn: LookupDrafter(),
    "lookup+ngram": lambda target, fn: make_drafter("lookup+ngram"),
    "suffix": lambda target, fn: SuffixDrafter(min_match=1),
    "suffix+ngram": lambda target, fn: make_drafter("suffix+ngram"),
    "tree": lambda target, fn: make_drafter("tree:6"),
    # costed against the target, as `make_drafter` costs them: the policy asks only for what acceptance pays for
    "model-close": lambda target, fn: model_drafter(perturbed(fn, 1, 0.02), target=target),
    "model-unrelated": lambda target, fn: model_drafter(fn(seed=9), target=target),
    "layer-skip": lambda target, fn: layer_skip_drafter(target, 1),
    "hybrid-layer-skip": lambda target, fn: HybridDrafter(NGramDrafter(), free(layer_skip_drafter(target, 1))),
    "hybrid-model": lambda target, fn: HybridDrafter(NGramDrafter(), model_drafter(perturbed(fn, 1, 0.02))),
}


@pytest.mark.parametrize("model_fn", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
@pytest.mark.parametrize("kind", DRAFTERS)
def test_every_drafter_keeps_greedy_output_identical(model_fn, kind):
    target = model_fn(seed=1)
    accepted = 0
    for i, prompt in enumerate(prompts(6)):
        _, plain, _ = run(target, prompt, SpecConfig(enabled=False))
        for spec in (
            SpecConfig(draft_tokens=4),
            SpecConfig(draft_tokens=6, draft_length="fixed"),
            SpecConfig(draft_tokens=32),
        ):
            drafter = DRAFTERS[kind](target, model_fn)
            _, fast, stats = run(target, prompt, spec, drafter=drafter)
            assert_same_or_near_tie(target, prompt, plain, fast, f"prompt {i} {spec}")
            accepted += stats.accepted
    if kind in ("model-close", "hybrid-model"):
        assert accepted > 40  # a close draft model gets many drafts accepted (60 to 196 here; an unrelated one 2)


def test_draft_model_cache_holds_exactly_the_committed_sequence():
    target, draft = tiny_llama(seed=1), perturbed(tiny_llama, 1, 0.05)
    drafter = model_drafter(draft)
    prompt = [3, 4, 5, 6] * 3
    _, tokens, stats = run(target, prompt, SpecConfig(draft_tokens=5, draft_length="fixed"), 40, drafter)
    assert stats.drafted > stats.accepted > 0  # rejections happened and were rolled back
    assert drafter.sequence == prompt + tokens[: len(drafter.sequence) - len(prompt)]
    fresh = make_cache(draft)
    prefill(draft, fresh, drafter.sequence[: drafter.fed])
    for ours, theirs in zip(drafter.cache, fresh):
        assert ours.offset - len(drafter.pending) == theirs.offset == drafter.fed
        k_ours, k_theirs = ours.keys[..., : drafter.fed, :], theirs.keys[..., : drafter.fed, :]
        assert mx.allclose(k_ours, k_theirs, atol=1e-5).item()


@pytest.mark.parametrize("model_fn", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_layer_skip_cache_matches_the_targets_first_layers(model_fn):
    # Layer i's keys depend only on layers < i, so the drafter's N-layer cache must equal the target's.
    target = model_fn(seed=2)
    drafter = layer_skip_drafter(target, 1)
    config = GenerationConfig(max_tokens=40, spec=SpecConfig(draft_tokens=5, draft_length="fixed"))
    from akunu.prompt_cache import PromptCache

    prompt_cache = PromptCache(target)
    generate(target, TOKENIZER, [7, 8, 9, 10] * 3, config, drafter=drafter, prompt_cache=prompt_cache)
    n = drafter.fed
    ours, theirs = drafter.cache[0], prompt_cache.cache[0]
    assert mx.allclose(ours.keys[..., :n, :], theirs.keys[..., :n, :], atol=1e-5).item()
    assert mx.allclose(ours.values[..., :n, :], theirs.values[..., :n, :], atol=1e-5).item()


def test_layer_skip_with_every_layer_is_the_target_itself():
    target = tiny_llama(seed=3, layers=3)
    cache = layer_skip_drafter(target, 2).cache
    assert len(cache) == 2 and cache[2] is None
    full = target(mx.array([[1, 2, 3]]), cache=make_cache(target))
    from akunu.drafters.layer_skip import _FirstLayersCache

    everything = target(mx.array([[1, 2, 3]]), cache=_FirstLayersCache(make_cache(target)))
    assert mx.allclose(full, everything).item()


def test_a_draft_model_with_another_vocabulary_is_refused():
    target = SimpleNamespace(model=tiny_llama(vocab=64), tokenizer=TOKENIZER)
    other = SimpleNamespace(model=tiny_llama(vocab=80), tokenizer=TOKENIZER)
    with pytest.raises(OptionsError, match="vocabulary of 80 tokens but the target has 64"):
        make_drafter("model:other", target, load=lambda name: other)


def test_a_draft_model_with_the_same_size_but_other_tokens_is_refused():
    class Named:
        vocab_size = 4

        def __init__(self, texts):
            self.texts = texts

        def token_text(self, i):
            return self.texts[i]

    target = SimpleNamespace(model=tiny_llama(vocab=4), tokenizer=Named(["a", "b", "c", "d"]))
    draft = SimpleNamespace(model=tiny_llama(vocab=4), tokenizer=Named(["a", "b", "x", "d"]))
    with pytest.raises(OptionsError, match="different tokenizer \\(token 2 differs\\)"):
        check_same_vocabulary(target, draft, "draft")


def test_specs_parse_and_bad_ones_say_what_is_expected():
    target = SimpleNamespace(model=tiny_llama(layers=4), tokenizer=TOKENIZER)
    assert isinstance(make_drafter("ngram"), NGramDrafter)
    default = make_drafter(DEFAULT_SPEC)
    assert isinstance(default.first, SuffixDrafter) and isinstance(default.fallback, NGramDrafter)
    assert isinstance(make_drafter("lookup+ngram").first, LookupDrafter)
    chain = make_drafter("lookup+ngram+layer-skip:2", target)
    assert isinstance(chain.fallback, HybridDrafter) and len(chain.fallback.fallback.cache) == 2
    assert len(make_drafter("layer-skip:3", target).cache) == 3
    hybrid = make_drafter("hybrid:layer-skip:2", target)
    assert isinstance(hybrid, HybridDrafter) and len(hybrid.fallback.cache) == 2
    for bad in ("layer-skip:x", "layer-skip:4", "layer-skip:0", "magic", "model:", "hybrid:", "lookup+", "lookup:3"):
        with pytest.raises(OptionsError):
            make_drafter(bad, target)


def test_lookup_continues_the_latest_occurrence_of_the_longest_match():
    drafter = LookupDrafter(min_match=2, max_match=4)
    drafter.start([1, 2, 3, 7, 8, 9, 5, 2, 3, 4, 4, 2, 3])
    assert drafter.draft(3).tokens == [4, 4, 2]  # "2 3" last went on with 4 (not 7)
    drafter.update([7, 5])  # "7 5" never occurred before
    assert drafter.draft(3).tokens == []
    drafter.start([1, 2, 3, 7, 8, 9, 5, 1, 2, 3])  # start forgets the earlier sequence
    assert drafter.draft(5).tokens == [7, 8, 9, 5, 1]  # "1 2 3" (length 3) beats "2 3"
    assert drafter.draft(50).tokens == [7, 8, 9, 5, 1, 2, 3]  # up to the end of what is known


def test_lookup_prefers_a_long_match_over_a_recent_short_one():
    drafter = LookupDrafter(min_match=2, max_match=8)
    drafter.start([5, 6, 1, 2, 8, 0, 9, 1, 2, 3, 5, 6, 1, 2])
    assert drafter.draft(2).tokens == [8, 0]  # "5 6 1 2" went on with 8; the latest "1 2" with 3


def test_lookup_drafts_a_cycling_output_several_tokens_per_pass():
    # Without attention the model is a bigram model whose greedy output cycles: lookup finds the cycle.
    model = tiny_llama(seed=3, sharpness=4.0, attention=0.0)
    prompt = [5, 6, 7, 8] * 4
    _, plain, _ = run(model, prompt, SpecConfig(enabled=False), max_tokens=120)
    _, fast, stats = run(model, prompt, SpecConfig(draft_tokens=8), max_tokens=120, drafter=LookupDrafter())
    assert_same_or_near_tie(model, prompt, plain, fast)
    assert stats.tokens_per_pass > 3 and stats.acceptance_rate > 0.8


def test_model_drafters_say_what_a_draft_token_costs():
    target = tiny_llama(seed=3, layers=4)
    costs = [layer_skip_drafter(target, n).cost_per_token for n in (1, 2, 3)]
    assert 0 < costs[0] < costs[1] < costs[2] < 1  # every step also reads the embedding and head
    small = tiny_llama(seed=3, layers=1)
    assert 0 < model_drafter(small, target=target).cost_per_token < 1
    assert model_drafter(target, target=target).cost_per_token == 1
    assert model_drafter(small).cost_per_token == 0  # no target to compare with


class Scripted(Drafter):
    """A fallback that always drafts `tokens` and costs `cost_per_token` passes per token."""

    def __init__(self, tokens, cost_per_token):
        self.tokens, self.cost_per_token, self.asked = tokens, cost_per_token, 0

    def start(self, context):
        pass

    def update(self, tokens):
        pass

    def draft(self, n):
        self.asked += 1
        return Draft(self.tokens[:n])


def drafted_per_round(fallback, truth, rounds=30):
    """Run a hybrid whose first drafter never speaks against a text that is always `truth`."""
    hybrid, lengths = HybridDrafter(Scripted([], 0.0), fallback), []
    hybrid.start([1, 2, 3])
    for _ in range(rounds):
        draft = hybrid.draft(4).tokens
        accepted = next((i for i, (d, t) in enumerate(zip(draft, truth)) if d != t), len(draft))
        hybrid.update(truth[: accepted + 1])
        lengths.append(len(draft))
    return lengths


def test_a_costly_fallback_drafts_only_as_far_as_its_acceptance_pays():
    right, wrong = [9, 9, 9, 9], [8, 8, 8, 8]
    assert drafted_per_round(Scripted(right, 0.0), [9] * 5) == [4] * 30  # free: asked every round
    assert drafted_per_round(Scripted(wrong, 0.0), [9] * 5) == [4] * 30
    lengths = drafted_per_round(Scripted(right, 0.05), [9] * 5)
    assert lengths[-10:] == [4] * 10  # cheap and always right: drafts the most it may
    wrong_costly = Scripted(wrong, 0.3)
    lengths = drafted_per_round(wrong_costly, [9] * 5)
    assert max(lengths) == 1 and wrong_costly.asked <= 30 // 4  # costly and wrong: retried now and then
    too_costly = Scripted(right, 2.0)
    assert drafted_per_round(too_costly, [9] * 5) == [0] * 30 and too_costly.asked == 0


def test_the_cli_default_drafter_is_the_engines():
    import inspect

    from akunu.cli.generate import generate

    assert inspect.signature(generate).parameters["draft"].default == DEFAULT_SPEC
