"""The default mode's greedy guarantee, as a test assertion, and the drafter that exercises it on random weights."""

import random

from akunu.bench.runner import first_difference
from akunu.drafters.base import Draft, Drafter
from akunu.exact import NEAR_TIE_GAP, top2_gap

VOCAB = 64  # the smallest vocabulary of the tiny models the oracle drafts for: a planted token stays in range


def assert_same_or_near_tie(model, prompt, plain, fast, why=""):
    """The tokens are equal, or they part where plain decoding's top two logits were within rounding of each
    other (a k-token pass may round differently from a 1-token step). Exact mode asserts plain equality."""
    index = first_difference(plain, fast)
    if index is not None:
        assert index < min(len(plain), len(fast)), f"{why}: one output stopped early"
        gap = top2_gap(model, prompt, plain, index)
        assert gap <= NEAR_TIE_GAP, f"{why}: differs at token {index}, where the top-two gap was {gap:.3g}"


class OracleDrafter(Drafter):
    """Drafts the plain run's continuation, with every `every`-th proposed token made wrong."""

    def __init__(self, prompt, plain, every=4, seed=0):
        self.expected, self.every, self.rng = [*prompt, *plain], every, random.Random(seed)
        self.position = 0

    def start(self, context):
        self.position = len(context)

    def update(self, tokens):
        self.position += len(tokens)

    def draft(self, n):
        tokens = self.expected[self.position : self.position + n]
        if len(tokens) > 1 and self.rng.randrange(self.every) == 0:  # a wrong token somewhere past the first
            i = self.rng.randrange(1, len(tokens))
            tokens[i] = (tokens[i] + 1) % VOCAB
        return Draft(tokens)
