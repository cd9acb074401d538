"""The copy bound: what a perfect copier drafting <= k tokens per pass gets, against a plain scan, and in bench's table."""

import random

from akunu.bench.copy_bound import bound_tokens_per_pass, copier_widths
from akunu.bench.runner import PLAIN, SPEC, BenchResult, Measurement, Run
from akunu.bench.summary import summarize


def occurs(sequence, part):
    return any(sequence[j : j + len(part)] == part for j in range(len(sequence) - len(part) + 1))


def scanned_bound(context, answer, k, anchor=0):
    i = passes = 0
    while i < len(answer):
        earlier, accepted = context + answer[:i], 0
        end = earlier[len(earlier) - anchor :] if anchor else []
        while accepted < k and i + accepted < len(answer) and occurs(earlier, end + answer[i : i + accepted + 1]):
            accepted += 1
        i, passes = i + accepted + 1, passes + 1
    return len(answer) / passes


def test_the_bound_equals_a_plain_scan_of_every_earlier_run():
    rng = random.Random(3)
    for _ in range(200):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        answer = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        for k in (1, 4, 16):
            assert bound_tokens_per_pass(context, answer, k) == scanned_bound(context, answer, k)
            for anchor in (1, 2):
                assert bound_tokens_per_pass(context, answer, k, anchor) == scanned_bound(context, answer, k, anchor)


def test_the_anchored_bound_copies_only_what_follows_the_sequence_s_end():
    context = [1, 2, 3, 4, 9, 5, 6, 7, 8]
    assert bound_tokens_per_pass(context, [5, 6, 7, 8], 16) == 4.0  # one pass: 3 drafts + 1
    assert bound_tokens_per_pass(context, [5, 6, 7, 8], 16, anchor=1) == 2.0  # 8 never preceded 5: a pass for 5 alone


def test_a_verbatim_copy_reaches_the_bound_and_novel_text_gets_one_token_per_pass():
    context = list(range(100, 140))
    assert bound_tokens_per_pass(context, context[:34], 16) == 34 / 2  # two passes of 16 drafts + 1
    assert bound_tokens_per_pass(context, list(range(10)), 16) == 1.0


def test_the_anchored_copier_continues_an_earlier_occurrence_of_the_last_token():
    context = list(range(100, 140))
    edited = context[:10] + [7] + context[11:20]  # one token replaced
    # 100 from the model; 101..109 copied (7 from the model); 111 from the model; 112..119 copied
    assert copier_widths(context, edited, 32, anchor=1) == [0, 9, 0, 8]
    assert len(edited) / len(copier_widths(context, edited, 16, anchor=1)) == bound_tokens_per_pass(
        context, edited, 16, 1
    )


def test_bench_summary_puts_the_bound_beside_tokens_per_pass():
    context, answer = list(range(100, 140)), [100] + list(range(101, 134))
    result = BenchResult(prompt_ids={"p": context})
    for method, passes in ((PLAIN, 33), (SPEC, 3)):
        run = Run(answer, len(context), 0.1, 1.0, forward_passes=passes)
        result.measurements.append(Measurement("p", "code-edit", method, 0, 0, run))
    code_edit = summarize(result)[0]
    assert code_edit.copy_bound == 33 / 2  # after the first token (prefill's): 16 drafts + 1, twice, then 1
    assert code_edit.anchored_bound == 33 / 2  # the copy continues the prompt's own 100
    assert code_edit.tokens_per_pass == 11.0
