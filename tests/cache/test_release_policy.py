"""The KV release policy's stages with a fake clock and numpy pools (no model).

KV contents are synthetic: the K of token t at position p in layer l is `kv_value(t, p, l)` and V is its
negation, so every test can check that a page (on the device, in the host tier, after a recall or a
copy-on-write) holds exactly the bytes computed for the tokens the tree says it holds.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.cache import coalescing
from jaxserve.cache.adaptive import ReleaseMode, choose_mode
from jaxserve.cache.freezing import FreezeBudget, frozen_write_violations, path_len
from jaxserve.cache.host_pool import HostKVPool, num_host_pages
from jaxserve.cache.kv_pool import PageAllocator, PoolShape
from jaxserve.cache.page_io import NumpyKVPages
from jaxserve.cache.radix_tree import RadixCache
from jaxserve.cache.release_policy import ReleasePolicy, ReleasePolicyConfig
from jaxserve.engine.config import EngineConfig

NUM_LAYERS = 2


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def kv_value(tokens, positions, layer):
    return np.asarray(tokens, np.float32) * 4096 + np.asarray(positions, np.float32) + 0.5 * layer


def write_kv(io: NumpyKVPages, page_table, tokens, start: int, end: int, page_size: int) -> None:
    """'Compute' K/V of positions [start, end) of `tokens` into the pages of `page_table`."""
    for pos in range(start, end):
        page, slot = page_table[pos // page_size], pos % page_size
        for layer in range(NUM_LAYERS):
            io.k[layer, page, :, slot] = kv_value(tokens[pos], pos, layer)
            io.v[layer, page, :, slot] = -kv_value(tokens[pos], pos, layer)


def node_tokens(node):
    """(tokens before node, node tokens)."""
    parts = []
    n = node.parent
    while n is not None and n.parent is not None:
        parts.append(n.key)
        n = n.parent
    before = tuple(t for part in reversed(parts) for t in part)
    return before, node.key


def assert_kv_of_node(h, node) -> None:
    before, key = node_tokens(node)
    ps = h.tree.page_size
    if node.is_on_device:
        k, v, pages = h.io.k, h.io.v, node.pages
    else:
        k, v, pages = h.policy.host.k, h.policy.host.v, node.host_pages
    for i, t in enumerate(key):
        pos = len(before) + i
        page, slot = int(pages[i // ps]), i % ps
        for layer in range(NUM_LAYERS):
            assert k[layer, page, 0, slot, 0] == kv_value(t, pos, layer), (node, pos, "K")
            assert v[layer, page, 0, slot, 0] == -kv_value(t, pos, layer), (node, pos, "V")


def assert_all_kv(h) -> None:
    if h.policy.soft is not None:
        h.policy.soft.finish_pending()
    for node in h.tree.iter_nodes():
        assert_kv_of_node(h, node)


@dataclasses.dataclass
class Harness:
    clock: FakeClock
    tree: RadixCache
    allocator: PageAllocator
    io: NumpyKVPages
    policy: ReleasePolicy

    def insert(self, tokens, namespace=None):
        """A request that computed `tokens` (page-aligned part) and released them into the tree."""
        ps = self.tree.page_size
        n = len(tokens) // ps * ps
        assert self.policy.reserve(n // ps)
        pages = self.allocator.allocate(n // ps)
        write_kv(self.io, pages, tokens, 0, n, ps)
        result = self.tree.insert(tokens[:n], pages, namespace)
        self.allocator.free(result.duplicate_pages)
        self.policy.on_insert(result)
        return result.last_node


def make_harness(
    page_size=2, num_pages=17, host_ratio=2.0, host=True, coalescing_on=False, **overrides
) -> Harness:
    clock = FakeClock()
    tree = RadixCache(page_size, time_fn=clock)
    shape = PoolShape(NUM_LAYERS, num_pages, page_size, 1, 1, "float32")
    allocator = PageAllocator(num_pages)
    io = NumpyKVPages(shape)
    knobs = dict(conservative_batch_size=0, aggressive_batch_size=0, evict_threshold=0.0)
    knobs.update(overrides)
    config = ReleasePolicyConfig(
        enable_host_tier=host, hicache_ratio=host_ratio, enable_coalescing=coalescing_on, **knobs
    )
    policy = ReleasePolicy(config, tree, allocator, shape)
    policy.attach_io(io)
    return Harness(clock, tree, allocator, io, policy)


def used_pages(h) -> int:
    return h.allocator.num_usable - h.allocator.num_free


# Stage 2: soft release and recall


def test_soft_release_after_exactly_the_threshold():
    h = make_harness(soft_free_threshold_s=3.0)
    leaf = h.insert([1, 2, 3, 4, 5, 6])
    for t in (0.0, 1.0, 2.0, 2.999):
        h.clock.now = t
        h.policy.on_schedule(num_running=0)
        assert leaf.is_on_device, f"released at t={t}"
    h.clock.now = 3.0
    h.policy.on_schedule(num_running=0)
    assert not leaf.is_on_device and len(leaf.host_pages) == 3
    assert used_pages(h) == 0 and h.tree.host_size() == 6 and h.tree.total_size() == 0
    h.tree.check_integrity()
    assert_all_kv(h)


def test_hit_resets_the_idle_time():
    h = make_harness(soft_free_threshold_s=3.0)
    leaf = h.insert([1, 2, 3, 4])
    h.clock.now = 2.0
    h.tree.match_prefix([1, 2, 3, 4])
    h.clock.now = 4.0
    h.policy.on_schedule(0)
    assert leaf.is_on_device
    h.clock.now = 5.0
    h.policy.on_schedule(0)
    assert not leaf.is_on_device


def test_recall_restores_the_same_kv_bytes():
    h = make_harness(soft_free_threshold_s=0.0)
    h.insert([1, 2, 3, 4, 5, 6, 7, 8])
    before = {}
    for node in h.tree.iter_nodes():
        before[node.key] = (h.io.k[:, node.pages].copy(), h.io.v[:, node.pages].copy())
    h.policy.on_schedule(0)
    assert h.tree.total_size() == 0 and h.tree.host_size() == 8
    h.io.k[:] = 0  # the device pages are reused by others meanwhile
    h.io.v[:] = 0
    result = h.tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert result.num_tokens == 0 and result.num_host_tokens == 8
    h.tree.inc_lock_ref(result.last_node)
    match = h.policy.extend_match(result, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert match.num_tokens == 8 and match.num_host_tokens == 8
    assert match.last_node.is_on_device and match.last_node.lock_ref == 1
    (node,) = h.tree.iter_nodes()
    np.testing.assert_array_equal(h.io.k[:, node.pages], before[node.key][0])
    np.testing.assert_array_equal(h.io.v[:, node.pages], before[node.key][1])
    assert h.policy.host.num_used == 0
    h.tree.dec_lock_ref(match.last_node)
    stats = h.policy.stats()
    assert stats.recalled_bytes == 4 * h.policy.host.bytes_per_page and stats.num_recalls == 1
    assert stats.soft_freed_bytes == 4 * h.policy.host.bytes_per_page
    h.tree.check_integrity()


def test_partial_recall_when_the_pool_is_short():
    h = make_harness(num_pages=5, soft_free_threshold_s=0.0)  # 4 usable pages
    h.insert([1, 1, 2, 2])
    h.tree.match_prefix([1, 1, 3, 3])  # splits [1 1 | 2 2]
    h.insert([1, 1, 3, 3])
    h.policy.on_schedule(0)
    assert h.tree.host_size() == 6
    locked = h.insert([9, 9, 8, 8, 7, 7])
    h.tree.inc_lock_ref(locked)  # 3 of 4 pages locked: room to recall one page only
    result = h.tree.match_prefix([1, 1, 2, 2, 5])
    h.tree.inc_lock_ref(result.last_node)
    match = h.policy.extend_match(result, [1, 1, 2, 2, 5])
    assert match.num_tokens == 2 and match.num_host_tokens == 2
    h.tree.check_integrity()
    assert_all_kv(h)


def test_pressure_eviction_soft_frees_before_dropping():
    h = make_harness(num_pages=5, soft_free_threshold_s=100.0)
    a = h.insert([1, 1, 2, 2])
    h.clock.now = 1
    b = h.insert([3, 3, 4, 4])
    h.clock.now = 2
    assert h.allocator.num_free == 0
    assert h.policy.reserve(2)
    assert not a.is_on_device and b.is_on_device  # LRU went to the host tier, kept in the tree
    assert h.tree.host_size() == 4 and h.policy.stats().eviction_count == 0
    assert_all_kv(h)
    h.tree.check_integrity()


def test_host_tier_full_drops_lru():
    h = make_harness(num_pages=5, host_ratio=0.5)  # 4 device pages, 2 host pages
    assert h.policy.host.num_pages == 2
    first = h.insert([1, 1, 2, 2])
    h.clock.now = 1
    second = h.insert([3, 3, 4, 4])
    h.clock.now = 2
    assert h.policy.reserve(4)  # both must leave the device; the host tier holds only one
    assert first.parent is None  # dropped: the least recently used
    assert not second.is_on_device and second.parent is not None
    assert h.policy.stats().eviction_count == 1
    h.tree.check_integrity()
    assert_all_kv(h)


def test_node_bigger_than_the_host_tier_is_dropped():
    h = make_harness(num_pages=9, host_ratio=0.25)  # 8 device pages, 2 host pages
    big = h.insert([1, 1, 2, 2, 3, 3])
    h.clock.now = 1
    assert h.policy.reserve(8)
    assert big.parent is None and h.tree.host_size() == 0
    h.tree.check_integrity()


def test_insert_over_a_host_resident_node_takes_the_new_pages():
    h = make_harness(soft_free_threshold_s=0.0)
    node = h.insert([1, 2, 3, 4])
    h.policy.on_schedule(0)
    assert not node.is_on_device
    h.insert([1, 2, 3, 4, 5, 6])  # recomputed by a caller that did not recall
    assert node.is_on_device and h.policy.host.num_used == 0
    h.tree.check_integrity()
    assert_all_kv(h)


def test_locked_nodes_are_never_soft_freed_or_evicted():
    h = make_harness(num_pages=5, soft_free_threshold_s=0.0)
    node = h.insert([1, 1, 2, 2])
    h.tree.inc_lock_ref(node)
    h.clock.now = 100
    h.policy.on_schedule(0)
    assert node.is_on_device
    assert len(h.policy.evict(100)) == 0
    assert node.is_on_device and node.parent is not None
    with pytest.raises(ValueError):
        h.tree.offload(node, [0, 1])


# Stage 1: freezing


def test_frozen_budget_waits_beyond_the_ratio():
    tree = RadixCache(1)
    budget = FreezeBudget(tree, pool_tokens=100, max_frozen_ratio=0.5)
    assert budget.can_freeze(60, 0)  # nothing frozen yet: always admitted
    node = tree.insert(list(range(40)), list(range(1, 41))).last_node
    tree.inc_lock_ref(node)
    assert budget.can_freeze(10, 0) and not budget.can_freeze(11, 0)
    assert budget.can_freeze(11, 40)  # only its own prefix is frozen
    assert budget.num_waits == 1


def test_frozen_write_violations():
    tree = RadixCache(2)
    tree.insert([1, 2, 3, 4], [5, 6])
    assert frozen_write_violations(tree, [([5, 6, 7], 4, 2)]) == []
    assert frozen_write_violations(tree, [([5, 6, 7], 3, 2)]) == [(0, 6)]


# Stage 3: coalescing


def test_copy_on_write_reuses_a_partly_matched_page():
    h = make_harness(page_size=4, host=False, coalescing_on=True)
    h.insert([1, 2, 3, 4, 5, 6, 7, 8])
    key = [1, 2, 3, 4, 5, 6, 9, 9, 9]
    result = h.tree.match_prefix(key)
    assert result.num_tokens == 4
    h.tree.inc_lock_ref(result.last_node)
    match = h.policy.extend_match(result, key)
    assert match.num_cow_tokens == 2 and match.cow_page is not None
    page_table = list(match.pages) + [match.cow_page]
    for pos in range(6):
        page, slot = page_table[pos // 4], pos % 4
        assert h.io.k[0, page, 0, slot, 0] == kv_value(key[pos], pos, 0)
    assert match.cow_page not in {int(p) for n in h.tree.iter_nodes() for p in n.pages}
    # writes of the request start past the copied slots, in its private page
    assert frozen_write_violations(h.tree, [(page_table, 6, 2)]) == []


def test_copy_on_write_stays_within_the_namespace():
    h = make_harness(page_size=4, host=False, coalescing_on=True)
    h.insert([1, 2, 3, 4], namespace="a")
    result = h.tree.match_prefix([1, 2, 3, 9], namespace="b")
    h.tree.inc_lock_ref(result.last_node)
    assert h.policy.extend_match(result, [1, 2, 3, 9], "b").num_cow_tokens == 0


def test_tails_are_kept_and_read_by_copy_on_write():
    h = make_harness(page_size=4, host=False, coalescing_on=True, merge_max_suffix_tokens=3)
    shared = h.insert([1, 2, 3, 4, 5, 6, 7, 8])
    h.tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])  # another request used it
    tail = [9, 9, 9]
    assert h.policy.keep_tail(shared, tail)
    assert not h.policy.keep_tail(shared, [9, 9, 9, 9][:4])  # a whole page is not a tail
    page = h.allocator.allocate(1)[0]
    write_kv(h.io, [0, 0, page], [1, 2, 3, 4, 5, 6, 7, 8] + tail, 8, 11, 4)
    tail_node = h.tree.insert_tail(shared, tail, page).last_node
    assert h.tree.is_tail(tail_node)
    h.tree.check_integrity()
    assert_all_kv(h)
    assert not h.policy.keep_tail(shared, [9, 9])  # already covered by the kept tail
    key = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 1]
    result = h.tree.match_prefix(key)
    assert result.num_tokens == 8
    h.tree.inc_lock_ref(result.last_node)
    match = h.policy.extend_match(result, key)
    assert match.num_cow_tokens == 3
    assert h.io.k[0, match.cow_page, 0, 2, 0] == kv_value(9, 10, 0)


def test_tail_needs_a_shared_path():
    h = make_harness(page_size=4, host=False, coalescing_on=True)
    private = h.insert([1, 2, 3, 4])
    assert not h.policy.keep_tail(private, [5])  # nobody else matched the path
    h.tree.match_prefix([1, 2, 3, 4])
    assert h.policy.keep_tail(private, [5])
    assert coalescing.shared_prefix_len(private) == 4


def test_merge_chains_pass_integrity_and_keep_kv():
    h = make_harness(page_size=2, host=True, coalescing_on=True, soft_free_threshold_s=100.0)
    h.insert([1, 1, 2, 2, 3, 3, 4, 4])
    for cut in (2, 4, 6):
        h.tree.match_prefix([1, 1, 2, 2, 3, 3, 4, 4][:cut] + [7, 7])  # split into a chain of 4
    assert h.tree.num_nodes() == 4
    locked = h.tree.match_prefix([1, 1, 2, 2]).last_node
    h.tree.inc_lock_ref(locked)
    h.clock.now = 5
    h.policy.on_schedule(0)
    # the locked (frozen) part is not merged; the unlocked chain below it is
    assert h.tree.num_nodes() == 3 and h.policy.num_merges == 1
    h.tree.dec_lock_ref(locked)
    h.clock.now = 10
    h.policy.on_schedule(0)
    assert h.tree.num_nodes() == 1 and h.policy.num_merges == 3
    h.tree.check_integrity()
    assert_all_kv(h)
    assert h.tree.match_prefix([1, 1, 2, 2, 3, 3, 4, 4]).num_tokens == 8


def test_merge_keeps_tiers_apart():
    h = make_harness(page_size=2, soft_free_threshold_s=0.0, coalescing_on=True)
    h.insert([1, 1, 2, 2])
    h.tree.match_prefix([1, 1, 9, 9])  # [1 1] -> [2 2]
    (upper,) = h.tree.root.children.values()
    (lower,) = upper.children.values()
    h.tree.offload(lower, h.policy.host.allocate(1))
    assert not h.tree.can_merge_child(upper)


# Stage 4: adaptive


def test_adaptive_mode_follows_the_batch_size():
    assert choose_mode(0, 8, 16) is ReleaseMode.CONSERVATIVE
    assert choose_mode(7, 8, 16) is ReleaseMode.CONSERVATIVE
    assert choose_mode(8, 8, 16) is ReleaseMode.BALANCED
    assert choose_mode(16, 8, 16) is ReleaseMode.AGGRESSIVE
    h = make_harness(soft_free_threshold_s=0.0, coalescing_on=True)
    h.policy.config = dataclasses.replace(h.policy.config, conservative_batch_size=8, aggressive_batch_size=16)
    for running, mode in ((3, "conservative"), (12, "balanced"), (20, "aggressive"), (1, "conservative")):
        h.policy.on_schedule(running)
        assert h.policy.stats().mode == mode
    node = h.insert([1, 2])
    h.clock.now = 1
    h.policy.on_schedule(2)
    assert node.is_on_device  # conservative: no proactive release
    h.policy.on_schedule(9)
    assert not node.is_on_device


def test_proactive_release_only_above_the_usage_threshold():
    h = make_harness(num_pages=11, soft_free_threshold_s=0.0, evict_threshold=0.5)  # 10 pages
    nodes = []
    for i in range(1, 5):  # 8 pages used, inserted at t = 1..4
        h.clock.now = i
        nodes.append(h.insert([i, i, i, i]))
    h.policy.on_schedule(0)
    # 8 of 10 pages used, 5 allowed: two 2-page nodes leave, the oldest first
    assert used_pages(h) == 4 and [n.is_on_device for n in nodes] == [False, False, True, True]


# Host pool, sizes and stats


def test_host_pool_sizes_and_double_free():
    shape = PoolShape(2, 11, 4, 2, 8, "float32")
    assert num_host_pages(shape, 2.0, 0.0) == 20
    page_bytes = shape.bytes_per_token * 4
    assert num_host_pages(shape, 2.0, 1e-9 * page_bytes * 3) == 3
    pool = HostKVPool(shape, 3)
    pages = pool.allocate(2)
    pool.free(pages)
    with pytest.raises(ValueError):
        pool.free(pages)
    with pytest.raises(MemoryError):
        pool.allocate(4)


def test_stats_and_log(caplog):
    h = make_harness(page_size=2, soft_free_threshold_s=0.0, enable_stats_log=True)
    h.insert([1, 1, 2, 2])
    h.tree.match_prefix([1, 1, 3, 3])
    with caplog.at_level("INFO", logger="jaxserve.cache.release_policy"):
        h.policy.on_schedule(0)
    assert "[RadixCache] Nodes: 2, Shared: 1 (50.0%), Frozen: 0, SoftFreed: 2, Merged: 0" in caplog.text
    stats = h.policy.stats()
    assert stats.nodes_total == 2 and stats.soft_freed_nodes == 2 and stats.cached_tokens_host == 4
    assert stats.cached_tokens_device == 0 and stats.num_blocks_used == 0


def test_path_len():
    tree = RadixCache(1)
    node = tree.insert([1, 2, 3], [1, 2, 3]).last_node
    assert path_len(node) == 3 and path_len(tree.root) == 0


# The tree's tier primitives


def test_match_reports_host_nodes_and_splits_inside_them():
    tree = RadixCache(2)
    tree.insert([1, 1, 2, 2, 3, 3], [1, 2, 3])
    (node,) = tree.root.children.values()
    assert tree.offload(node, [7, 8, 9]).tolist() == [1, 2, 3]
    result = tree.match_prefix([1, 1, 2, 2, 4, 4])
    assert result.num_tokens == 0 and result.last_node is tree.root
    (upper,) = result.host_nodes
    assert upper.key == (1, 1, 2, 2) and upper.host_pages.tolist() == [7, 8]
    assert node.host_pages.tolist() == [9] and node.parent is upper
    assert tree.host_size() == 6 and tree.evictable_size() == 0
    tree.check_integrity()
    with pytest.raises(ValueError):
        tree.restore(node, [4])  # its parent is not on the device
    assert tree.restore(upper, [4, 5]).tolist() == [7, 8]
    assert tree.match_prefix([1, 1, 2, 2, 3, 3]).host_nodes == (node,)
    tree.check_integrity()


def test_evict_without_a_host_tier_skips_nodes_with_host_children():
    tree = RadixCache(1)
    tree.insert([1, 2], [1, 2])
    tree.match_prefix([1, 3])
    (upper,) = tree.root.children.values()
    (lower,) = upper.children.values()
    tree.offload(lower, [0])
    assert tree.evict(10).tolist() == []
    tree.remove_leaf(lower)
    assert tree.evict(10).tolist() == [1]
    tree.check_integrity()


def test_tail_is_invisible_to_page_matches():
    tree = RadixCache(4)
    node = tree.insert([1, 2, 3, 4], [1]).last_node
    tail = tree.insert_tail(node, [5, 6], 2).last_node
    assert tree.is_tail(tail) and tree.insert_tail(node, [5, 6], 3).duplicate_pages.tolist() == [3]
    assert tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).num_tokens == 4
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8], [1, 4])  # a full page next to the tail
    assert len(node.children) == 2
    with pytest.raises(ValueError):
        tree.insert_tail(node, [5, 6, 7, 8], 5)
    tree.check_integrity()
    assert sorted(tree.evict(100).tolist()) == [1, 2, 4]


def test_heap_compaction_keeps_it_bounded():
    tree = RadixCache(1)
    for i in range(200):
        node = tree.insert([1000 + i], [i + 1]).last_node
        tree.inc_lock_ref(node)  # its heap entry goes stale
    assert len(tree._heap) <= 2 * tree.num_nodes() + 64
    tree.check_integrity()


# Flags


def test_flags_alias_and_pool_cap():
    from jaxserve.cache.kv_pool import size_pool
    from jaxserve.server_args import ServerArgs

    args = ServerArgs.from_cli([
        "--radix-cache-block-size", "4", "--radix-cache-max-num-blocks", "10", "--enable-hierarchical-cache",
        "--hicache-ratio", "1.5", "--radix-cache-soft-free-threshold", "0", "--enable-auto-merge",
        "--merge-max-suffix-tokens", "3", "--enable-radix-cache-stats",
    ]).resolved("cpu")
    assert args.page_size == 4
    config = EngineConfig.of(args).cache.release_policy
    assert config.enable_host_tier and config.hicache_ratio == 1.5 and config.soft_free_threshold_s == 0
    assert config.enable_coalescing and config.merge_max_suffix_tokens == 3 and config.enable_stats_log
    assert (config.max_frozen_ratio, config.evict_threshold, config.merge_min_shared_ratio) == (0.9, 0.8, 0.6)
    assert (config.conservative_batch_size, config.aggressive_batch_size) == (8, 16)
    shape = size_pool(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype="float32",
                      max_total_tokens=4096, mem_fraction_static=None, weights_bytes=0, platform="cpu",
                      max_num_pages=args.radix_cache_max_num_blocks)
    assert shape.num_pages == 11
    with pytest.raises(ValueError, match="radix-cache-evict-threshold"):
        ServerArgs(radix_cache_evict_threshold=1.5).validate()
