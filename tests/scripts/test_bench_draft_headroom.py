"""Tests for scripts/bench_draft_headroom.py's candidate drafts and step replay (no model): hand-made
token sequences whose drafts and step counts are worked out by hand."""

import collections

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_draft_headroom")


def test_candidates_start_with_todays_draft_then_other_matches_longest_first(bench):
    from jaxserve.speculative.ngram import ngram_draft

    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 2, 4, 7, 1, 2, 5, 2]
    # the last token 2 occurred at 1, 4 and 8; the token before the last is 5, before those 1, 9, 1: every
    # match is 1 token long, so the order is latest first: the drafts after 8, 4 and 1
    assert bench.candidate_drafts(tokens, 2, 1) == [ngram_draft(tokens, 2)] == [[5, 2]]
    assert bench.candidate_drafts(tokens, 2, 8) == [[5, 2], [4, 7], [3, 9]]
    # here the suffix "1 2" also occurs at 0-1 (a 2-token match) and "2" alone at 4: the longer match first
    tokens2 = [1, 2, 3, 9, 2, 4, 1, 2]
    assert bench.candidate_drafts(tokens2, 2, 8) == [[3, 9], [4, 1]]
    assert bench.candidate_drafts([5, 6, 7], 3, 4) == []  # the last token never occurred before


def test_a_continuation_that_reaches_the_end_repeats_with_its_period(bench):
    assert bench.candidate_drafts([3, 4, 3, 4, 3], 5, 1) == [[4, 3, 4, 3, 4]]


def test_replay_counts_steps_of_accepted_drafts_plus_one(bench):
    # prompt [1, 2, 3], output [1, 2, 3, 1, 2, 3]: step 1 has no draft (3 never occurred before it) and
    # emits 1; then 1 matches at 0 and its continuation, repeated with period 3, drafts 2 3 1 2 3
    # (K = 5): all 5 accepted, done in 2 steps
    tokens = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    assert bench.replay_steps(tokens, 3, 5, 1) == 2
    # K = 2: step 1 emits 1; then each step accepts its 2-token draft and emits 3 tokens: 2 more steps
    assert bench.replay_steps(tokens, 3, 2, 1) == 3
    # an output nothing predicts: one token per step
    assert bench.replay_steps([1, 2, 3, 4, 5, 6], 2, 4, 8) == 4


def test_more_branches_never_take_more_steps(bench):
    rng = __import__("numpy").random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, 6, size=80)]
    counts = [bench.replay_steps(tokens, 20, 6, b) for b in (1, 2, 4, 8)]
    assert counts == sorted(counts, reverse=True) and counts[-1] < counts[0]


def test_table_has_ratios_against_one_branch(bench, capsys):
    steps = {"extract": collections.Counter({"tokens": 384, 1: 127, 2: 120, 8: 115})}
    bench.print_table(steps, [1, 2, 8])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| task | output tokens | latest (B = 1) | best of 2 | best of 8 | B = 2 / B = 1 | B = 8 / B = 1 |"
    assert lines[2] == "| extract | 384 | 127 | 120 | 115 | 0.945 | 0.906 |"
