"""N-gram drafts: the tokens that followed the latest earlier occurrence of a sequence's own suffix.

Prompt lookup decoding (Saxena 2023, "prompt lookup decoding"; SGLang's NGRAM speculative algorithm
does the same over a trie of recent tokens): when a model rewrites, edits or quotes its context, the
text after the last few generated tokens has usually appeared before, right after the same tokens.
The draft is what followed there. A draft costs no model call, only a search of the request's own
tokens (prompt + output) here; `RadixCache.continuation` adds other requests' continuations of the
same prefix.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from jaxtyping import Int


def ngram_draft(tokens: Sequence[int] | Int[np.ndarray, " N"], num_draft: int, max_match_len: int = 18) -> list[int]:
    """Up to `num_draft` tokens that followed the longest earlier match of the suffix of `tokens`.

    The suffix of length w (1 <= w <= max_match_len) is matched against every earlier window of
    `tokens`; the longest w with a match wins and, among its matches, the latest one (the most recent
    context is the best predictor). The draft is the tokens after that match, which may be fewer
    than `num_draft` near the end. O(len(tokens) x w), vectorized.

    Args:
        tokens: the sequence so far (prompt + output token ids).
        num_draft: most draft tokens to return (K).
        max_match_len: longest suffix tried (SGLang's `--speculative-ngram-max-trie-depth`).

    Returns:
        The draft token ids (empty when the last token never occurred before).
    """
    arr = np.asarray(tokens, dtype=np.int64)
    n = len(arr)
    if n < 2 or num_draft <= 0:
        return []
    last = n - 1
    # ends of earlier windows: positions e < last with arr[e] == arr[last]
    ends = np.flatnonzero(arr[:last] == arr[last])
    if len(ends) == 0:
        return []
    for w in range(1, min(max_match_len, n - 1)):
        ok = ends >= w
        ok[ok] &= arr[ends[ok] - w] == arr[last - w]
        if not ok.any():
            break
        ends = ends[ok]
    end = int(ends[-1])
    return [int(t) for t in arr[end + 1 : end + 1 + num_draft]]
