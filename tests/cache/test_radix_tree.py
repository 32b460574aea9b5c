"""Tests of the RadixAttention prefix cache: unit tests and a hypothesis state machine.

The state machine drives random insert / match / lock / unlock / evict / reset sequences against a
brute-force model: the set of cached page-aligned prefixes (each with the page that holds its last page
of tokens and a lock count) plus a fake allocator that tracks who owns every page.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.cache.radix_tree import RadixCache, TreeNode


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float = 1.0) -> None:
        self.now += seconds


def node_path_key(node: TreeNode) -> tuple[int, ...]:
    """Tokens from the root down to and including `node`."""
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(token for part in reversed(parts) for token in part)


def tree_pages(cache: RadixCache) -> list[int]:
    return [page for node in cache.iter_nodes() for page in node.pages.tolist()]


# Unit tests


def test_match_empty_and_partial_page():
    cache = RadixCache(page_size=4)
    result = cache.match_prefix([1, 2, 3])
    assert result.num_tokens == 0 and len(result.pages) == 0 and result.last_node is cache.root
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], [10, 11])
    # The trailing partial page [5, 6] is ignored: only whole pages match.
    result = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert result.num_tokens == 4
    assert result.pages.tolist() == [10]
    assert result.pages.dtype == np.int32
    cache.check_integrity()


def test_node_split_on_match_and_insert():
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    (leaf,) = cache.root.children.values()

    result = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert result.num_tokens == 4 and result.pages.tolist() == [10, 11]
    upper = result.last_node
    assert upper.key == (1, 2, 3, 4) and upper.pages.tolist() == [10, 11]
    # The lower part keeps the original node's identity.
    assert leaf.parent is upper and leaf.key == (5, 6) and leaf.pages.tolist() == [12]
    assert list(upper.children.values()) == [leaf]
    cache.check_integrity()

    # A mismatch inside a page cuts at the page boundary before it.
    result = cache.insert([1, 2, 3, 9, 7, 7], [20, 21, 22])
    assert result.num_existing_tokens == 2
    assert result.duplicate_pages.tolist() == [20]  # the tree keeps its page 10 for [1, 2]
    assert upper.key == (3, 4) and upper.parent.key == (1, 2)
    assert result.last_node.parent is upper.parent and result.last_node.pages.tolist() == [21, 22]
    cache.check_integrity()


def test_insert_duplicate_pages_reporting():
    cache = RadixCache(page_size=2)
    result = cache.insert([1, 2, 3, 4], [10, 11])
    assert result.num_existing_tokens == 0 and result.duplicate_pages.tolist() == []
    # Same key, caller's own pages for the second page: that page is a duplicate.
    result = cache.insert([1, 2, 3, 4], [10, 21])
    assert result.num_existing_tokens == 4
    assert result.duplicate_pages.tolist() == [21]
    # Longer key: the cached part matches the tree's pages exactly, the new page is taken.
    result = cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert result.num_existing_tokens == 4 and result.duplicate_pages.tolist() == []
    assert result.last_node.pages.tolist() == [12]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).pages.tolist() == [10, 11, 12]
    # A caller that computed everything itself (no prior match) returns all of its cached-part pages.
    result = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], [30, 31, 32, 33])
    assert result.num_existing_tokens == 6
    assert result.duplicate_pages.tolist() == [30, 31, 32]
    assert sorted(tree_pages(cache)) == [10, 11, 12, 33]
    assert cache.total_size() == 8
    cache.check_integrity()


def test_insert_splits_node_and_reports_duplicates():
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [10, 11, 12])
    result = cache.insert([1, 2, 4], [10, 31, 32])
    assert result.num_existing_tokens == 2
    assert result.duplicate_pages.tolist() == [31]
    assert cache.match_prefix([1, 2, 4]).pages.tolist() == [10, 11, 32]
    assert cache.match_prefix([1, 2, 3]).pages.tolist() == [10, 11, 12]
    assert cache.total_size() == 4
    cache.check_integrity()


def test_namespace_separation():
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 2, 3], [20, 21, 22], namespace="lora-a")
    assert cache.match_prefix([1, 2, 3]).pages.tolist() == [10, 11, 12]
    assert cache.match_prefix([1, 2, 3], namespace="lora-a").pages.tolist() == [20, 21, 22]
    assert cache.match_prefix([1, 2, 3], namespace="lora-b").num_tokens == 0
    # Same key in another namespace is not "existing": nothing is reported as duplicate.
    result = cache.insert([1, 2, 3], [30, 31, 32], namespace=("salt", 7))
    assert result.num_existing_tokens == 0 and result.duplicate_pages.tolist() == []
    assert cache.total_size() == 9
    cache.check_integrity()


def test_lock_protects_from_eviction():
    clock = FakeClock()
    cache = RadixCache(page_size=1, time_fn=clock)
    cache.insert([1, 2, 3], [10, 11, 12])
    clock.advance()
    cache.insert([1, 2, 4], [10, 11, 13])
    node = cache.match_prefix([1, 2, 3]).last_node
    assert cache.inc_lock_ref(node) == 3  # [1, 2] and [3] became protected
    assert cache.protected_size() == 3 and cache.evictable_size() == 1
    cache.check_integrity()
    assert cache.evict(100).tolist() == [13]
    assert cache.total_size() == 3 and cache.evictable_size() == 0
    assert cache.evict(100).tolist() == []
    assert cache.dec_lock_ref(node) == 3
    assert sorted(cache.evict(100).tolist()) == [10, 11, 12]
    assert cache.total_size() == 0
    cache.check_integrity()


def test_split_of_locked_node_keeps_locks():
    cache = RadixCache(page_size=1)
    leaf = cache.insert([1, 2, 3, 4], [10, 11, 12, 13]).last_node
    cache.inc_lock_ref(leaf)
    cache.match_prefix([1, 2, 9])  # splits the locked node
    assert leaf.key == (3, 4) and leaf.parent.lock_ref == 1
    assert cache.protected_size() == 4
    cache.check_integrity()
    cache.dec_lock_ref(leaf)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    cache.check_integrity()


def test_evict_is_lru_and_parent_becomes_candidate():
    clock = FakeClock()
    cache = RadixCache(page_size=2, time_fn=clock)
    cache.insert([1, 1, 2, 2], [10, 11])  # t=0
    clock.advance()
    cache.insert([1, 1, 3, 3], [10, 12])  # t=1: splits [1, 1]
    clock.advance()
    cache.insert([5, 5], [13])  # t=2
    clock.advance()
    cache.match_prefix([1, 1, 2, 2])  # t=3: [1, 1, 2, 2] is now the most recent
    assert cache.evict(1).tolist() == [12]  # [3, 3], last used at t=1
    assert cache.evict(1).tolist() == [13]  # [5, 5] at t=2
    assert cache.evict(1).tolist() == [11]  # [2, 2] at t=3
    assert cache.evict(1).tolist() == [10]  # [1, 1] became a leaf
    assert cache.total_size() == 0
    cache.check_integrity()


def test_evict_frees_at_least_requested():
    cache = RadixCache(page_size=4)
    cache.insert(list(range(16)), [1, 2, 3, 4])
    cache.insert(list(range(100, 108)), [5, 6])
    assert cache.evict(0).tolist() == []
    freed = cache.evict(5)
    assert len(freed) * 4 >= 5
    assert cache.total_size() == 24 - len(freed) * 4
    cache.check_integrity()


def test_heap_is_incremental_and_bounded():
    cache = RadixCache(page_size=1)
    leaf = cache.insert([1, 2, 3], [1, 2, 3]).last_node
    for _ in range(1000):
        cache.inc_lock_ref(leaf)
        cache.dec_lock_ref(leaf)
        cache.match_prefix([1, 2, 3])
    assert len(cache._heap) <= 1
    cache.check_integrity()


def test_hit_count_and_access_time():
    clock = FakeClock()
    cache = RadixCache(page_size=1, time_fn=clock)
    leaf = cache.insert([1, 2], [1, 2]).last_node
    assert leaf.hit_count == 0
    clock.advance(5.0)
    cache.match_prefix([1, 2, 3])
    cache.match_prefix([1])
    assert leaf.hit_count == 1 and leaf.last_access_time == 5.0
    assert leaf.parent.hit_count == 2  # the split-off [1] was matched twice


def test_cached_prefix_len_is_a_probe_that_counts_no_use():
    clock = FakeClock()
    cache = RadixCache(page_size=2, time_fn=clock)
    leaf = cache.insert([1, 2, 3, 4, 5, 6], [1, 2, 3]).last_node
    clock.advance(5.0)
    assert cache.cached_prefix_len([1, 2, 3, 4, 9, 9, 7]) == 4  # ends inside the node, at a page boundary
    assert cache.cached_prefix_len([1, 2, 3, 4, 5, 6, 7]) == 6
    assert cache.cached_prefix_len([1, 2, 3, 4, 5, 6], namespace="lora-a") == 0
    assert cache.num_nodes() == 1 and leaf.hit_count == 0 and leaf.last_access_time == 0.0
    assert cache.match_prefix([1, 2, 3, 4, 9, 9]).num_tokens == 4  # the same length, now counted as a use
    assert cache.num_nodes() == 2 and leaf.parent.hit_count == 1


def test_numpy_inputs():
    cache = RadixCache(page_size=2)
    cache.insert(np.arange(6), np.array([4, 5, 6], dtype=np.int64))
    result = cache.match_prefix(np.arange(5))
    assert result.num_tokens == 4 and result.pages.tolist() == [4, 5]
    assert result.last_node.pages.dtype == np.int32
    cache.check_integrity()


def test_reset_returns_all_pages():
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 5], [10, 13])
    node = cache.match_prefix([1, 5]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(node)
    assert sorted(cache.reset().tolist()) == [10, 11, 12, 13]
    assert cache.total_size() == 0 and cache.match_prefix([1, 2, 3]).num_tokens == 0
    assert cache.reset().tolist() == []
    cache.check_integrity()


def test_disable_mode():
    cache = RadixCache(page_size=2, disable=True)
    result = cache.insert([1, 2, 3, 4], [7, 8])
    assert result.num_existing_tokens == 0 and result.duplicate_pages.tolist() == [7, 8]
    assert result.last_node is cache.root
    match = cache.match_prefix([1, 2, 3, 4])
    assert match.num_tokens == 0 and len(match.pages) == 0 and match.last_node is cache.root
    assert cache.evict(100).tolist() == []
    assert cache.total_size() == 0
    cache.inc_lock_ref(match.last_node)  # locking the root is a no-op
    cache.dec_lock_ref(match.last_node)
    with pytest.raises(ValueError, match="multiple of page_size"):
        cache.insert([1, 2, 3], [7])
    cache.check_integrity()


def test_errors():
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        RadixCache(page_size=0)
    cache = RadixCache(page_size=4)
    with pytest.raises(ValueError, match=r"len\(key\)=5 tokens is not a multiple of page_size=4"):
        cache.insert([1, 2, 3, 4, 5], [1])
    with pytest.raises(ValueError, match="got 1 pages for 8 tokens; expected 2"):
        cache.insert(list(range(8)), [1])
    leaf = cache.insert(list(range(8)), [1, 2]).last_node
    with pytest.raises(ValueError, match="lock_ref would go below 0"):
        cache.dec_lock_ref(leaf)
    cache.inc_lock_ref(leaf)
    cache.dec_lock_ref(leaf)
    with pytest.raises(ValueError, match="below 0"):
        cache.dec_lock_ref(leaf)
    cache.evict(8)
    with pytest.raises(ValueError, match="not in the tree"):
        cache.inc_lock_ref(leaf)
    cache.check_integrity()


def test_check_integrity_detects_corruption():
    cache = RadixCache(page_size=1)
    leaf = cache.insert([1, 2], [1, 2]).last_node
    cache.check_integrity()
    cache._evictable_size += 1
    with pytest.raises(AssertionError, match="evictable_size"):
        cache.check_integrity()
    cache._evictable_size -= 1
    leaf.pages = np.array([1, 2, 3], dtype=np.int32)
    with pytest.raises(AssertionError, match="3 pages for 2 tokens"):
        cache.check_integrity()
    leaf.pages = np.array([1, 2], dtype=np.int32)
    cache.insert([5], [1])  # the caller wrongly hands over a page the tree already holds
    with pytest.raises(AssertionError, match="page 1 is held twice"):
        cache.check_integrity()


@settings(max_examples=200, deadline=None)
@given(
    page_size=st.sampled_from([1, 4]),
    ops=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 2), min_size=1, max_size=5), st.integers(0, 100)),
        max_size=25,
    ),
)
def test_evict_order_is_lru(page_size, ops):
    """Evicting one token at a time frees leaves in least-recently-used order (fake clock)."""
    clock = FakeClock()
    cache = RadixCache(page_size, time_fn=clock)
    access_time: dict[tuple[int, ...], float] = {}  # page-aligned prefix -> last walk through it
    inserted: list[tuple[int, ...]] = []
    next_page = 1
    for is_match, tokens, pick in ops:
        clock.advance()
        key = tuple(token for token in tokens for _ in range(page_size))
        if is_match and inserted:
            key = inserted[pick % len(inserted)]  # a full match of a cached key (or what is left of it)
            num_tokens = cache.match_prefix(key).num_tokens
        else:
            num_pages = len(key) // page_size
            cache.insert(key, list(range(next_page, next_page + num_pages)))
            next_page += num_pages
            inserted.append(key)
            num_tokens = len(key)
        for end in range(page_size, num_tokens + 1, page_size):
            access_time[key[:end]] = clock.now
    page_prefix = {}
    for node in cache.iter_nodes():
        path = node_path_key(node)
        for i, page in enumerate(node.pages.tolist()):
            page_prefix[page] = path[: len(path) - len(node.key) + (i + 1) * page_size]
    while access_time:
        inner = {prefix[:-page_size] for prefix in access_time}
        oldest_leaf_time = min(time for prefix, time in access_time.items() if prefix not in inner)
        freed = cache.evict(1).tolist()
        assert freed, "nothing evicted although the tree is not empty"
        freed_times = {access_time.pop(page_prefix[page]) for page in freed}
        assert freed_times == {oldest_leaf_time}
        cache.check_integrity()
    assert cache.total_size() == 0


# Property-based test against a brute-force model


class FakeAllocator:
    """Tracks the owner of every page: 'caller' (handed out), 'tree' or 'free'."""

    def __init__(self) -> None:
        self.owner: dict[int, str] = {}
        self.free_list: list[int] = []
        self.next_page = 1  # page 0 is the pool's dummy page

    def alloc(self, num_pages: int) -> list[int]:
        pages = []
        for _ in range(num_pages):
            if self.free_list:
                page = self.free_list.pop()
            else:
                page, self.next_page = self.next_page, self.next_page + 1
            pages.append(page)
            self.owner[page] = "caller"
        return pages

    def give_to_tree(self, pages) -> None:
        for page in pages:
            assert self.owner[page] == "caller", f"page {page} given to the tree while {self.owner[page]}"
            self.owner[page] = "tree"

    def free(self, pages, expected_owner: str) -> None:
        for page in pages:
            assert self.owner.get(page) == expected_owner, (
                f"page {page} freed while {self.owner.get(page)} (expected {expected_owner})"
            )
            self.owner[page] = "free"
            self.free_list.append(page)

    def pages_owned_by(self, owner: str) -> set[int]:
        return {page for page, page_owner in self.owner.items() if page_owner == owner}


def make_machine(page_size: int):
    if page_size == 1:
        page_patterns = [(0,), (1,), (2,)]
    else:
        # Patterns that share their first tokens, so matches stop inside pages.
        page_patterns = [(0,) * page_size, (0,) * (page_size - 1) + (1,), (1,) * page_size]
    namespaces = st.sampled_from([None, "lora-a"])
    page_lists = st.lists(st.sampled_from(page_patterns), max_size=6)
    reuses = st.none() | st.integers(0, 1000)
    tails = st.lists(st.integers(0, 1), max_size=page_size - 1)

    class RadixMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.clock = FakeClock()
            self.cache = RadixCache(page_size, time_fn=self.clock)
            self.allocator = FakeAllocator()
            # (namespace, page-aligned prefix) -> page holding the prefix's last page of tokens.
            self.cached: dict[tuple, int] = {}
            self.lock_counts: collections.Counter = collections.Counter()
            self.handles: list[tuple[TreeNode, object, tuple[int, ...]]] = []
            # (namespace, prefix) -> clock time of the last match or insert that walked through it.
            self.access_time: dict[tuple, float] = {}
            self.history: list[tuple[object, tuple[int, ...]]] = []  # inserted (namespace, key)

        def prefixes(self, namespace, key):
            return [(namespace, tuple(key[:end])) for end in range(page_size, len(key) + 1, page_size)]

        def model_match(self, namespace, key) -> list[int]:
            pages = []
            for prefix in self.prefixes(namespace, key):
                if prefix not in self.cached:
                    break
                pages.append(self.cached[prefix])
            return pages

        def lock(self, node, namespace, key) -> None:
            self.cache.inc_lock_ref(node)
            self.handles.append((node, namespace, key))
            self.lock_counts.update(self.prefixes(namespace, key))

        def make_key(self, namespace, pages, reuse):
            """A key from page patterns, extending an earlier inserted key when `reuse` picks one."""
            key = [token for page in pages for token in page]
            if reuse is not None and self.history:
                namespace, base = self.history[reuse % len(self.history)]
                key = list(base) + key
            return namespace, key

        @rule(
            namespace=namespaces,
            pages=page_lists,
            reuse=reuses,
            num_stale_pages=st.integers(0, 6),
            lock=st.booleans(),
        )
        def insert(self, namespace, pages, reuse, num_stale_pages, lock):
            self.clock.advance()
            namespace, key = self.make_key(namespace, pages, reuse)
            self.history.append((namespace, tuple(key)))
            # The caller matched a (possibly stale) prefix earlier: those pages are the tree's own;
            # it computed the rest into fresh pages.
            matched = self.model_match(namespace, key)[:num_stale_pages]
            fresh = self.allocator.alloc(len(key) // page_size - len(matched))
            caller_pages = matched + fresh
            result = self.cache.insert(key, caller_pages, namespace=namespace)

            num_existing = len(self.model_match(namespace, key))
            assert result.num_existing_tokens == num_existing * page_size
            expected_duplicates = []
            for i, prefix in enumerate(self.prefixes(namespace, key)):
                self.access_time[prefix] = self.clock.now
                if i < num_existing:
                    if caller_pages[i] != self.cached[prefix]:
                        expected_duplicates.append(caller_pages[i])
                else:
                    self.cached[prefix] = caller_pages[i]
            assert sorted(result.duplicate_pages.tolist()) == sorted(expected_duplicates)
            self.allocator.free(result.duplicate_pages.tolist(), expected_owner="caller")
            self.allocator.give_to_tree(caller_pages[num_existing:])
            assert node_path_key(result.last_node) == tuple(key)
            if lock:
                self.lock(result.last_node, namespace, tuple(key))

        @rule(namespace=namespaces, pages=page_lists, reuse=reuses, tail=tails, lock=st.booleans())
        def match(self, namespace, pages, reuse, tail, lock):
            self.clock.advance()
            namespace, key = self.make_key(namespace, pages, reuse)
            key += tail
            expected = self.model_match(namespace, key)
            num_nodes = self.cache.num_nodes()
            assert self.cache.cached_prefix_len(key, namespace) == len(expected) * page_size
            assert self.cache.num_nodes() == num_nodes  # a probe splits nothing
            result = self.cache.match_prefix(key, namespace=namespace)
            assert result.pages.tolist() == expected
            assert result.num_tokens == len(expected) * page_size
            for prefix in self.prefixes(namespace, key)[: len(expected)]:
                self.access_time[prefix] = self.clock.now
            matched_key = node_path_key(result.last_node)
            assert matched_key == tuple(key[: result.num_tokens])
            assert result.last_node is self.cache.root or result.last_node.namespace == namespace
            if lock:
                self.lock(result.last_node, namespace, matched_key)

        @precondition(lambda self: self.handles)
        @rule(index=st.integers(0, 1000))
        def unlock(self, index):
            node, namespace, key = self.handles.pop(index % len(self.handles))
            self.cache.dec_lock_ref(node)
            self.lock_counts.subtract(self.prefixes(namespace, key))

        @rule(num_tokens=st.integers(0, 2 * page_size) | st.integers(0, 12 * page_size))
        def evict(self, num_tokens):
            evictable_before = self.cache.evictable_size()
            inner = {(namespace, prefix[:-page_size]) for namespace, prefix in self.cached}
            leaf_times_before = [
                self.access_time[prefix]
                for prefix in self.cached
                if prefix not in inner and self.lock_counts[prefix] == 0
            ]
            freed = self.cache.evict(num_tokens).tolist()
            assert len(freed) * page_size >= min(num_tokens, evictable_before)
            owner_of = {page: prefix for prefix, page in self.cached.items()}
            freed_times = []
            for page in freed:
                prefix = owner_of[page]
                assert self.lock_counts[prefix] == 0, f"evicted locked prefix {prefix}"
                del self.cached[prefix]
                freed_times.append(self.access_time.pop(prefix))
            self.allocator.free(freed, expected_owner="tree")
            # Pages come back in eviction order: the first belongs to a least recently used leaf.
            if freed:
                assert freed_times[0] == min(leaf_times_before)
            # LRU: nothing evicted was used more recently than an unlocked leaf that stays.
            inner = {(namespace, prefix[:-page_size]) for namespace, prefix in self.cached}
            leaf_times = [
                self.access_time[prefix]
                for prefix in self.cached
                if prefix not in inner and self.lock_counts[prefix] == 0
            ]
            if freed_times and leaf_times:
                assert max(freed_times) <= min(leaf_times)
            # Eviction removes whole subtrees: what stays is still closed under prefixes.
            for namespace, prefix in self.cached:
                if len(prefix) > page_size:
                    assert (namespace, prefix[:-page_size]) in self.cached

        @precondition(lambda self: not self.handles)
        @rule()
        def reset(self):
            freed = self.cache.reset().tolist()
            assert sorted(freed) == sorted(self.cached.values())
            self.allocator.free(freed, expected_owner="tree")
            self.cached.clear()
            self.access_time.clear()

        @invariant()
        def integrity(self):
            self.cache.check_integrity()

        @invariant()
        def sizes_add_up(self):
            num_locked = sum(1 for prefix in self.cached if self.lock_counts[prefix] > 0)
            assert self.cache.protected_size() == num_locked * page_size
            assert self.cache.evictable_size() == (len(self.cached) - num_locked) * page_size
            assert self.cache.total_size() == len(self.cached) * page_size

        @invariant()
        def pages_accounted_once(self):
            pages = tree_pages(self.cache)
            assert len(pages) == len(set(pages))
            assert set(pages) == set(self.cached.values()) == self.allocator.pages_owned_by("tree")
            assert not self.allocator.pages_owned_by("caller"), "pages leaked by the caller side"

        def teardown(self):
            for node, _, _ in self.handles:
                self.cache.dec_lock_ref(node)
            self.allocator.free(self.cache.reset().tolist(), expected_owner="tree")
            assert not self.allocator.pages_owned_by("tree")

    return RadixMachine


_machine_settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestRadixCachePageSize1 = _machine_settings(make_machine(1)).TestCase
TestRadixCachePageSize4 = _machine_settings(make_machine(4)).TestCase
