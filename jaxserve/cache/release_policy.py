"""The KV release policy: the stages beside the radix tree, composed (DESIGN.md, "Radix cache and
release policy").

    stage 1  freezing        jaxserve/cache/freezing.py      locked prefixes are read-only; frozen-ratio admission cap
    stage 2  soft release    jaxserve/cache/soft_release.py  cold nodes to the host tier; recall on match
    stage 3  coalescing      jaxserve/cache/coalescing.py    copy-on-write of partly matched pages, short
                                                             tails kept, path compression
    stage 4  adaptive        jaxserve/cache/adaptive.py      conservative / balanced / aggressive by batch size
    storage                  jaxserve/cache/storage_tier.py  pages below the host tier, in files: prefetch while
                                                             a request waits, backup by the write policy

`ReleasePolicy` is what the engine's cache manager calls: `reserve` (pages, evicting soft-first),
`extend_match` (recall + copy-on-write after a tree match), `keep_tail`, `can_freeze`, `on_schedule`
(once per scheduler iteration: finish copies, sample hits, proactive release, merging, the mode, the
stats log) and `stats`. Every knob changes where KV lives, never what a request computes: a recalled or
copied page holds the same bytes as the page it came from.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Hashable, NamedTuple, Sequence

import numpy as np
from jaxtyping import Int32

from jaxserve.cache import coalescing
from jaxserve.cache.adaptive import ReleaseMode, choose_mode
from jaxserve.cache.freezing import FreezeBudget
from jaxserve.cache.host_pool import HostKVPool, num_host_pages
from jaxserve.cache.kv_pool import PageAllocator, PoolShape
from jaxserve.cache.page_io import KVPageIO
from jaxserve.cache.radix_tree import InsertResult, MatchResult, RadixCache, TreeNode, path_pages, path_tokens
from jaxserve.cache.soft_release import SoftRelease
from jaxserve.cache.storage import Prefetch, StorageOp
from jaxserve.cache.storage_tier import StorageTier

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 1.0
MERGE_INTERVAL_S = 1.0


@dataclasses.dataclass(frozen=True)
class ReleasePolicyConfig:
    """Knobs of the release policy; fields mirror the `--radix-cache-*`, `--hicache-*`, `--merge-*`
    and `--release-*` flags (see `ServerArgs` for their help)."""

    max_frozen_ratio: float = 0.9
    enable_host_tier: bool = False
    hicache_ratio: float = 2.0
    hicache_size_gb: float = 0.0
    soft_free_threshold_s: float = 3.0
    evict_threshold: float = 0.8
    hit_window_s: float = 10.0
    sample_period_s: float = 1.0
    enable_coalescing: bool = False
    merge_max_suffix_tokens: int = 8
    merge_min_shared_ratio: float = 0.6
    conservative_batch_size: int = 8
    aggressive_batch_size: int = 16
    enable_stats_log: bool = False


@dataclasses.dataclass(frozen=True)
class RadixCacheStats:
    """A snapshot of the radix cache and its release policy (exported as `jaxserve_radix_cache_*`).

    Counts are nodes, tokens, pages ("blocks") or bytes as named; cumulative fields say so.
    `recall_latency_s` holds the latest (up to 1024) recall latencies in seconds, the time to issue the
    host -> device copy (the device finishes it before the next step); `num_recalls` is cumulative, so an
    exporter observes the last `num_recalls - seen` entries. `storage_prefetch_ops` and
    `storage_backup_ops` hold the storage tier's latest operations in the same way (cumulative counts
    `storage_num_prefetch_ops`, `storage_num_backup_ops`).
    """

    mode: str
    nodes_total: int
    shared_nodes: int  # matched by a request besides the one that inserted them (hit_count >= 1)
    shared_ratio: float
    frozen_nodes: int  # locked
    frozen_tokens: int
    soft_freed_nodes: int  # host-resident now
    soft_freed_bytes: int  # cumulative, device -> host
    recalled_bytes: int  # cumulative, host -> device
    num_recalls: int
    recall_latency_s: tuple[float, ...]
    merge_count: int  # cumulative
    eviction_count: int  # cumulative nodes dropped for good (device drops + host tier drops)
    hit_rate: float  # cached / looked-up tokens over admitted lookups, host and copy-on-write hits included
    host_hit_rate: float  # the part of hit_rate recalled from the host tier
    lookup_tokens: int  # cumulative
    cached_hit_tokens: int  # cumulative, all tiers
    host_hit_tokens: int  # cumulative
    cow_hit_tokens: int  # cumulative, reused by copy-on-write of a partly matched page
    num_blocks_used: int  # device pages allocated
    num_blocks_total: int
    block_utilization: float  # used token slots / slots of allocated pages
    cached_tokens_device: int
    cached_tokens_host: int
    host_blocks_used: int
    host_blocks_total: int
    num_frozen_waits: int  # cumulative admissions deferred by the frozen ratio
    has_storage_tier: bool = False
    storage_hit_tokens: int = 0  # cumulative, recalled from the storage tier
    storage_prefetch_hit_tokens: int = 0  # cumulative, tokens prefetches found in storage before reading
    storage_prefetched_tokens: int = 0  # cumulative, tokens of the verified pages read (SGLang's prefetched)
    storage_backuped_tokens: int = 0  # cumulative, tokens of the page files this process wrote
    storage_hit_rate: float = 0.0  # the part of hit_rate recalled from the storage tier
    storage_bytes_read: int = 0  # cumulative, verified page files read
    storage_bytes_written: int = 0  # cumulative, page files written by this process
    storage_pages_backed_up: int = 0  # cumulative, pages handed to the writer
    storage_pages_dropped: int = 0  # cumulative, pages not written because the write queue was full
    storage_backup_dropped_tokens: int = 0  # the same in tokens
    storage_pages_failed: int = 0  # cumulative, pages whose write failed (tried again by a later backup)
    storage_prefetch_waits: int = 0  # cumulative, requests the prefetch policy held in the queue
    storage_prefetch_wait_s: float = 0.0  # cumulative seconds they were held
    storage_files_evicted: int = 0  # cumulative, by this process's bound enforcement
    storage_bad_files: int = 0  # cumulative, truncated / corrupted / foreign files met (misses)
    storage_prefetch_ops: tuple[StorageOp, ...] = ()  # the latest prefetches that read pages
    storage_num_prefetch_ops: int = 0  # cumulative
    storage_backup_ops: tuple[StorageOp, ...] = ()  # the latest write batches that wrote pages
    storage_num_backup_ops: int = 0  # cumulative


class PolicyMatch(NamedTuple):
    """A match after the policy extended it.

    Attributes:
        last_node: the deepest device node of the match, locked by the caller (the lock moved here).
        pages: tree page ids of the matched prefix (`num_tokens // page_size` pages).
        num_tokens: matched tokens in tree pages (device + recalled).
        num_host_tokens: of those, recalled from the host tier.
        num_storage_tokens: of those, read from the storage tier.
        cow_page: a fresh private page holding `num_cow_tokens` more matched tokens, or None.
        num_cow_tokens: tokens reused by copy-on-write past `num_tokens`.
    """

    last_node: TreeNode
    pages: Int32[np.ndarray, " P"]
    num_tokens: int
    num_host_tokens: int
    cow_page: int | None
    num_cow_tokens: int
    num_storage_tokens: int = 0


class ReleasePolicy:
    """The release policy over one tree and allocator (see the module docstring).

    Args:
        config: the knobs.
        tree: the radix cache (not disabled).
        allocator: the device page allocator.
        pool_shape: the device pool's shape (host tier layout, frozen budget).
        time_fn: clock in seconds; defaults to the tree's (inject a fake clock in tests).
        storage: the storage tier below the host tier (None: none).

    Call `attach_io` with the device page I/O (the model runner) before serving when the host tier,
    the storage tier or coalescing is on. Not thread-safe: the engine loop owns it; `stats()` only reads.
    """

    def __init__(
        self,
        config: ReleasePolicyConfig,
        tree: RadixCache,
        allocator: PageAllocator,
        pool_shape: PoolShape,
        time_fn: Callable[[], float] | None = None,
        storage: StorageTier | None = None,
    ):
        self.config = config
        self.tree = tree
        self.allocator = allocator
        self.page_size = tree.page_size
        self.time_fn = time_fn or tree.time_fn
        self.io: KVPageIO | None = None
        self.freeze = FreezeBudget(tree, pool_shape.num_tokens, config.max_frozen_ratio)
        self.host: HostKVPool | None = None
        self.soft: SoftRelease | None = None
        if config.enable_host_tier:
            self.host = HostKVPool(pool_shape, num_host_pages(pool_shape, config.hicache_ratio, config.hicache_size_gb))
            logger.info("host KV tier: %d tokens (%d pages, %.2f GiB of host memory) by %s", self.host.num_pages *
                        pool_shape.page_size, self.host.num_pages, self.host.num_pages * self.host.bytes_per_page / 2**30,
                        f"--hicache-size {config.hicache_size_gb:g}" if config.hicache_size_gb > 0 else f"--hicache-ratio {config.hicache_ratio:g}")
            self.soft = SoftRelease(
                tree, allocator, self.host, config.soft_free_threshold_s, config.hit_window_s, config.sample_period_s
            )
        self.storage = storage
        if self.soft is not None and storage is not None and storage.write_policy == "write_back":
            self.soft.on_drop = self._write_back
        self.mode = ReleaseMode.CONSERVATIVE
        self.num_merges = 0
        self.num_drops = 0
        self.lookup_tokens = self.cached_hit_tokens = self.host_hit_tokens = self.cow_hit_tokens = 0
        self.storage_hit_tokens = 0
        self._last_merge = self._last_log = -float("inf")

    def attach_io(self, io: KVPageIO) -> None:
        """Give the policy its device page I/O (the model runner owns the device pools)."""
        self.io = io
        if self.soft is not None:
            self.soft.io = io
        if self.storage is not None:
            self.storage.io = io

    @property
    def has_host_tier(self) -> bool:
        return self.soft is not None and self.io is not None

    @property
    def can_copy_on_write(self) -> bool:
        return self.config.enable_coalescing and self.io is not None

    # Capacity

    def reserve(self, num_pages: int) -> bool:
        """Make `num_pages` device pages free, evicting (soft-free first) if needed."""
        short = num_pages - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.evict(short * self.page_size))
        return self.allocator.can_allocate(num_pages)

    def evict(self, num_tokens: int) -> Int32[np.ndarray, " F"]:
        """Free at least `num_tokens` device tokens, LRU first; returns device pages to free."""
        if self.has_host_tier:
            return self.soft.evict(num_tokens)
        return self.tree.evict(num_tokens, offload=self._count_drop)

    def _count_drop(self, node: TreeNode) -> None:
        if not node.children:
            self.num_drops += 1
            if self.storage is not None and self.storage.write_policy == "write_back":
                self._write_back(node)
        return None

    def _write_back(self, node: TreeNode) -> None:
        """write_back: a node leaves its last tier; its whole pages go to storage (the tree still holds it)."""
        if self.tree.is_tail(node) or node.parent is None:
            return
        tokens = path_tokens(node)
        first_page = (len(tokens) - len(node.key)) // self.page_size
        if node.is_on_device:
            self.storage.backup(tokens, node.namespace, node.pages, first_page)
        else:
            self.soft.finish_pending()
            k, v = self.host.read(node.host_pages)
            self.storage.backup_host(tokens, node.namespace, first_page, k, v)

    def can_freeze(self, num_new_tokens: int, num_own_locked_tokens: int) -> bool:
        """Stage 1 admission check (see `FreezeBudget.can_freeze`)."""
        return self.freeze.can_freeze(num_new_tokens, num_own_locked_tokens)

    # Matching

    def extend_match(
        self, result: MatchResult, key: Sequence[int], namespace: Hashable = None, prefetch: Prefetch | None = None
    ) -> PolicyMatch:
        """Recall the host-resident continuation of `result`, then the pages `prefetch` read from storage
        past it, and copy a partly matched page.

        The caller holds one lock on `result.last_node`; it moves to the returned `last_node`. A copied
        page (`cow_page`) is the caller's private page: it must free it like any other.
        """
        last_node, pages, num_tokens, num_host = result.last_node, result.pages, result.num_tokens, 0
        is_host_recalled = not result.host_nodes
        if result.host_nodes and self.has_host_tier:
            restored = self.soft.recall(result.host_nodes, self.reserve)
            if restored:
                self.tree.inc_lock_ref(restored[-1])
                self.tree.dec_lock_ref(last_node)
                last_node = restored[-1]
                pages = np.concatenate([pages] + [n.pages for n in restored])
                num_host = sum(len(n.key) for n in restored)
                num_tokens += num_host
            is_host_recalled = len(restored) == len(result.host_nodes)
        if self.storage is not None and self.storage.write_policy == "write_through_selective" and num_tokens:
            self.storage.backup(key[:num_tokens], namespace, pages)  # a reused prefix is worth keeping
        num_storage = 0
        if prefetch is not None and is_host_recalled and self.io is not None:
            last_node, pages, num_storage = self._recall_storage(prefetch, last_node, pages, key, namespace)
            num_tokens += num_storage
        cow_page, num_cow = None, 0
        if self.can_copy_on_write and num_tokens < len(key):
            partial = coalescing.find_partial_page(self.tree, last_node, key, num_tokens, namespace)
            if partial is not None:
                self.tree.inc_lock_ref(partial.node)  # keep the source page while a page is freed
                if self.reserve(1):
                    cow_page = self.allocator.allocate(1)[0]
                    self.io.copy_pages(np.asarray([partial.page], np.int32), np.asarray([cow_page], np.int32))
                    num_cow = partial.num_tokens
                    partial.node.hit_count += 1  # a partial match is a use: the node is shared
                self.tree.dec_lock_ref(partial.node)
        return PolicyMatch(last_node, pages, num_tokens, num_host, cow_page, num_cow, num_storage)

    def _recall_storage(
        self, prefetch: Prefetch, last_node: TreeNode, pages: np.ndarray, key: Sequence[int], namespace: Hashable
    ) -> tuple[TreeNode, np.ndarray, int]:
        """Write the prefetched pages that continue the match at `last_node` into fresh device pages and
        insert them into the tree; the caller's lock moves to the new last node. Returns (last node, pages
        of the whole match, tokens added)."""
        ps = self.page_size
        start = len(pages)  # the match's next page
        skip = start - prefetch.first_page
        num_pages = min(prefetch.num_pages_ready, len(key) // ps - prefetch.first_page) - skip
        if skip < 0 or num_pages <= 0:
            return last_node, pages, 0
        self.reserve(num_pages)
        num_pages = min(num_pages, self.allocator.num_free)
        if num_pages <= 0:
            return last_node, pages, 0
        new_pages = np.asarray(self.allocator.allocate(num_pages), np.int32)
        read = prefetch.pages[skip : skip + num_pages]
        k = np.stack([kv[0] for kv in read], axis=1)  # [L, n, KVH, ps, D]
        v = np.stack([kv[1] for kv in read], axis=1)
        self.io.write_pages(new_pages, k, v)
        end = (start + num_pages) * ps
        all_pages = np.concatenate([pages, new_pages]).astype(np.int32)
        inserted = self.tree.insert(key[:end], all_pages, namespace)
        self.allocator.free(inserted.duplicate_pages)
        self.on_insert(inserted)
        self.tree.inc_lock_ref(inserted.last_node)
        self.tree.dec_lock_ref(last_node)
        return inserted.last_node, path_pages(inserted.last_node), num_pages * ps

    def record_lookup(self, num_lookup_tokens: int, match: PolicyMatch) -> None:
        """Count an admitted request's lookup for the hit rates."""
        self.lookup_tokens += num_lookup_tokens
        self.cached_hit_tokens += match.num_tokens + match.num_cow_tokens
        self.host_hit_tokens += match.num_host_tokens
        self.cow_hit_tokens += match.num_cow_tokens
        self.storage_hit_tokens += match.num_storage_tokens

    def keep_tail(self, parent: TreeNode, tail_key: Sequence[int], namespace: Hashable = None) -> bool:
        """Stage 3: whether a released request's partial last page stays in the tree."""
        return self.config.enable_coalescing and coalescing.should_keep_tail(
            self.tree, parent, tail_key, self.config.merge_max_suffix_tokens,
            self.config.merge_min_shared_ratio, namespace,
        )

    def on_insert(self, result: InsertResult, key: Sequence[int] | None = None, namespace: Hashable = None) -> None:
        """After `tree.insert(key, ...)`: free host copies the tree dropped because the insert brought their
        nodes back to the device, and (write_through, given the key) back the key's pages up to storage."""
        if len(result.freed_host_pages):
            self.soft.free_host_pages(result.freed_host_pages)
        if key is not None and len(key) and self.storage is not None and self.storage.write_policy == "write_through":
            self.storage.backup(key, namespace, path_pages(result.last_node))

    # Storage prefetch (the scheduler asks while a request waits)

    def start_prefetch(self, rid: str, key: Sequence[int], namespace: Hashable = None) -> None:
        """Start reading the storage pages of `key` (a waiting request's match key) past what the device
        and host tiers hold."""
        if self.storage is None:
            return
        # a read-only probe: a prefetch deciding where to start is not a use of the cached prefix
        self.storage.start_prefetch(rid, key, namespace, self.tree.cached_prefix_len(key, namespace))

    def is_prefetch_ready(self, rid: str) -> bool:
        return self.storage is None or self.storage.is_ready(rid)

    def wait_prefetch(self, timeout_s: float) -> None:
        if self.storage is not None:
            self.storage.wait_any(timeout_s)

    def take_prefetch(self, rid: str) -> Prefetch | None:
        return self.storage.take_prefetch(rid) if self.storage is not None else None

    # Once per scheduler iteration

    def on_schedule(self, num_running: int) -> None:
        """The per-iteration check: mode, pending copies, hit sampling, proactive release, merging, log."""
        cfg = self.config
        now = self.time_fn()
        self.mode = choose_mode(num_running, cfg.conservative_batch_size, cfg.aggressive_batch_size)
        if self.soft is not None:
            self.soft.finish_pending()
            if self.soft.is_sample_due(now):
                self.soft.sample(now)
                excess = self.allocator.num_usable - self.allocator.num_free - int(cfg.evict_threshold * self.allocator.num_usable)
                if self.has_host_tier and self.mode.allows_proactive_release and excess > 0:
                    self.soft.release_cold(now, excess)
        if cfg.enable_coalescing and self.mode.allows_merge and now - self._last_merge >= MERGE_INTERVAL_S:
            self._last_merge = now
            num_merges = coalescing.merge_chains(self.tree)
            self.num_merges += num_merges
            if num_merges and self.soft is not None:
                self.soft.rebuild_host_heap()
        if cfg.enable_stats_log and now - self._last_log >= STATS_LOG_INTERVAL_S:
            self._last_log = now
            self.log_stats()

    def log_stats(self) -> None:
        nodes = shared = frozen = host = 0
        for node in self.tree.iter_nodes():
            nodes += 1
            shared += node.hit_count >= 1
            frozen += node.lock_ref > 0
            host += not node.is_on_device
        line = "[RadixCache] Nodes: %d, Shared: %d (%.1f%%), Frozen: %d, SoftFreed: %d, Merged: %d"
        values = [nodes, shared, 100.0 * shared / max(nodes, 1), frozen, host, self.num_merges]
        if self.storage is not None:
            c = self.storage.storage.snapshot()[0]
            line += ", Storage hits: %d tokens, read: %d B, written: %d B, prefetch waits: %d, files evicted: %d"
            values += [self.storage_hit_tokens, c.bytes_read, c.bytes_written, self.storage.num_prefetch_waits,
                       c.files_evicted]
        logger.info(line, *values)

    # Visibility

    def stats(self, num_private_tokens: int = 0) -> RadixCacheStats:
        """A snapshot (O(nodes)).

        Args:
            num_private_tokens: tokens the running requests hold in private pages (past their tree
                prefix), for `block_utilization`.
        """
        nodes = shared = frozen = host_nodes = 0
        for node in self.tree.iter_nodes():
            nodes += 1
            shared += node.hit_count >= 1
            frozen += node.lock_ref > 0
            host_nodes += not node.is_on_device
        used_pages = self.allocator.num_usable - self.allocator.num_free
        used_slots = self.tree.total_size() + num_private_tokens
        soft, host = self.soft, self.host
        bytes_per_page = host.bytes_per_page if host is not None else 0
        return RadixCacheStats(
            mode=self.mode.value,
            nodes_total=nodes,
            shared_nodes=shared,
            shared_ratio=shared / nodes if nodes else 0.0,
            frozen_nodes=frozen,
            frozen_tokens=self.tree.protected_size(),
            soft_freed_nodes=host_nodes,
            soft_freed_bytes=soft.num_soft_freed_pages * bytes_per_page if soft else 0,
            recalled_bytes=soft.num_recalled_pages * bytes_per_page if soft else 0,
            num_recalls=soft.num_recalls if soft else 0,
            recall_latency_s=tuple(soft.recall_latencies_s) if soft else (),
            merge_count=self.num_merges,
            eviction_count=self.num_drops + (soft.num_device_drops + soft.num_host_drops if soft else 0),
            hit_rate=self.cached_hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
            host_hit_rate=self.host_hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
            lookup_tokens=self.lookup_tokens,
            cached_hit_tokens=self.cached_hit_tokens,
            host_hit_tokens=self.host_hit_tokens,
            cow_hit_tokens=self.cow_hit_tokens,
            num_blocks_used=used_pages,
            num_blocks_total=self.allocator.num_usable,
            block_utilization=used_slots / (used_pages * self.page_size) if used_pages else 1.0,
            cached_tokens_device=self.tree.total_size(),
            cached_tokens_host=self.tree.host_size(),
            host_blocks_used=host.num_used if host else 0,
            host_blocks_total=host.num_pages if host else 0,
            num_frozen_waits=self.freeze.num_waits,
            **self._storage_stats(),
        )

    def _storage_stats(self) -> dict:
        if self.storage is None:
            return {}
        c, prefetch_ops, backup_ops = self.storage.storage.snapshot()
        return dict(
            has_storage_tier=True,
            storage_hit_tokens=self.storage_hit_tokens,
            storage_prefetch_hit_tokens=c.prefetch_hit_pages * self.page_size,
            storage_prefetched_tokens=c.pages_read * self.page_size,
            storage_backuped_tokens=c.pages_written * self.page_size,
            storage_hit_rate=self.storage_hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
            storage_bytes_read=c.bytes_read,
            storage_bytes_written=c.bytes_written,
            storage_pages_backed_up=self.storage.num_backup_pages,
            storage_pages_dropped=c.pages_dropped,
            storage_backup_dropped_tokens=c.pages_dropped * self.page_size,
            storage_pages_failed=c.pages_failed,
            storage_prefetch_waits=self.storage.num_prefetch_waits,
            storage_prefetch_wait_s=self.storage.prefetch_wait_s,
            storage_files_evicted=c.files_evicted,
            storage_bad_files=c.bad_files,
            storage_prefetch_ops=prefetch_ops,
            storage_num_prefetch_ops=c.num_prefetch_ops,
            storage_backup_ops=backup_ops,
            storage_num_backup_ops=c.num_backup_ops,
        )

    def flush(self) -> Int32[np.ndarray, " F"]:
        """Empty the tree and the host tier (the storage tier's files stay: other processes share them and
        a restart reads them). Returns the device pages to free.

        Raises:
            RuntimeError: if any node is locked.
        """
        pages = self.tree.reset()
        if self.soft is not None:
            self.soft.reset()
        if self.storage is not None:
            self.storage.reset()
        return pages

    def close(self) -> None:
        """Finish the storage tier's queued writes and stop its threads."""
        if self.storage is not None:
            self.storage.close()

