"""Release policy stage 1: freezing.

When a request has prefilled (a chunk of) its prompt, the cache manager inserts the computed prefix into
the radix tree and locks the path (`cache_prefix`). A locked node is *frozen*: read-only (the request
writes new tokens only into pages past the tree's part of its page table), never evicted, soft-freed
or merged. The tree already guarantees the last three for locked nodes; this unit adds

- the admission budget `--radix-cache-max-frozen-ratio`: frozen tokens may hold at most that share of
  the device pool, so unlocked cache (and decode growth) keeps room; admission waits beyond it, and
- `frozen_write_violations`, a checker that no batch writes into a page the tree holds (tests and
  `--enable-debug-checks`).
"""

from __future__ import annotations

from typing import Sequence

from jaxserve.cache.radix_tree import RadixCache, TreeNode


def path_len(node: TreeNode) -> int:
    """Tokens from the root down to and including `node`."""
    num_tokens = 0
    while node.parent is not None:
        num_tokens += len(node.key)
        node = node.parent
    return num_tokens


class FreezeBudget:
    """Caps frozen (locked) tokens at `max_frozen_ratio` x `pool_tokens`.

    Args:
        tree: the radix cache; its `protected_size()` is the frozen token count.
        pool_tokens: usable tokens of the device pool.
        max_frozen_ratio: in (0, 1]; 1 disables the cap.
    """

    def __init__(self, tree: RadixCache, pool_tokens: int, max_frozen_ratio: float):
        self.tree = tree
        self.limit_tokens = int(max_frozen_ratio * pool_tokens)
        self.num_waits = 0

    def frozen_tokens(self) -> int:
        return self.tree.protected_size()

    def can_freeze(self, num_new_tokens: int, num_own_locked_tokens: int) -> bool:
        """Whether a request that will freeze `num_new_tokens` more tokens may be admitted.

        Args:
            num_new_tokens: prompt tokens it still has to prefill (they become frozen).
            num_own_locked_tokens: tokens of its matched prefix, already locked by it.

        A request is always admitted when nothing else is frozen, so one long prompt cannot wait forever.
        """
        frozen = self.tree.protected_size()
        if frozen + num_new_tokens <= self.limit_tokens or frozen <= num_own_locked_tokens:
            return True
        self.num_waits += 1
        return False


def frozen_write_violations(
    tree: RadixCache, writes: Sequence[tuple[Sequence[int], int, int]]
) -> list[tuple[int, int]]:
    """Pages held by the tree that a batch would write to.

    Args:
        tree: the radix cache.
        writes: per sequence `(page_table, prefix_len, extend_len)`: the batch writes K/V of positions
            [prefix_len, prefix_len + extend_len).

    Returns:
        `(sequence index, page)` for every written page the tree holds (empty when the batch only
        writes private pages, as it must).
    """
    ps = tree.page_size
    tree_pages = {int(p) for node in tree.iter_nodes() for p in node.pages.tolist()}
    violations = []
    for i, (page_table, prefix_len, extend_len) in enumerate(writes):
        if extend_len <= 0:
            continue
        for idx in range(prefix_len // ps, (prefix_len + extend_len - 1) // ps + 1):
            page = int(page_table[idx])
            if page in tree_pages:
                violations.append((i, page))
    return violations
