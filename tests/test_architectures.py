"""Speculative decoding on every text architecture mlx-lm ships, hybrid recurrent models included.

Each architecture is built tiny with random weights (tests/tiny_archs.py). An oracle drafter
proposes the plain run's own tokens with planted errors, so drafts are accepted and rolled back
in the middle on random weights; greedy speculative output must equal plain output token for
token (by default up to a near-tie, with --exact bit for bit, state layers and inline attention included).
"""

import random

import pytest

from akunu.drafters.specs import DraftLengthPolicy
from akunu.generate import GenerationConfig, SpecConfig, generate
from tests.fakes import FakeTokenizer
from tests.greedy_checks import OracleDrafter, assert_same_or_near_tie
from tests.tiny_archs import ARCHITECTURES, VOCAB, tiny_model

TOKENIZER = FakeTokenizer()
TOKENS = 12
FIXED = DraftLengthPolicy.fixed


def run(model, prompt, spec, drafter=None):
    return generate(model, TOKENIZER, prompt, GenerationConfig(max_tokens=TOKENS, spec=spec), drafter=drafter)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request):
    name = request.param
    model = tiny_model(name, seed=1)
    rng = random.Random(name)
    prompt = [rng.randrange(VOCAB) for _ in range(9)]
    return name, model, prompt


def test_speculative_equals_plain(arch):
    name, model, prompt = arch
    _, plain, _ = run(model, prompt, SpecConfig(enabled=False))
    drafted = accepted = 0
    for draft_tokens in (2, 5):
        drafter = OracleDrafter(prompt, plain, seed=draft_tokens)
        _, fast, stats = run(model, prompt, SpecConfig(draft_tokens=draft_tokens, draft_length="fixed"), drafter)
        assert_same_or_near_tie(model, prompt, plain, fast, f"{name}, drafts of {draft_tokens}")
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert drafted > accepted > TOKENS  # drafts landed, and some were rejected mid-draft and rolled back


@pytest.mark.slow
def test_exact_speculative_equals_exact_plain(arch):
    name, model, prompt = arch
    _, plain, _ = run(model, prompt, SpecConfig(enabled=False, draft_tokens=3, exact=True))
    _, default, _ = run(model, prompt, SpecConfig(enabled=False))
    assert_same_or_near_tie(model, prompt, default, plain, f"{name}, exact plain")  # exact mode decodes the model
    drafter = OracleDrafter(prompt, plain, every=2)
    _, fast, stats = run(model, prompt, SpecConfig(draft_tokens=3, draft_length="fixed", exact=True), drafter)
    assert fast == plain, name
    assert stats.drafted > stats.accepted > 0
