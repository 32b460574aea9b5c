"""RadixAttention prefix cache: a radix tree from token sequences to KV pages.

The algorithm is RadixAttention from SGLang (Zheng et al. 2023, "SGLang: Efficient Execution of
Structured Language Model Programs", arXiv:2312.07104) and follows the semantics of SGLang's
`RadixCache` (python/sglang/srt/mem_cache/radix_cache.py): edges carry token runs, nodes carry the
KV page ids of those tokens, a match that ends inside an edge splits it, locked paths (lock_ref > 0)
are never evicted, and eviction frees least-recently-used unlocked leaves.

Pages: a token at position p of a sequence lives in page `pages[p // page_size]`, slot
`p % page_size` (DESIGN.md, KV pool). Pages are therefore shared only whole: every key stored here is
a whole number of pages and every match is cut down to whole pages. Reusing the matched slots of a
partly matching page (copy-on-write) is the release policy's job, not the tree's.

All sizes are in tokens; a node of `k` tokens holds `k // page_size` pages. The tree is pure Python
plus numpy and knows nothing of devices, requests or the scheduler. Policies (soft release to a host
tier, merging, admission limits) sit beside it and use `TreeNode.host_pages`, `last_access_time` and
`hit_count`; the tree itself only carries them along.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable, Hashable, Iterator, NamedTuple, Sequence

import numpy as np
from jaxtyping import Int32

_EMPTY_PAGES = np.zeros((0,), dtype=np.int32)
_node_ids = itertools.count()


class TreeNode:
    """One edge of the radix tree together with the node below it.

    Attributes:
        key: the token ids of this edge, a tuple of `len(pages) * page_size` ints (empty for the root).
        pages: [len(key) // page_size] int32 KV page ids holding those tokens.
        children: child nodes keyed by their first page's tokens (a tuple of page_size ints); the
            root's keys are `(namespace, first_page_tokens)`.
        parent: the parent node; None for the root and for nodes removed from the tree.
        namespace: the namespace (LoRA id, cache salt, ...) of the subtree this node belongs to.
        lock_ref: number of locks held on this node or on any node below it.
        last_access_time: time (seconds, from the cache's `time_fn`) of the last match or insert
            that walked through this node.
        hit_count: number of `match_prefix` calls that matched (part of) this node.
        host_pages: hook for the host tier (release policy stage 2): host-pool page ids holding a copy
            of this node's KV, laid out like `pages`, or None. The tree only slices it on a split and
            checks its length; copying, recalling and freeing host pages belong to the host tier.
    """

    __slots__ = (
        "key",
        "pages",
        "children",
        "parent",
        "namespace",
        "lock_ref",
        "last_access_time",
        "hit_count",
        "host_pages",
        "id",
        "_in_heap",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        pages: Int32[np.ndarray, " P"],
        parent: TreeNode | None,
        namespace: Hashable,
        last_access_time: float,
    ):
        self.key = key
        self.pages = pages
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.namespace = namespace
        self.lock_ref = 0
        self.last_access_time = last_access_time
        self.hit_count = 0
        self.host_pages: Int32[np.ndarray, " P"] | None = None
        self.id = next(_node_ids)
        # True while the node has an entry in the eviction heap (at most one entry per node).
        self._in_heap = False

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, num_tokens={len(self.key)}, num_children={len(self.children)}, "
            f"lock_ref={self.lock_ref}, namespace={self.namespace!r})"
        )


class MatchResult(NamedTuple):
    """Result of `RadixCache.match_prefix`.

    Attributes:
        pages: [num_tokens // page_size] int32 page ids of the matched prefix, in sequence order.
        num_tokens: matched tokens (a multiple of page_size).
        last_node: the node the match ends at (the root when nothing matched); lock it to pin the
            matched prefix.
    """

    pages: Int32[np.ndarray, " P"]
    num_tokens: int
    last_node: TreeNode


class InsertResult(NamedTuple):
    """Result of `RadixCache.insert`.

    Attributes:
        num_existing_tokens: tokens of the key that were already cached before the call.
        duplicate_pages: int32 page ids the caller passed for the already-cached part that differ
            from the tree's own pages there; the tree did not take them and the caller must free them.
        last_node: the node holding the key's last token (the root for an empty key).
    """

    num_existing_tokens: int
    duplicate_pages: Int32[np.ndarray, " D"]
    last_node: TreeNode


class RadixCache:
    """Prefix cache over paged KV: match, insert, lock, evict (SGLang RadixAttention).

    Eviction uses a min-heap of (last_access_time, node id, node) kept up to date incrementally:
    a node is pushed when it becomes an unlocked leaf (insert, unlock, eviction of its last child) and
    entries that went stale (the node was locked, got a child or was removed) are dropped when popped
    (lazy deletion). A node has at most one entry, so the heap never outgrows the tree. Access times
    only grow, so an entry's time is a lower bound of its node's; a popped entry whose time is older
    than its node's is pushed back with the current time, which keeps the order exact LRU.

    Args:
        page_size: tokens per KV page (>= 1).
        disable: when True the cache holds nothing: match finds nothing, insert returns every page as a
            duplicate to free, evict frees nothing.
        time_fn: clock for `last_access_time`, in seconds; inject a fake clock in tests.

    Not thread-safe: the engine loop owns the cache and calls it from its one thread.

    Raises:
        ValueError: if page_size < 1.
    """

    def __init__(
        self,
        page_size: int,
        disable: bool = False,
        time_fn: Callable[[], float] = time.monotonic,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.disable = disable
        self.time_fn = time_fn
        self._init_tree()

    def _init_tree(self) -> None:
        self._root = TreeNode((), _EMPTY_PAGES, None, None, self.time_fn())
        self._heap: list[tuple[float, int, TreeNode]] = []
        self._evictable_size = 0
        self._protected_size = 0

    @property
    def root(self) -> TreeNode:
        return self._root

    # Sizes (tokens)

    def evictable_size(self) -> int:
        """Cached tokens that no lock protects (what `evict` can free)."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Cached tokens on locked paths."""
        return self._protected_size

    def total_size(self) -> int:
        """All cached tokens."""
        return self._evictable_size + self._protected_size

    # Match and insert

    def match_prefix(self, key: Sequence[int], namespace: Hashable = None) -> MatchResult:
        """Find the longest cached prefix of `key` made of whole pages.

        A match that ends inside a node splits that node at the page boundary, so the returned
        `last_node` covers exactly the matched prefix. Refreshes `last_access_time` and increments
        `hit_count` of every matched node.

        Args:
            key: token ids; a trailing partial page is ignored.
            namespace: only prefixes inserted under the same namespace match.

        Returns:
            MatchResult; `num_tokens == len(pages) * page_size`.
        """
        if self.disable:
            return MatchResult(_EMPTY_PAGES, 0, self._root)
        key = self._aligned_key(key)
        now = self.time_fn()
        node = self._root
        node.last_access_time = now
        matched_pages = []
        pos = 0
        while pos < len(key):
            child = node.children.get(self._child_key(node, key, pos, namespace))
            if child is None:
                break
            match_len = self._match_len(child.key, key, pos)
            is_partial = match_len < len(child.key)
            if is_partial:
                child = self._split(child, match_len)
            child.last_access_time = now
            child.hit_count += 1
            matched_pages.append(child.pages)
            node = child
            pos += match_len
            if is_partial:
                break
        pages = np.concatenate(matched_pages) if matched_pages else _EMPTY_PAGES
        return MatchResult(pages, pos, node)

    def insert(
        self,
        key: Sequence[int],
        pages: Sequence[int] | Int32[np.ndarray, " P"],
        namespace: Hashable = None,
    ) -> InsertResult:
        """Cache `key` with its KV `pages`.

        The already-cached part of `key` keeps the tree's pages: the caller's pages there that differ
        from the tree's are returned as `duplicate_pages` for the caller to free. The tree takes the
        caller's remaining pages. Refreshes `last_access_time` along the path (no hit is counted).

        Args:
            key: token ids, `len(key)` a multiple of page_size (tokens).
            pages: `len(key) // page_size` page ids; `pages[i]` holds tokens
                `key[i * page_size:(i + 1) * page_size]`.
            namespace: keeps this key apart from equal keys of other namespaces.

        Raises:
            ValueError: if `len(key)` is not a multiple of page_size or `len(pages)` does not match.
        """
        pages = np.asarray(pages, dtype=np.int32).reshape(-1)
        if len(key) % self.page_size != 0:
            raise ValueError(
                f"insert: len(key)={len(key)} tokens is not a multiple of page_size={self.page_size}"
            )
        if len(pages) != len(key) // self.page_size:
            raise ValueError(
                f"insert: got {len(pages)} pages for {len(key)} tokens; expected "
                f"{len(key) // self.page_size} (page_size={self.page_size})"
            )
        if self.disable:
            return InsertResult(0, pages.copy(), self._root)
        key = tuple(key) if not isinstance(key, np.ndarray) else tuple(key.tolist())
        page_size = self.page_size
        now = self.time_fn()
        node = self._root
        node.last_access_time = now
        tree_pages = []
        pos = 0
        while pos < len(key):
            child = node.children.get(self._child_key(node, key, pos, namespace))
            if child is None:
                break
            match_len = self._match_len(child.key, key, pos)
            if match_len < len(child.key):
                child = self._split(child, match_len)
            child.last_access_time = now
            tree_pages.append(child.pages)
            node = child
            pos += match_len
        num_existing_tokens = pos
        duplicate_pages = _EMPTY_PAGES
        if tree_pages:
            caller_pages = pages[: pos // page_size]
            duplicate_pages = caller_pages[caller_pages != np.concatenate(tree_pages)]
        if pos < len(key):
            leaf = TreeNode(key[pos:], pages[pos // page_size :].copy(), node, namespace, now)
            node.children[self._child_key(node, key, pos, namespace)] = leaf
            self._evictable_size += len(leaf.key)
            self._push_candidate(leaf)
            node = leaf
        return InsertResult(num_existing_tokens, duplicate_pages, node)

    # Locks

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock `node` and its ancestors against eviction.

        Returns:
            tokens that moved from evictable to protected.
        """
        if node.parent is None and node is not self._root:
            raise ValueError(f"inc_lock_ref: {node!r} is not in the tree (evicted or reset)")
        num_protected = 0
        while node is not self._root:
            if node.lock_ref == 0:
                num_protected += len(node.key)
            node.lock_ref += 1
            node = node.parent
        self._evictable_size -= num_protected
        self._protected_size += num_protected
        return num_protected

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release one lock taken with `inc_lock_ref(node)`.

        Returns:
            tokens that moved from protected to evictable.

        Raises:
            ValueError: if `node` is not locked (lock_ref would go below 0).
        """
        if node is not self._root and node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref: {node!r} is not locked; lock_ref would go below 0")
        num_released = 0
        while node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                num_released += len(node.key)
                if not node.children:
                    self._push_candidate(node)
            node = node.parent
        self._evictable_size += num_released
        self._protected_size -= num_released
        return num_released

    # Eviction

    def evict(self, num_tokens: int) -> Int32[np.ndarray, " F"]:
        """Free at least `num_tokens` tokens (or all evictable ones if fewer), least recently used first.

        Only unlocked leaves are evicted, whole; a parent left an unlocked leaf becomes a candidate.

        Returns:
            int32 page ids no longer held by the tree; the caller returns them to its allocator.
        """
        if self.disable:
            return _EMPTY_PAGES
        freed = []
        num_freed = 0
        heap = self._heap
        while num_freed < num_tokens and heap:
            access_time, _, node = heapq.heappop(heap)
            node._in_heap = False
            if node.parent is None or node.children or node.lock_ref > 0:
                continue
            if access_time < node.last_access_time:
                self._push_candidate(node)
                continue
            parent = node.parent
            del parent.children[self._child_key(parent, node.key, 0, node.namespace)]
            node.parent = None
            freed.append(node.pages)
            num_freed += len(node.key)
            self._evictable_size -= len(node.key)
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                self._push_candidate(parent)
        return np.concatenate(freed) if freed else _EMPTY_PAGES

    def reset(self) -> Int32[np.ndarray, " F"]:
        """Empty the tree.

        Returns:
            int32 page ids of every page the tree held; the caller frees them.

        Raises:
            RuntimeError: if any node is locked.
        """
        if self._protected_size > 0:
            raise RuntimeError(f"reset: {self._protected_size} tokens are locked; unlock them first")
        pages = [node.pages for node in self.iter_nodes()]
        self._init_tree()
        return np.concatenate(pages) if pages else _EMPTY_PAGES

    # Inspection

    def iter_nodes(self) -> Iterator[TreeNode]:
        """All nodes except the root, parents before children."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        """Verify sizes, locks, page counts, page uniqueness, links and heap coverage.

        Cost is linear in the tree size; run it in tests or when the engine is idle.

        Raises:
            AssertionError: naming the first inconsistency found.
        """
        root = self._root
        assert root.parent is None and root.key == () and len(root.pages) == 0, "root must be empty"
        page_size = self.page_size
        evictable = protected = 0
        seen_pages: set[int] = set()
        heap_ids = {entry[2].id for entry in self._heap}
        assert len(heap_ids) == len(self._heap), "a node has more than one eviction heap entry"
        for node in self.iter_nodes():
            assert node._in_heap == (node.id in heap_ids), (
                f"{node!r}: in-heap flag {node._in_heap} disagrees with the eviction heap"
            )
            heap_ids.discard(node.id)
            parent = node.parent
            assert parent is not None, f"{node!r} has no parent"
            child_key = self._child_key(parent, node.key, 0, node.namespace)
            assert parent.children.get(child_key) is node, (
                f"{node!r} is not its parent's child under its first page {child_key!r}"
            )
            assert parent is root or parent.namespace == node.namespace, (
                f"{node!r} namespace differs from its parent's ({parent.namespace!r})"
            )
            assert len(node.key) > 0 and len(node.key) % page_size == 0, (
                f"{node!r}: key of {len(node.key)} tokens is not a positive multiple of page_size"
            )
            assert node.pages.dtype == np.int32 and node.pages.ndim == 1, (
                f"{node!r}: pages must be a 1-D int32 array, got {node.pages.dtype} {node.pages.shape}"
            )
            assert len(node.pages) == len(node.key) // page_size, (
                f"{node!r}: {len(node.pages)} pages for {len(node.key)} tokens"
            )
            assert node.host_pages is None or len(node.host_pages) == len(node.pages), (
                f"{node!r}: {len(node.host_pages)} host pages for {len(node.pages)} pages"
            )
            for page in node.pages.tolist():
                assert page not in seen_pages, f"page {page} is held twice (again by {node!r})"
                seen_pages.add(page)
            children_locks = sum(child.lock_ref for child in node.children.values())
            assert node.lock_ref >= children_locks, (
                f"{node!r}: lock_ref below its children's total ({children_locks})"
            )
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    assert node._in_heap, f"unlocked leaf {node!r} is not an eviction candidate"
        assert root.lock_ref == 0, f"root lock_ref is {root.lock_ref}"
        assert evictable == self._evictable_size, (
            f"evictable_size {self._evictable_size} != {evictable} tokens found in the tree"
        )
        assert protected == self._protected_size, (
            f"protected_size {self._protected_size} != {protected} tokens found in the tree"
        )
        assert not heap_ids, f"eviction heap holds {len(heap_ids)} nodes that are not in the tree"

    # Internals

    def _aligned_key(self, key: Sequence[int]) -> tuple[int, ...]:
        num_tokens = len(key) - len(key) % self.page_size
        if isinstance(key, np.ndarray):
            return tuple(key[:num_tokens].tolist())
        return tuple(key[:num_tokens])

    def _child_key(
        self, parent: TreeNode, key: tuple[int, ...], pos: int, namespace: Hashable
    ) -> Hashable:
        first_page = key[pos : pos + self.page_size]
        return (namespace, first_page) if parent is self._root else first_page

    def _match_len(self, node_key: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Tokens of `node_key` equal to `key[pos:]`, cut down to whole pages."""
        num_tokens = min(len(node_key), len(key) - pos)
        if num_tokens == len(node_key):
            if node_key == key[pos : pos + num_tokens]:
                return num_tokens
        elif node_key[:num_tokens] == key[pos : pos + num_tokens]:
            return num_tokens
        page_size = self.page_size
        # The child lookup already matched the first page.
        for start in range(page_size, num_tokens, page_size):
            end = start + page_size
            if node_key[start:end] != key[pos + start : pos + end]:
                return start
        return num_tokens

    def _split(self, node: TreeNode, num_tokens: int) -> TreeNode:
        """Cut `node` after `num_tokens` (a page multiple); return the new upper node.

        The lower part keeps `node`'s identity, so locks and handles held on it stay valid; the upper
        part inherits its lock_ref, because every lock through `node` also passes through it.
        """
        num_pages = num_tokens // self.page_size
        parent = node.parent
        upper = TreeNode(
            node.key[:num_tokens], node.pages[:num_pages], parent, node.namespace, node.last_access_time
        )
        upper.lock_ref = node.lock_ref
        upper.hit_count = node.hit_count
        if node.host_pages is not None:
            upper.host_pages = node.host_pages[:num_pages]
            node.host_pages = node.host_pages[num_pages:]
        parent.children[self._child_key(parent, node.key, 0, node.namespace)] = upper
        node.key = node.key[num_tokens:]
        node.pages = node.pages[num_pages:]
        node.parent = upper
        upper.children[self._child_key(upper, node.key, 0, node.namespace)] = node
        return upper

    def _push_candidate(self, node: TreeNode) -> None:
        if not node._in_heap:
            node._in_heap = True
            heapq.heappush(self._heap, (node.last_access_time, node.id, node))
