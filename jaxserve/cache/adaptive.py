"""Release policy stage 4: adapt to the running batch size.

With few running requests the pool has room and decode steps are short, so moving KV around costs more
than it saves: the policy is conservative. With many, memory is the bottleneck and cold KV should leave
the device early. One comparison per scheduler iteration decides:

    num_running <  --release-conservative-batch-size (8)    conservative: no proactive soft release,
                                                             no merging (pressure eviction still
                                                             soft-frees before it drops)
    between                                                  balanced: proactive soft release, no merging
    num_running >= --release-aggressive-batch-size (16)      aggressive: proactive soft release and merging
"""

from __future__ import annotations

import enum


class ReleaseMode(enum.Enum):
    CONSERVATIVE = "conservative"
    BALANCED = "balanced"
    AGGRESSIVE = "aggressive"

    @property
    def allows_proactive_release(self) -> bool:
        return self is not ReleaseMode.CONSERVATIVE

    @property
    def allows_merge(self) -> bool:
        return self is ReleaseMode.AGGRESSIVE


def choose_mode(num_running: int, conservative_batch_size: int, aggressive_batch_size: int) -> ReleaseMode:
    """The release mode for `num_running` requests (see the module docstring; the aggressive bound wins
    when the two overlap)."""
    if num_running >= aggressive_batch_size:
        return ReleaseMode.AGGRESSIVE
    if num_running < conservative_batch_size:
        return ReleaseMode.CONSERVATIVE
    return ReleaseMode.BALANCED
