"""Per-request KV bookkeeping over the page allocator and the radix tree.

The scheduler asks this manager, never the allocator or the tree directly:
    match(req)          longest cached prefix of the request (locks it, fills the page table)
    can_grow / grow     pages for new tokens, evicting unlocked tree leaves when the free list is short
    cache_prefix(req)   after a prefill chunk: insert the computed prefix into the tree and lock it
    release(req)        on finish or retraction: insert what was computed, unlock, free the rest

Every page is at any time in exactly one place: the free list, the tree, or the private tail of one
request's page table (pages past the part that the tree holds). `check_integrity` asserts it.
"""

from __future__ import annotations

import numpy as np

from jaxserve.cache.kv_pool import PageAllocator
from jaxserve.cache.radix_tree import RadixCache
from jaxserve.engine.request import Req


class CacheManager:
    """Owns page ownership for requests (see the module docstring)."""

    def __init__(self, allocator: PageAllocator, tree: RadixCache, page_size: int):
        self.allocator = allocator
        self.tree = tree
        self.page_size = page_size
        self.num_evicted_tokens = 0

    # ---- capacity -------------------------------------------------------------------------------
    def available_tokens(self) -> int:
        """Tokens that could be allocated now: free pages plus what eviction could free."""
        return (self.allocator.num_free * self.page_size) + self.tree.evictable_size()

    def used_tokens(self) -> int:
        return (self.allocator.num_usable - self.allocator.num_free) * self.page_size

    def pages_needed(self, req: Req, new_kv_len: int) -> int:
        return max(0, -(-new_kv_len // self.page_size) - len(req.page_table))

    # ---- request lifecycle ----------------------------------------------------------------------
    def match(self, req: Req) -> int:
        """Reuse the longest cached prefix of `req.fill_ids` (at least one token is left to compute).

        Locks the matched path and sets `req.page_table`, `req.kv_len`. Returns the matched tokens.
        """
        assert not req.page_table and req.last_node is None
        key = req.fill_ids[: len(req.fill_ids) - 1]
        if req.wants_input_logprobs:  # positions from logprob_start_len - 1 on must be computed
            key = key[: max(0, req.logprob_start_len - 1)]
        result = self.tree.match_prefix(key, req.namespace)
        self.tree.inc_lock_ref(result.last_node)
        req.last_node = result.last_node
        req.page_table = [int(p) for p in result.pages]
        req.kv_len = result.num_tokens
        return result.num_tokens

    def peek_prefix_len(self, req: Req) -> int:
        """Length of the cached prefix of `req` without locking it (for scheduling policies)."""
        return self.tree.match_prefix(req.fill_ids[: len(req.fill_ids) - 1], req.namespace).num_tokens

    def can_grow(self, num_pages: int) -> bool:
        return num_pages * self.page_size <= self.available_tokens()

    def grow(self, req: Req, new_kv_len: int) -> bool:
        """Give `req` pages covering positions [0, new_kv_len). Evicts if needed; False if impossible."""
        need = self.pages_needed(req, new_kv_len)
        if need == 0:
            return True
        if not self._reserve(need):
            return False
        req.page_table.extend(self.allocator.allocate(need))
        return True

    def _reserve(self, num_pages: int) -> bool:
        short = num_pages - self.allocator.num_free
        if short > 0:
            freed = self.tree.evict(short * self.page_size)
            self.num_evicted_tokens += len(freed) * self.page_size
            self.allocator.free(freed)
        return self.allocator.can_allocate(num_pages)

    def cache_prefix(self, req: Req) -> None:
        """Insert the computed, page-aligned prefix of `req` into the tree and move its lock there."""
        self._insert(req, keep_tail=True)

    def release(self, req: Req) -> None:
        """On finish or retraction: insert the computed prefix, unlock, free all private pages."""
        self._insert(req, keep_tail=False)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = None
        req.page_table = []
        req.kv_len = 0

    def _insert(self, req: Req, keep_tail: bool) -> None:
        if self.tree.disable:
            if not keep_tail:
                self.allocator.free(req.page_table)
            return
        ps = self.page_size
        num_aligned = (req.kv_len // ps) * ps
        num_pages = num_aligned // ps
        key = req.fill_ids[:num_aligned]
        result = self.tree.insert(key, np.asarray(req.page_table[:num_pages], np.int32), req.namespace)
        self.allocator.free(result.duplicate_pages)
        tail = req.page_table[num_pages:]
        if keep_tail:
            # the tree may hold other pages for the part it already had: switch to them
            match = self.tree.match_prefix(key, req.namespace)
            assert match.num_tokens == num_aligned, (match.num_tokens, num_aligned)
            self.tree.inc_lock_ref(match.last_node)
            self.tree.dec_lock_ref(req.last_node)
            req.last_node = match.last_node
            req.page_table = [int(p) for p in match.pages] + tail
        else:
            self.allocator.free(tail)

    def check_integrity(self, live_reqs) -> None:
        """Assert that free list, tree and private request pages partition the usable pages exactly."""
        self.tree.check_integrity()
        owners: dict[int, str] = {}
        for node in self.tree.iter_nodes():
            for p in node.pages:
                assert int(p) not in owners, f"page {p} twice in the tree"
                owners[int(p)] = "tree"
        for req in live_reqs:
            for p in req.page_table:
                if owners.get(int(p)) == "tree":
                    continue
                assert int(p) not in owners, f"page {p} owned twice (request {req.rid})"
                owners[int(p)] = req.rid
        free = set(int(p) for p in self.allocator._free)
        assert not free & set(owners), f"pages both free and owned: {sorted(free & set(owners))[:10]}"
        total = len(free) + len(owners)
        assert total == self.allocator.num_usable, f"{self.allocator.num_usable - total} pages leaked"
