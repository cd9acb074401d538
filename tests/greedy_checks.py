"""The default mode's greedy guarantee, as a test assertion."""

from akunu.bench.runner import first_difference
from akunu.exact import NEAR_TIE_GAP, top2_gap


def assert_same_or_near_tie(model, prompt, plain, fast, why=""):
    """The tokens are equal, or they part where plain decoding's top two logits were within rounding of each
    other (a k-token pass may round differently from a 1-token step). Exact mode asserts plain equality."""
    index = first_difference(plain, fast)
    if index is not None:
        assert index < min(len(plain), len(fast)), f"{why}: one output stopped early"
        gap = top2_gap(model, prompt, plain, index)
        assert gap <= NEAR_TIE_GAP, f"{why}: differs at token {index}, where the top-two gap was {gap:.3g}"
