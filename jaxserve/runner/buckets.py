"""Shape buckets of the compiled steps: every batch is padded to the smallest precompiled bucket that fits.

    decode steps   (every sequence adds one token): T = S in powers of two up to max_running_requests;
                   query blocks of 1 row.
    extend steps   (prefill chunks, possibly mixed with decodes): T from `extend_token_buckets` (powers
                   of two, plus 1.5x steps from 128 tokens so a prompt pads by at most a third),
                   S = min(T, max S bucket); query blocks of min(T, EXTEND_BLOCK_Q) rows.
    both           P (page-table width per sequence) in powers of two from MIN_PAGE_BUCKET_TOKENS of
                   context up to the context length.
Attention cost does not depend on P: both attention backends loop over each sequence's own pages up
to its length. P only sizes the page table sent with each step, so its buckets start at 4096 tokens
(one P bucket for contexts up to 4096) and exist to keep that table small for long contexts.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxserve.core.batch import pow2_at_least

EXTEND_BLOCK_Q = 16
MIN_PAGE_BUCKET_TOKENS = 4096
# Most layers per call of the host loop: each call costs ~100 us of dispatch and runtime overhead.
# Groups of 5 took 2-5% off the default model's decode steps against one layer per call, and compile
# in ~1.15 s against ~0.75 s for one layer (D-05).
MAX_LAYERS_PER_CALL = 5


def layers_per_call(num_layers: int, most: int = MAX_LAYERS_PER_CALL) -> int:
    """The host loop's group size: the largest divisor of `num_layers` not above `most` (so every call
    runs the same compiled group)."""
    return max(g for g in range(1, max(1, most) + 1) if num_layers % g == 0)


def extend_token_buckets(lo: int, hi: int) -> list[int]:
    """Extend-step token buckets from lo to hi (powers of two, both): powers of two, plus the midpoint
    1.5 x 2^k between 128 and hi, so a step of n >= 128 tokens runs in a bucket < 1.5 n (< 2 n below)."""
    out = []
    for t in pow2_range(lo, hi):
        if t >= 256:  # the midpoint 3/4 t is then >= 192
            out.append(t // 4 * 3)
        out.append(t)
    return out


def pow2_range(lo: int, hi: int) -> list[int]:
    """Powers of two from pow2(lo) to pow2(hi), inclusive."""
    out, b = [], pow2_at_least(lo)
    while b <= pow2_at_least(hi):
        out.append(b)
        b *= 2
    return out


class BucketKey(NamedTuple):
    """Static shape of one compiled step: T tokens, S sequences, P pages per sequence, Bq block rows."""

    num_tokens: int
    num_seqs: int
    pages_per_seq: int
    block_q: int
