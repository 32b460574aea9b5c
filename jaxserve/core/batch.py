"""The host-side batch as the runner takes it: one `BatchEntry` per sequence (built by the scheduler and
the engine, padded to a compiled shape bucket by the runner, runner/buckets.py), and the power-of-two
arithmetic of those buckets, which the scheduler's and the speculator's cost tables key on too."""

from __future__ import annotations

import dataclasses
from typing import Sequence

# a step's cost is the median of the last this many steps of its kind (decode bucket, extend bucket):
# one slow step (another process, a GC pause) does not move it, a slower spell that lasts (longer
# contexts, a busier machine) does within half as many steps
COST_WINDOW = 8


@dataclasses.dataclass
class BatchEntry:
    """One sequence of a host-side batch: `extend_len` new tokens after `prefix_len` cached ones."""

    token_ids: Sequence[int]  # the new tokens (length extend_len)
    prefix_len: int
    page_table: Sequence[int]
    target_ids: Sequence[int] | None = None  # the token after each new token, for prompt logprobs
    # logits rows for the last num_logits new tokens (speculative verification needs K + 1); each
    # takes one row of the bucket's S logits rows, in order
    num_logits: int = 1
    lora_slot: int = 0  # the LoRA slot its tokens run under (0: the base model)


def pow2_at_least(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()
