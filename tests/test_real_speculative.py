"""Speculative decoding on the real models: identical greedy output, and real gains on copy-heavy text."""

import functools

import pytest

from akunu.generate import GenerationConfig, SpecConfig, generate
from tests.greedy_checks import assert_same_or_near_tie

pytestmark = pytest.mark.real_model

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    """Length of the union of the intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))


def gaps(intervals, lower, upper):
    """The uncovered stretches between lower and upper."""
    result = []
    cursor = lower
    for start, end in merge_intervals(intervals):
        if start > cursor:
            result.append([cursor, min(start, upper)])
        cursor = max(cursor, end)
        if cursor >= upper:
            break
    if cursor < upper:
        result.append([cursor, upper])
    return result
'''
COPY_TOKENS = 64  # the answer's copy holds from its start: 5.7 tokens per pass on float32 SmolLM2
COPY_PROMPT = f"Repeat this code exactly, with the function merge_intervals renamed to combine_ranges:\n\n{CODE}"


@functools.cache
def load_smollm2(dtype: str):
    from akunu.models import load_model

    return load_model("smollm2-135m", dtype=dtype)


@pytest.fixture(scope="module", params=["float32", "quantized"])
def smollm2(request):
    return load_smollm2(request.param)


def chat_ids(loaded, text):
    tokenizer = loaded.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


@functools.cache
def plain_copy() -> tuple[list[int], list[int]]:
    """The copy-heavy prompt's ids and float32 SmolLM2's plain greedy answer, decoded once for every drafter."""
    smollm2 = load_smollm2("float32")
    ids = chat_ids(smollm2, COPY_PROMPT)
    return ids, generate(
        smollm2.model, smollm2.tokenizer, ids, GenerationConfig(max_tokens=COPY_TOKENS, spec=SpecConfig(enabled=False))
    )[1]


# Every drafter on the float32 weights; the 4-bit weights (6-17x slower matvecs on CPU) are covered by the open-ended test.
@pytest.mark.parametrize("drafter", ["suffix+ngram", "tree:8"])  # lookup's identity: test_drafters.py
def test_copy_heavy_prompt_is_identical_and_takes_two_tokens_per_pass(drafter):
    from akunu.drafters import make_drafter

    smollm2 = load_smollm2("float32")
    ids, plain = plain_copy()
    config = GenerationConfig(max_tokens=COPY_TOKENS, spec=SpecConfig())
    _, fast, stats = generate(smollm2.model, smollm2.tokenizer, ids, config, drafter=make_drafter(drafter))
    assert_same_or_near_tie(smollm2.model, ids, plain, fast)
    assert stats.tokens_per_pass >= 2, stats.to_dict()


def test_open_ended_prompt_is_identical(smollm2):
    ids = chat_ids(smollm2, "Tell me about the history of tea in three sentences.")
    run = lambda spec: generate(smollm2.model, smollm2.tokenizer, ids, GenerationConfig(max_tokens=48, spec=spec))
    assert_same_or_near_tie(
        smollm2.model, ids, run(SpecConfig(enabled=False))[1], run(SpecConfig(draft_length="fixed", draft_tokens=6))[1]
    )


def test_gemma3_sliding_window_layers_roll_back_exactly_past_the_window():
    from akunu.models import load_model

    gemma = load_model("gemma3-270m")
    text = ("The river rose in the spring and the village moved its market to the hill. " * 60).strip()
    ids = gemma.tokenizer.encode(text)
    assert len(ids) > 600  # longer than the 512-token sliding window
    run = lambda spec: generate(gemma.model, gemma.tokenizer, ids, GenerationConfig(max_tokens=32, spec=spec))
    _, plain, _ = run(SpecConfig(enabled=False))
    _, fast, stats = run(SpecConfig(draft_length="fixed", draft_tokens=6))
    assert_same_or_near_tie(gemma.model, ids, plain, fast)
    assert stats.accepted > 0


def test_recycled_token_trees_on_an_open_ended_prompt_are_identical():
    # Recycled trees branch at every level (Token Recycling's template), unlike copy-heavy n-gram trees: each node's
    # position and ancestors must reach attention on the real model's quantized CPU path.
    from akunu.drafters import make_drafter

    smollm2 = load_smollm2("quantized")
    ids = chat_ids(smollm2, "Tell me about the history of tea in three sentences.")
    run = lambda spec, **kw: generate(
        smollm2.model, smollm2.tokenizer, ids, GenerationConfig(max_tokens=48, spec=spec), **kw
    )
    _, plain, _ = run(SpecConfig(enabled=False))
    drafter = make_drafter("recycle:8")
    run(SpecConfig(draft_length="fixed", draft_tokens=8), drafter=drafter)  # fills the table with this answer's top-k
    _, fast, stats = run(SpecConfig(draft_length="fixed", draft_tokens=8), drafter=drafter)
    assert_same_or_near_tie(smollm2.model, ids, plain, fast)
    assert stats.accepted > 0, stats.to_dict()
