"""select scoring: choice tokens across the tokenization boundary, length-normalised argmax."""

from __future__ import annotations

import math

import pytest

from jaxserve.lang.choices import ChoiceTokens, token_length_normalized, tokenize_choices


def test_boundary_merge_scores_the_merged_token(default_tokenizer):
    tok = default_tokenizer
    prompt = "The capital of France is "  # ends with a space that " Paris" absorbs
    tokens = tokenize_choices(tok, prompt, ["Paris", "London"])
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    for ids, start, choice in zip(tokens.input_ids, tokens.choice_starts, ["Paris", "London"]):
        assert ids == tok.encode(prompt + choice, add_special_tokens=False)
        assert ids[:start] == prompt_ids[:start]
        assert start == len(prompt_ids) - 1  # the trailing space token is replaced ...
        assert tok.decode(ids[start:]) == " " + choice  # ... by the merged " Paris"
    assert tokens.logprob_start_len == len(prompt_ids) - 1


def test_no_merge_scores_exactly_the_choice_tokens(default_tokenizer):
    tok = default_tokenizer
    prompt = "Answer:\n"
    tokens = tokenize_choices(tok, prompt, ["yes", "no way"])
    n = len(tok.encode(prompt, add_special_tokens=False))
    assert tokens.choice_starts == [n, n] and tokens.logprob_start_len == n
    assert tok.decode(tokens.input_ids[1][n:]) == "no way"


def test_mean_not_sum_decides():
    tokens = ChoiceTokens(input_ids=[[1, 2, 10], [1, 2, 20, 21, 22]], logprob_start_len=2, choice_starts=[2, 2])
    # short: one token at -2.0 (sum -2.0); long: three tokens at -1.0 (sum -3.0, mean -1.0)
    scores = token_length_normalized(["short", "long"], tokens, [[-2.0], [-1.0, -1.0, -1.0]])
    assert scores.decision == "long"
    assert scores.normalized_logprobs == [-2.0, -1.0]
    assert scores.token_ids == [[10], [20, 21, 22]]


def test_logprobs_are_read_from_the_end():
    # choice 0 starts one token later than the batch's logprob_start_len: its first entry is skipped
    tokens = ChoiceTokens(input_ids=[[1, 2, 3, 10], [1, 2, 20]], logprob_start_len=2, choice_starts=[3, 2])
    scores = token_length_normalized(["a", "b"], tokens, [[-9.0, -0.5], [-1.0]])
    assert scores.token_logprobs == [[-0.5], [-1.0]] and scores.decision == "a"


def test_none_logprobs_are_skipped_and_ties_pick_the_first():
    tokens = ChoiceTokens(input_ids=[[10], [20]], logprob_start_len=0, choice_starts=[0, 0])
    scores = token_length_normalized(["a", "b"], tokens, [[None], [None]])
    assert scores.normalized_logprobs == [-math.inf, -math.inf] and scores.decision == "a"


def test_too_few_logprobs_raise():
    tokens = ChoiceTokens(input_ids=[[1, 10, 11]], logprob_start_len=1, choice_starts=[1])
    with pytest.raises(ValueError, match="2 tokens"):
        token_length_normalized(["a"], tokens, [[-1.0]])
