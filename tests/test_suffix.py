"""The suffix-automaton drafter: longest earlier match and its likeliest continuation, checked against brute force."""

import random
from collections import Counter

from akunu.drafters.suffix import SuffixAutomaton, SuffixDrafter


def automaton(tokens):
    sam = SuffixAutomaton()
    for token in tokens:
        sam.extend(token)
    return sam


def longest_earlier_match(tokens):
    n = len(tokens)
    return max((k for k in range(1, n) if any(tokens[j : j + k] == tokens[n - k :] for j in range(n - k))), default=0)


def test_longest_earlier_match_and_continuation_equal_brute_force():
    rng = random.Random(1)
    for _ in range(400):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(2, 50))]
        sam = automaton(tokens)
        state = sam.longest_earlier_match()
        length = sam.length[state]
        assert length == longest_earlier_match(tokens), tokens
        if length:  # the continuation seen most often after the match, ties to the latest
            n = len(tokens)
            starts = [j for j in range(n - length) if tokens[j : j + length] == tokens[n - length :]]
            follows = Counter(tokens[j + length] for j in starts)
            latest = {tokens[j + length]: j for j in starts}
            assert sam.best_next(state) == max(follows, key=lambda t: (follows[t], latest[t])), tokens


def test_drafts_copy_the_latest_occurrence_of_a_long_match_and_report_its_length():
    drafter = SuffixDrafter(min_match=3)
    old, new = [10, 11, 12, 13, 14, 15, 16], [10, 11, 12, 13, 20, 21, 22]
    drafter.start([1, 2, *old, 3, *new, 4, 10, 11, 12, 13])
    draft = drafter.draft(3)
    assert draft.tokens == [20, 21, 22] and draft.match == 4  # the later version, as prompt lookup does
    drafter.update([20, 21])
    assert drafter.draft(2).match == 6  # the match grows as the copy holds


def test_short_matches_are_left_to_the_ngram_tables_and_a_repeating_text_drafts_on():
    drafter = SuffixDrafter(min_match=3)
    drafter.start([5, 6, 7, 8, 9, 6, 7])
    assert drafter.draft(4).tokens == []  # "6 7" is only two tokens
    drafter.update([8])
    assert drafter.draft(10).tokens == [9, 6, 7, 8] * 2 + [9, 6]  # the walk backs off and goes round the loop
