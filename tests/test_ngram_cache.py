"""The persistent n-gram cache: what one run learns drafts in the next, within a size cap."""

import pytest

from akunu.drafters.ngram import fnv1a
from akunu.drafters.ngram_cache import CachedNGramDrafter, NGramCache, UnreadableCache
from akunu.generate import GenerationConfig, SpecConfig, generate
from tests.fakes import FakeTokenizer
from tests.greedy_checks import assert_same_or_near_tie
from tests.tiny import tiny_llama


def test_counts_predict_the_most_frequent_continuation_of_the_longest_context():
    cache = NGramCache()
    cache.learn([1, 2, 3, 9, 1, 2, 3, 9, 5, 2, 3, 7])
    assert cache.predict([1, 2, 3]) == 9
    assert cache.predict([5, 2, 3]) == 7  # the 3-token context wins over "2 3" -> 9
    assert cache.predict([3]) is None  # one token of context is too little to trust
    assert cache.predict([3], min_context=1) == 9


def test_save_and_load_round_trip_and_the_cap_keeps_the_commonest_contexts(tmp_path):
    path = tmp_path / "ngrams.cache"
    cache = NGramCache(max_contexts=3, max_continuations=1)
    cache.learn([1, 2] * 20 + [7, 8, 9])
    cache.save(path)
    loaded = NGramCache.load(path)
    assert len(loaded) == 3
    assert loaded.predict([2, 1, 2]) == 1 and loaded.predict([8, 9]) is None  # "1 2" kept, "8 9" dropped


@pytest.mark.parametrize("content", [b"", b"not numpy", b"PK\x03\x04 truncated zip"], ids=["empty", "text", "zip"])
def test_a_missing_file_is_an_empty_cache_and_a_broken_one_a_warning(tmp_path, content):
    assert len(NGramCache.load(tmp_path / "absent")) == 0
    broken = tmp_path / "broken"
    broken.write_bytes(content)
    with pytest.warns(UnreadableCache, match="cannot read it .*; this run starts with an empty cache"):
        assert len(NGramCache.load(broken)) == 0


def test_a_second_run_drafts_what_the_first_one_generated_and_output_is_unchanged(tmp_path):
    model = tiny_llama(seed=3, sharpness=3.0)
    path = tmp_path / "ngrams.cache"
    config = GenerationConfig(max_tokens=40, spec=SpecConfig(draft_tokens=4, draft_length="fixed"))
    prompt = [10, 20, 30]
    _, plain, _ = generate(
        model, FakeTokenizer(), prompt, GenerationConfig(max_tokens=40, spec=SpecConfig(enabled=False))
    )
    runs = []
    for _ in range(2):
        drafter = CachedNGramDrafter(path)
        _, tokens, stats = generate(model, FakeTokenizer(), prompt, config, drafter=drafter)
        drafter.save()
        assert_same_or_near_tie(model, prompt, plain, tokens)
        runs.append(stats)
    assert runs[1].accepted > runs[0].accepted
    assert runs[1].tokens_per_pass > 2


def test_a_continued_conversation_is_learned_once(tmp_path):
    drafter = CachedNGramDrafter(tmp_path / "c")
    drafter.start([1, 2, 3])
    drafter.update([4, 5])
    drafter.start([1, 2, 3, 4, 5, 6])  # the next chat turn repeats the conversation so far
    drafter.save()
    assert NGramCache.load(tmp_path / "c").tables[1][fnv1a([1, 2])] == {3: 1}
