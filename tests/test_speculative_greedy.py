"""Greedy speculative decoding equals plain greedy decoding token for token, or parts from it only at a near-tie."""

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from akunu import decode
from akunu.drafters.base import Draft, Drafter
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.kv_cache import cache_length, make_cache
from akunu.prompt_cache import PromptCache
from tests.fakes import FakeTokenizer
from tests.greedy_checks import assert_same_or_near_tie
from tests.tiny import tiny_gemma3, tiny_llama

TOKENIZER = FakeTokenizer()


def run(model, prompt, spec: SpecConfig, max_tokens=40, **kwargs):
    config = GenerationConfig(max_tokens=max_tokens, spec=spec)
    return generate(model, TOKENIZER, prompt, config, **kwargs)


def random_prompt(rng, vocab, repetitive):
    if repetitive:  # a motif repeated with noise, so n-gram drafts get accepted
        motif = [rng.randrange(vocab) for _ in range(rng.randint(3, 12))]
        return (motif * rng.randint(2, 6))[: rng.randint(8, 60)] + motif[:2]
    return [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]


@pytest.mark.parametrize("model_fn", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_speculative_equals_plain_over_many_prompts(model_fn):
    model = model_fn(seed=1)
    rng = random.Random(0)
    drafted = 0
    for i in range(24):
        prompt = random_prompt(rng, 64, repetitive=i % 2 == 0)
        _, plain, _ = run(model, prompt, SpecConfig(enabled=False))
        specs = (
            SpecConfig(draft_tokens=4),
            SpecConfig(draft_tokens=7, draft_length="fixed"),
            SpecConfig(draft_length="entropy"),
        )
        for spec in specs:
            _, fast, stats = run(model, prompt, spec)
            assert_same_or_near_tie(model, prompt, plain, fast, f"prompt {i} {spec}")
            drafted += stats.accepted
    assert drafted > 100  # the comparison exercised accepted drafts, not only plain steps


def test_repetitive_generation_yields_several_tokens_per_pass():
    # Without attention the model is a bigram model: greedy output cycles; n-grams then predict it.
    model = tiny_llama(seed=3, sharpness=4.0, attention=0.0)
    prompt = [5, 6, 7, 8] * 4
    _, plain, plain_stats = run(model, prompt, SpecConfig(enabled=False), max_tokens=120)
    _, fast, stats = run(model, prompt, SpecConfig(draft_tokens=6, draft_length="fixed"), max_tokens=120)
    assert_same_or_near_tie(model, prompt, plain, fast)
    assert stats.tokens_per_pass > 2
    assert stats.forward_passes < len(fast) / 2
    assert plain_stats.drafting_seconds == 0 < stats.drafting_seconds < stats.decode_seconds


def test_sliding_window_model_matches_mlx_lm_rotating_cache_past_the_window():
    # Our full cache + window mask must agree with mlx-lm's own rotating cache.
    model = tiny_gemma3(seed=2, window=8)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    ours, theirs = make_cache(model), make_prompt_cache(model)
    assert any(type(c).__name__ == "RotatingKVCache" for c in theirs)
    for cache in (ours, theirs):
        model(mx.array([prompt]), cache=cache)
    for t in range(20):
        a = model(mx.array([[t]]), cache=ours)
        b = model(mx.array([[t]]), cache=theirs)
        assert mx.allclose(a, b, atol=1e-4).item(), f"step {t}"


def test_rollback_leaves_the_cache_exactly_at_the_generated_sequence():
    model = tiny_llama(seed=4, sharpness=3.0)
    cache = PromptCache(model)
    prompt = [1, 2, 3, 4] * 5
    _, tokens, stats = run(model, prompt, SpecConfig(draft_tokens=5, draft_length="fixed"), prompt_cache=cache)
    assert stats.drafted > stats.accepted > 0  # some drafts were rejected and rolled back
    # Everything fed is the prompt plus generated tokens; the last one is not fed yet.
    assert cache_length(cache.cache) in (len(prompt) + len(tokens) - 1, len(prompt) + len(tokens))
    assert cache.tokens == prompt + tokens


def test_max_tokens_and_eos_stop_speculative_rounds_mid_way():
    # Exact mode, where token identity holds by construction, so the stops can be compared token for token.
    model = tiny_llama(seed=5, sharpness=4.0)
    prompt = [9, 8, 7] * 6
    _, plain, _ = run(model, prompt, SpecConfig(enabled=False, draft_tokens=8, exact=True), max_tokens=50)
    for n in (1, 2, 7, 13):
        _, fast, stats = run(model, prompt, SpecConfig(draft_tokens=8, draft_length="fixed", exact=True), max_tokens=n)
        assert fast == plain[:n] and stats.finish_reason == "length"
    eos = plain[10]
    tokenizer = FakeTokenizer(eos_ids=frozenset({eos}))
    config = GenerationConfig(max_tokens=50, spec=SpecConfig(draft_tokens=8, draft_length="fixed", exact=True))
    text, fast, stats = generate(model, tokenizer, prompt, config)
    assert fast == plain[: plain.index(eos)] and stats.finish_reason == "stop"


@pytest.mark.parametrize("model_fn", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_a_wide_pass_computes_the_logits_of_one_token_steps(model_fn):
    """Why greedy output agrees in the default mode: verifying k tokens at once gives each position
    the logits a 1-token step gives it, up to rounding. Bit-identity is not guaranteed: a BLAS may
    round a k-row product differently from a 1-row one (OpenBLAS on AVX-512, Metal's matrix-vector
    and matrix-matrix kernels); tests/test_exact.py proves it for exact mode."""
    model = model_fn(seed=2)
    tokens = [random.Random(1).randrange(64) for _ in range(24)]
    cache = make_cache(model)
    steps = mx.concatenate([model(mx.array([[t]]), cache=cache)[0] for t in tokens])  # (24, V)
    for width in (2, 5, 9):
        cache = make_cache(model)
        wide = mx.concatenate([model(mx.array([tokens[i : i + width]]), cache=cache)[0] for i in range(0, 24, width)])
        assert mx.allclose(wide, steps[: wide.shape[0]], rtol=1e-4, atol=1e-4).item(), f"width {width}"


class ScriptedDrafter(Drafter):
    """Drafts `script[i]` after the i-th committed token of the generation (nothing where absent), and notes how
    many passes had been queued when each token was committed."""

    def __init__(self, script: dict[int, list[int]], passes: list) -> None:
        self.script, self.passes, self.committed, self.queued_at = script, passes, 0, []

    def start(self, context):
        self.committed = 0

    def update(self, tokens):
        for _ in tokens:
            self.queued_at.append(len(self.passes))
            self.committed += 1

    def draft(self, n):
        return Draft(self.script.get(self.committed, [])[:n])


def test_rounds_that_draft_nothing_queue_each_pass_before_reading_the_token_it_feeds(monkeypatch):
    passes: list = []
    counted = decode.run

    def counting_run(model, inputs, cache):
        passes.append(inputs.shape[1])
        return counted(model, inputs, cache)

    monkeypatch.setattr(decode, "run", counting_run)
    model = tiny_llama(seed=1)
    prompt = [3, 9, 4, 1]
    _, plain, _ = run(model, prompt, SpecConfig(enabled=False), max_tokens=12)
    drafts = {5: plain[5:8], 6: plain[6:9]}  # from the 5th token on the right next three, as a copy would give
    for policy, ahead in (("adaptive", True), ("fixed", False)):
        drafter = ScriptedDrafter(drafts, passes)
        passes.clear()
        _, fast, stats = run(
            model, prompt, SpecConfig(draft_tokens=3, draft_length=policy), max_tokens=12, drafter=drafter
        )
        assert fast == plain
        first = drafter.queued_at[0]  # the first token came from the prefill's pass
        # Streaming: token i's own pass is queued when it is committed (its round would draft nothing).
        assert [q - first for q in drafter.queued_at[1:5]] == ([2, 3, 4, 5] if ahead else [1, 2, 3, 4]), policy
        # Streaming, the draft after token 5 comes once its pass is queued: token 6 is read, and the next round
        # verifies the draft after it. Either way 3 drafts land in one 4-wide pass.
        assert 4 in passes and stats.accepted == 3 and stats.forward_passes < len(fast) - 1, policy
