"""N-gram drafts: the tokens that followed the latest earlier occurrence of a sequence's own suffix.

Prompt lookup decoding (Saxena 2023, "prompt lookup decoding"; SGLang's NGRAM speculative algorithm
does the same over a trie of recent tokens): when a model rewrites, edits or quotes its context, the
text after the last few generated tokens has usually appeared before, right after the same tokens.
The draft is what followed there. A draft costs no model call, only a search of the request's own
tokens (prompt + output) here; `RadixCache.continuation` adds other requests' continuations of the
same prefix.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from jaxtyping import Int


class NgramMatch(NamedTuple):
    """A draft and the length (tokens) of the suffix match it follows (0: no match, no draft)."""

    draft: list[int]
    match_len: int


def ngram_draft(tokens: Sequence[int] | Int[np.ndarray, " N"], num_draft: int, max_match_len: int = 18) -> list[int]:
    """`ngram_match(...).draft`."""
    return ngram_match(tokens, num_draft, max_match_len).draft


def ngram_match(tokens: Sequence[int] | Int[np.ndarray, " N"], num_draft: int, max_match_len: int = 18) -> NgramMatch:
    """Up to `num_draft` tokens that followed the longest earlier match of the suffix of `tokens`.

    The suffix of length w (1 <= w <= max_match_len) is matched against every earlier window of
    `tokens`; the longest w with a match wins and, among its matches, the latest one (the most recent
    context is the best predictor). The draft is the tokens after that match; where they reach the
    end of `tokens` (the suffix repeats the text after the match: a loop of period n - 1 - end) it
    continues with that period, so a draft always has `num_draft` tokens. On the default model, a
    loop's drafts stopped at its period (3 tokens of 12 on random prompts). O(len(tokens) x w),
    vectorized.

    Args:
        tokens: the sequence so far (prompt + output token ids).
        num_draft: most draft tokens to return (K).
        max_match_len: longest suffix tried (SGLang's `--speculative-ngram-max-trie-depth`).

    Returns:
        The draft token ids (empty when the last token never occurred before) and the match length w
        (the adaptive policy learns acceptance per class of w: a long match predicts a long accept).
    """
    arr = np.asarray(tokens, dtype=np.int64)
    n = len(arr)
    if n < 2 or num_draft <= 0:
        return NgramMatch([], 0)
    last = n - 1
    # ends of earlier windows: positions e < last with arr[e] == arr[last]
    ends = np.flatnonzero(arr[:last] == arr[last])
    if len(ends) == 0:
        return NgramMatch([], 0)
    match_len = 1
    for w in range(1, min(max_match_len, n - 1)):
        ok = ends >= w
        ok[ok] &= arr[ends[ok] - w] == arr[last - w]
        if not ok.any():
            break
        ends = ends[ok]
        match_len = w + 1
    end = int(ends[-1])
    # The tokens after the match run to the end of the sequence when the text repeats with period
    # n - 1 - end (a model in a loop): the draft goes on with that period instead of stopping short.
    period = last - end
    return NgramMatch([int(arr[end + 1 + j % period]) for j in range(num_draft)], match_len)
