import pytest

from akunu.drafters.ngram import FNV_OFFSET_BASIS, NGramPredictor, fnv1a


def test_fnv1a_matches_the_published_64bit_vectors():
    # FNV-1a 64 test vectors: "" and "a" (token 97 hashes like the byte 0x61).
    assert fnv1a([]) == FNV_OFFSET_BASIS == 0xCBF29CE484222325
    assert fnv1a([97]) == 0xAF63DC4C8601EC8C
    assert fnv1a([97, 98]) == 0x089C4407B545986A  # "ab"


def test_prefers_the_longest_matching_context():
    p = NGramPredictor()
    # After "1 2" comes 3 (once); after "2" alone, 9 is more frequent.
    p.update_batch([2, 9, 2, 9, 1, 2, 3, 5, 1, 2])
    assert p.predict(1) == [3]


def test_falls_back_to_shorter_contexts_and_stops_where_nothing_matches():
    p = NGramPredictor()
    p.update_batch([7, 8, 4, 5, 6, 8])
    # context "5 6 8" and "6 8" unseen; bigram "8" -> 4, then "8 4" -> 5, "8 4 5" -> 6, then 6 -> 8 ...
    assert p.predict(4) == [4, 5, 6, 8]
    q = NGramPredictor()
    q.update_batch([1, 2, 3])
    assert q.predict(4) == []  # "3" was never followed by anything


def test_chains_its_own_predictions():
    p = NGramPredictor()
    seq = [10, 11, 12, 13, 14, 15]
    p.update_batch(seq + [10])
    assert p.predict(5) == [11, 12, 13, 14, 15]


def test_most_frequent_wins_and_ties_go_to_the_most_recent():
    p = NGramPredictor(max_order=2)
    p.update_batch([1, 5, 1, 5, 1, 6, 1])
    assert p.predict(1) == [5]  # 5 seen twice after 1, 6 once
    p.update_batch([6, 1])
    assert p.predict(1) == [6]  # now 2-2: the most recently seen wins


def test_window_limits_the_history_not_the_tables():
    p = NGramPredictor(window=4)
    p.update_batch(range(100))
    assert list(p.history) == [96, 97, 98, 99]
    assert len(p.tables[0]) == 99  # every bigram context is still counted


@pytest.mark.parametrize("order", [2, 3, 4, 5])
def test_orders_are_a_parameter(order):
    p = NGramPredictor(max_order=order)
    assert len(p.tables) == order - 1
    p.update_batch([1, 2, 3, 4] * 3)
    assert p.predict(4) == [1, 2, 3, 4]


def test_each_predicted_token_reports_the_context_and_the_counts_behind_it():
    p = NGramPredictor()
    p.update_batch([1, 2, 3, 1, 2, 4, 1, 2, 4, 7, 1])
    tokens, support = p.predict_with_support(3)
    assert tokens == [2, 4, 7]
    # "4 7 1" and "7 1" are unseen, so the bigram "1" speaks (2, all 3 times); "7 1 2" is unseen and
    # "1 2" went on to 4 twice of three; "1 2 4" went on to 1 once and 7 once (the later wins).
    assert [(s.order, s.count, s.total) for s in support] == [(1, 3, 3), (2, 2, 3), (3, 1, 2)]
    assert p.predict_with_match(3) == (tokens, 1)
