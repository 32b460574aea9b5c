"""Per-request KV bookkeeping over the page allocator and the radix tree.

The scheduler asks this manager, never the allocator or the tree directly:
    match(req)          longest cached prefix of the request (locks it, fills the page table)
    can_grow / grow     pages for new tokens, evicting unlocked tree leaves when the free list is short
    cache_prefix(req)   after a prefill chunk: insert the computed prefix into the tree and lock it
    release(req)        on finish or retraction: insert what was computed, unlock, free the rest

The release policy (jaxserve/cache/release_policy.py) hooks in here when given: eviction soft-frees to
the host tier first, a match recalls host-resident nodes and copies a partly matched page
(copy-on-write), release may keep a short tail, and admission respects the frozen-ratio cap.

Every page is at any time in exactly one place: the free list, the tree, or the private tail of one
request's page table (pages past the part that the tree holds). `check_integrity` asserts it.

With the hybrid sliding-window pool (`HybridPageAllocator`, jaxserve/cache/window_pool.py) a page also
has a window part while some window may read it (D-46). Each running request holds a window lock on the
pages that cover its last `window - 1` tokens and what it computes next (`WindowSpan`); before each step
(`grow`) the pages its window left are unlocked, and its private pages (its decoded tokens, not yet in
the tree) lose their window part. The tree's pages keep theirs as cache until the window space runs
short; then the window parts no window reads are dropped, least recently used first (SGLang's SWA
eviction). A match is usable only up to the longest prefix whose last window still has its window
parts; the rest is computed again. Where an insert finds the tree holding other pages for the same
tokens, a window part moves to the tree's page.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.cache.freezing import path_len
from jaxserve.cache.kv_pool import PageAllocator, PoolShape
from jaxserve.cache.page_io import KVPageIO
from jaxserve.cache.radix_tree import RadixCache, path_pages
from jaxserve.cache.release_policy import PolicyMatch, RadixCacheStats, ReleasePolicy, ReleasePolicyConfig
from jaxserve.cache.storage import StorageConfig
from jaxserve.cache.storage_tier import StorageTier
from jaxserve.cache.window_pool import HybridPageAllocator
from jaxserve.core.request import CachedTokensDetails, Req


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The prefix cache of the engine: `page_size` tokens per page; the radix tree unless
    `disable_radix_cache`; its release policy (None: the radix tree is off) and storage tier (None: no
    `--hicache-storage-backend`)."""

    page_size: int
    disable_radix_cache: bool = False
    release_policy: ReleasePolicyConfig | None = None
    storage: StorageConfig | None = None


@dataclasses.dataclass
class WindowSpan:
    """A running request's window locks on the hybrid pool: it holds one on each page of its page table
    from `start`."""

    req: Req
    start: int


class CacheManager:
    """Owns page ownership for requests (see the module docstring)."""

    def __init__(
        self, allocator: PageAllocator, tree: RadixCache, page_size: int, policy: ReleasePolicy | None = None
    ):
        self.allocator = allocator
        self.tree = tree
        self.page_size = page_size
        self.policy = policy if not tree.disable else None
        self.num_evicted_tokens = 0
        # the hybrid sliding-window pool's allocator, or None when every layer keeps all its pages
        self.window_pages = allocator if isinstance(allocator, HybridPageAllocator) else None
        self._window_spans: dict[str, WindowSpan] = {}  # rid -> its window locks (hybrid pool only)
        # rid -> (lookup tokens, match) of a request matched but not run yet (for the hit rates)
        self._unadmitted: dict[str, tuple[int, PolicyMatch]] = {}

    @staticmethod
    def build(config: CacheConfig, allocator: PageAllocator, pool_shape: PoolShape, page_io: KVPageIO | None,
              storage_fingerprint: str | None = None) -> "CacheManager":
        """The radix tree, its release policy and storage tier over the runner's pool (`allocator`, its
        `pool_shape`). `page_io` copies whole pages for the host tier and copy-on-write (the runner; None
        over the hybrid window pool, whose pages lose their window parts: D-46); `storage_fingerprint`
        salts the storage tier's keys (everything that changes a page's KV bytes).

        Raises:
            StorageError (a ValueError): the storage directory cannot be written.
        """
        tree = RadixCache(page_size=config.page_size, disable=config.disable_radix_cache)
        policy = None
        if config.release_policy is not None:
            storage = None if config.storage is None else StorageTier.open(config.storage, pool_shape, storage_fingerprint)
            policy = ReleasePolicy(config.release_policy, tree, allocator, pool_shape, storage=storage)
            if page_io is not None:
                policy.attach_io(page_io)
        return CacheManager(allocator, tree, config.page_size, policy)

    # ---- capacity -------------------------------------------------------------------------------
    def available_tokens(self) -> int:
        """Tokens that could be allocated now: free pages plus what eviction could free. With the hybrid
        pool this is the full page space, which must hold a request's every token; the window space
        holds a request's window and its next chunk only, and is checked per step (`can_grow`)."""
        return (self.allocator.num_free * self.page_size if self.window_pages is None
                else self.window_pages.num_free_full * self.page_size) + self.tree.evictable_size()

    def window_available_pages(self) -> int:
        """Window pages a step could get (hybrid pool): every window page but those a running request's
        window reads (`window_locks`); the rest are free or droppable (`_drop_unread_windows`)."""
        wp = self.window_pages
        return wp.window.num_usable - int(np.count_nonzero(wp.window_locks))

    def used_tokens(self) -> int:
        return self.allocator.num_used * self.page_size

    def window_used_tokens(self) -> int | None:
        """With the hybrid pool: tokens of the window pages that running requests' windows read (their
        window locks), None without it. Window parts no window reads are left out, as the evictable
        prefix cache is left out of the full pool's usage: they are dropped when a step needs the space
        (`_drop_unread_windows`), as SGLang's SWA radix cache evicts its `swa_evictable_size`."""
        if self.window_pages is None:
            return None
        return int(np.count_nonzero(self.window_pages.window_locks)) * self.page_size

    def pages_needed(self, req: Req, new_kv_len: int) -> int:
        return max(0, -(-new_kv_len // self.page_size) - len(req.page_table))

    # ---- request lifecycle ----------------------------------------------------------------------
    def match(self, req: Req) -> int:
        """Reuse the longest cached prefix of `req.fill_ids` (at least one token is left to compute).

        Locks the matched path and sets `req.page_table`, `req.kv_len` and `req.match_tiers` (where the
        matched tokens came from). Returns the matched tokens.
        """
        assert not req.page_table and req.last_node is None
        key = _match_key(req)
        result = self.tree.match_prefix(key, req.namespace)
        self.tree.inc_lock_ref(result.last_node)
        req.last_node = result.last_node
        req.page_table = [int(p) for p in result.pages]
        req.kv_len = result.num_tokens
        req.match_tiers = CachedTokensDetails(device=result.num_tokens)
        if self.policy is not None:
            m = self.policy.extend_match(result, key, req.namespace, self.policy.take_prefetch(req.rid))
            req.last_node = m.last_node
            req.page_table = [int(p) for p in m.pages] + ([int(m.cow_page)] if m.cow_page is not None else [])
            req.kv_len = m.num_tokens + m.num_cow_tokens
            req.match_tiers = CachedTokensDetails(
                device=req.kv_len - m.num_host_tokens - m.num_storage_tokens,
                host=m.num_host_tokens,
                storage=m.num_storage_tokens if self.policy.storage is not None else None,
            )
            self._unadmitted[req.rid] = (len(key), m)
        if self.window_pages is not None:
            self._match_window(req, key)
        return req.kv_len

    def _match_window(self, req: Req, key: list[int]) -> None:
        """Cut a match back to its longest prefix whose window layers hold the last window (the next
        token reads it), and take the request's window locks."""
        usable = self._usable_prefix_pages(req.page_table)
        if usable < len(req.page_table):
            self.tree.dec_lock_ref(req.last_node)
            result = self.tree.match_prefix(key[: usable * self.page_size], req.namespace)
            self.tree.inc_lock_ref(result.last_node)
            req.last_node = result.last_node
            req.page_table = [int(p) for p in result.pages]
            req.kv_len = result.num_tokens
            req.match_tiers = CachedTokensDetails(device=result.num_tokens)
            if req.rid in self._unadmitted:
                lookup, m = self._unadmitted[req.rid]
                self._unadmitted[req.rid] = (lookup, m._replace(last_node=result.last_node, pages=result.pages,
                                                                num_tokens=result.num_tokens))
        span = WindowSpan(req, self._window_start(req.kv_len))
        self.window_pages.window_locks[req.page_table[span.start :]] += 1
        self._window_spans[req.rid] = span

    def _window_start(self, kv_len: int) -> int:
        """The first page the next token's window reads (it attends to positions > kv_len - window)."""
        return max(0, kv_len - self.window_pages.layout.window + 1) // self.page_size

    def _usable_prefix_pages(self, pages: list[int]) -> int:
        """The most leading pages of `pages` a match may keep: the pages covering their last window
        must all have window parts."""
        missing = np.concatenate([[0], np.cumsum(~self.window_pages.has_window(pages))])
        for k in range(len(pages), 0, -1):
            if missing[k] == missing[self._window_start(k * self.page_size)]:
                return k
        return 0

    def _advance_window(self, req: Req) -> None:
        """Unlock the pages `req`'s window has left; its private ones (past the part the tree holds)
        lose their window part, unless another request's window still reads them."""
        span = self._window_spans.get(req.rid)
        if span is None:
            return
        start = self._window_start(req.kv_len)
        if start <= span.start:
            return
        left = np.asarray(req.page_table[span.start : start], np.int64)
        locks = self.window_pages.window_locks
        locks[left] -= 1
        private = left[np.arange(span.start, start) >= path_len(req.last_node) // self.page_size]
        self.window_pages.drop_window(private[locks[private] == 0])
        span.start = start

    def _unlock_window(self, req: Req, from_page: int | None = None) -> None:
        """Release `req`'s window locks (those from page `from_page` on, when given)."""
        span = self._window_spans.get(req.rid)
        if span is None:
            return
        first = span.start if from_page is None else max(span.start, from_page)
        self.window_pages.window_locks[np.asarray(req.page_table[first:], np.int64)] -= 1
        if from_page is None:
            del self._window_spans[req.rid]

    def start_prefetch(self, req: Req) -> None:
        """A request entered the waiting queue: start reading its prefix from the storage tier, if any."""
        if self.policy is not None:
            self.policy.start_prefetch(req.rid, _match_key(req), req.namespace)

    def is_prefetch_ready(self, req: Req) -> bool:
        """Whether the storage prefetch policy lets `req` be admitted now."""
        return self.policy is None or self.policy.is_prefetch_ready(req.rid)

    def wait_prefetch(self, timeout_s: float) -> None:
        """Block up to `timeout_s` seconds for a waiting request's storage prefetch (no-op without one)."""
        if self.policy is not None:
            self.policy.wait_prefetch(timeout_s)

    def cancel_prefetch(self, req: Req) -> None:
        """A waiting request left the queue without being matched (aborted)."""
        if self.policy is not None:
            self.policy.take_prefetch(req.rid)

    def peek_prefix_len(self, req: Req) -> int:
        """Length of the cached prefix of `req` (host tier included) without locking it (for scheduling policies)."""
        result = self.tree.match_prefix(req.fill_ids[: len(req.fill_ids) - 1], req.namespace)
        if self.window_pages is not None:  # what `match` would keep of it
            return self._usable_prefix_pages([int(p) for p in result.pages]) * self.page_size
        return result.num_tokens + result.num_host_tokens

    def can_freeze(self, req: Req, num_new_tokens: int) -> bool:
        """Whether freezing `num_new_tokens` more prompt tokens of matched `req` fits the frozen-ratio cap."""
        if self.policy is None:
            return True
        return self.policy.can_freeze(num_new_tokens, path_len(req.last_node))

    def can_grow(self, num_pages: int) -> bool:
        """Whether `num_pages` new pages fit, after evicting (and, with the hybrid pool, dropping the
        window parts no window reads)."""
        if self.window_pages is not None and num_pages > self.window_available_pages():
            return False
        return num_pages * self.page_size <= self.available_tokens()

    def grow(self, req: Req, new_kv_len: int) -> bool:
        """Give `req` pages covering positions [0, new_kv_len). Evicts if needed; False if impossible.
        Called before every step of `req`: with the hybrid pool, the pages its window left are released
        first."""
        if self.window_pages is not None:
            self._advance_window(req)
        need = self.pages_needed(req, new_kv_len)
        if need == 0:
            return True
        if not self._reserve(need):
            return False
        pages = self.allocator.allocate(need)
        if self.window_pages is not None and req.rid in self._window_spans:
            self.window_pages.window_locks[pages] += 1
        req.page_table.extend(pages)
        return True

    def _reserve(self, num_pages: int) -> bool:
        wp = self.window_pages
        while not self.allocator.can_allocate(num_pages):
            if wp is not None and wp.num_free_full >= num_pages:
                # only the window space is short: drop window parts no window reads (whole pages stay)
                self._drop_unread_windows(num_pages - wp.window.num_free)
                break
            before = (self.allocator.num_free, self.tree.evictable_size())
            # the full space's shortage (evicting a page frees its window part too)
            short = num_pages - (self.allocator.num_free if wp is None else wp.num_free_full)
            used = self.allocator.num_used
            if self.policy is not None:
                self.allocator.free(self.policy.evict(short * self.page_size))
            else:
                self.allocator.free(self.tree.evict(short * self.page_size))
            self.num_evicted_tokens += (used - self.allocator.num_used) * self.page_size
            if (self.allocator.num_free, self.tree.evictable_size()) == before:
                break
        return self.allocator.can_allocate(num_pages)

    def _drop_unread_windows(self, num_pages: int) -> None:
        """Free `num_pages` window parts of tree pages that no running request's window reads (at least a
        sixteenth of the window space, so that a full window space does not sort the tree at every new
        page), least recently used nodes first (SGLang's SWA eviction: the tree keeps the pages; a later
        match is cut back to where the window parts remain)."""
        wp = self.window_pages
        num_pages = max(num_pages, wp.window.num_usable // 16)
        nodes = sorted((n for n in self.tree.iter_nodes() if n.is_on_device and len(n.pages)),
                       key=lambda n: n.last_access_time)
        for node in nodes:
            if num_pages <= 0:
                return
            pages = node.pages[(wp.window_page_of[node.pages] != 0) & (wp.window_locks[node.pages] == 0)][:num_pages]
            wp.drop_window(pages)
            num_pages -= len(pages)

    def truncate(self, req: Req) -> None:
        """Free the private pages past the ones covering [0, req.kv_len): speculative decoding's
        rollback of pages that held only rejected draft tokens."""
        keep = -(-req.kv_len // self.page_size)
        if len(req.page_table) > keep:
            if self.window_pages is not None:
                self._unlock_window(req, from_page=keep)
            self.allocator.free(req.page_table[keep:])
            del req.page_table[keep:]

    def cache_prefix(self, req: Req) -> None:
        """Insert the computed, page-aligned prefix of `req` into the tree and move its lock there."""
        if self.policy is not None and req.rid in self._unadmitted:
            self.policy.record_lookup(*self._unadmitted.pop(req.rid))
        self._insert(req, keep_tail=True)

    def release(self, req: Req) -> None:
        """On finish or retraction: insert the computed prefix, unlock, free all private pages."""
        self._unadmitted.pop(req.rid, None)
        if self.window_pages is not None:
            self._unlock_window(req)
        self._insert(req, keep_tail=False)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = None
        req.page_table = []
        req.kv_len = 0
        req.match_tiers = CachedTokensDetails()

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
        if self.window_pages is not None and len(result.duplicate_pages):
            self._window_to_tree_pages(req, path_pages(result.last_node)[:num_pages])
        self.allocator.free(result.duplicate_pages)
        if self.policy is not None:
            self.policy.on_insert(result, key, req.namespace)
        tail = req.page_table[num_pages:]
        if keep_tail:
            # the tree may hold other pages for the part it already had: switch to them
            assert path_len(result.last_node) == num_aligned, (path_len(result.last_node), num_aligned)
            self.tree.inc_lock_ref(result.last_node)
            self.tree.dec_lock_ref(req.last_node)
            req.last_node = result.last_node
            req.page_table = [int(p) for p in path_pages(result.last_node)] + tail
            return
        tail_key = req.fill_ids[num_aligned : req.kv_len]
        if tail and tail_key and self.policy is not None and self.policy.keep_tail(result.last_node, tail_key, req.namespace):
            kept = self.tree.insert_tail(result.last_node, tail_key, tail[0], req.namespace)
            self.allocator.free(kept.duplicate_pages)
            tail = tail[1:]
        self.allocator.free(tail)

    def _window_to_tree_pages(self, req: Req, tree_pages: np.ndarray) -> None:
        """The tree holds other pages than `req`'s for some of its tokens (they are freed next): move
        `req`'s window locks there, and a window part where the tree's page has none."""
        wp, span = self.window_pages, self._window_spans.get(req.rid)
        for i, (ours, theirs) in enumerate(zip(req.page_table, tree_pages)):
            if ours == theirs:
                continue
            if span is not None and i >= span.start:
                wp.window_locks[ours] -= 1
                wp.window_locks[theirs] += 1
            if wp.window_page_of[ours] and not wp.window_page_of[theirs]:
                wp.move_window(ours, int(theirs))

    # ---- maintenance and visibility -------------------------------------------------------------
    def on_schedule(self, num_running: int) -> None:
        """Once per scheduler iteration: the release policy's lightweight check."""
        if self.policy is not None:
            self.policy.on_schedule(num_running)

    @property
    def release_mode(self) -> str:
        """The release policy's adaptive mode ("off" without a policy)."""
        return self.policy.mode.value if self.policy is not None else "off"

    def radix_cache_stats(self, live_reqs) -> RadixCacheStats | None:
        """The release policy's stats snapshot (None without a policy); `live_reqs` are the running
        requests, whose private pages count in the block utilization."""
        if self.policy is None:
            return None
        private = sum(r.kv_len - path_len(r.last_node) for r in live_reqs if r.last_node is not None)
        return self.policy.stats(private)

    def flush(self) -> None:
        """Drop every cached prefix, on both tiers. Raises RuntimeError while any prefix is locked."""
        self.allocator.free(self.policy.flush() if self.policy is not None else self.tree.reset())

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
        free = set(self.allocator.free_pages())
        assert not free & set(owners), f"pages both free and owned: {sorted(free & set(owners))[:10]}"
        total = len(free) + len(owners)
        assert total == self.allocator.num_pages - 1, f"{self.allocator.num_pages - 1 - total} pages leaked"
        if self.window_pages is not None:
            self._check_window_integrity(live_reqs)
        host = self.policy.host if self.policy is not None else None
        if host is not None:
            held = sum(len(n.host_pages) for n in self.tree.iter_nodes() if not n.is_on_device)
            assert held == host.num_used, f"host tier: {host.num_used} pages used, the tree holds {held}"


    def _check_window_integrity(self, live_reqs) -> None:
        """Assert: the window locks are exactly the live requests' spans, and every page a running
        request's window reads has its window part."""
        wp = self.window_pages
        wp.check_integrity()
        expected = np.zeros_like(wp.window_locks)
        for req in live_reqs:
            span = self._window_spans.get(req.rid)
            if span is None:
                assert not req.page_table, f"request {req.rid} holds pages without a window span"
                continue
            assert span.start <= self._window_start(req.kv_len) or req.kv_len == 0, (req.rid, span, req.kv_len)
            np.add.at(expected, np.asarray(req.page_table[span.start :], np.int64), 1)
        assert (expected == wp.window_locks).all(), (
            f"window locks differ from the requests' spans at pages {np.flatnonzero(expected != wp.window_locks)[:10]}")
        locked = np.flatnonzero(wp.window_locks)
        assert wp.has_window(locked).all(), f"pages a window reads without a window part: {locked[~wp.has_window(locked)][:10]}"


def _match_key(req: Req) -> list[int]:
    """The tokens of `req` whose KV a match may reuse: at least one is left to compute, and with input
    logprobs the positions from logprob_start_len - 1 on must be computed."""
    key = req.fill_ids[: len(req.fill_ids) - 1]
    if req.wants_input_logprobs:
        key = key[: max(0, req.logprob_start_len - 1)]
    return key
