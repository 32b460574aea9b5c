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
tier, merging, admission limits; jaxserve/cache/release_policy.py) sit beside it and use
`TreeNode.host_pages`, `last_access_time` and `hit_count`; the tree carries them along and offers the
few primitives they need:

- Two tiers. A node lives either on the device (`pages` set, `host_pages` None) or only in the host
  tier (`pages` empty, `host_pages` set). Device residency is closed under prefixes: the parent of a
  device node is on the device, so a match is a device prefix followed by host-resident nodes, which
  `MatchResult.host_nodes` reports. `offload` / `restore` move a node between the tiers (the caller
  copies the KV); `evict(offload=...)` lets a host tier take victims instead of dropping them.
  Host-resident nodes are never locked.
- Tails. `insert_tail` keeps a leaf of fewer than page_size tokens in one partly filled page (a short
  private tail, release policy stage 3). Page-aligned lookups never reach a tail (its child key is
  shorter than a page); it is read only by copy-on-write into a fresh page.
- `remove_leaf` and `merge_child` (path compression) for the policy's host LRU and merging.

The tree is one concept in one file: its node and result types, its eviction heap, its read-only
continuation lookup and its integrity check all live here.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable, Hashable, Iterator, NamedTuple, Sequence

import numpy as np
from jaxtyping import Int32

__all__ = ["InsertResult", "MatchResult", "RadixCache", "TreeNode", "path_pages", "path_tokens"]

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
        host_pages: host-tier page ids holding this node's KV while the node is host-resident
            (release policy stage 2), laid out like `pages`; None while it is on the device. A node
            is in exactly one tier: on the device `pages` is set and `host_pages` None, on the host
            `pages` is empty. The tree slices it on a split and checks it; copying, recalling and
            freeing host pages belong to the host tier.
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

    @property
    def is_on_device(self) -> bool:
        """True when the node's KV is in the device pool (always for the root)."""
        return self.host_pages is None

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
        last_node: the device node the match ends at (the root when nothing matched); lock it to pin
            the matched prefix.
        host_nodes: host-resident nodes that continue the match below `last_node`, in path order
            (each a child of the one before); recalling them extends the match by their tokens.
    """

    pages: Int32[np.ndarray, " P"]
    num_tokens: int
    last_node: TreeNode
    host_nodes: tuple[TreeNode, ...] = ()

    @property
    def num_host_tokens(self) -> int:
        """Tokens matched in host-resident nodes past `num_tokens`."""
        return sum(len(node.key) for node in self.host_nodes)


class InsertResult(NamedTuple):
    """Result of `RadixCache.insert`.

    Attributes:
        num_existing_tokens: tokens of the key that were already cached before the call.
        duplicate_pages: int32 page ids the caller passed for the already-cached part that differ
            from the tree's own pages there; the tree did not take them and the caller must free them.
        last_node: the node holding the key's last token (the root for an empty key).
        freed_host_pages: host-tier page ids of host-resident nodes on the key's path that took the
            caller's device pages instead; the host tier frees them.
    """

    num_existing_tokens: int
    duplicate_pages: Int32[np.ndarray, " D"]
    last_node: TreeNode
    freed_host_pages: Int32[np.ndarray, " H"] = _EMPTY_PAGES


class RadixCache:
    """Prefix cache over paged KV: match, insert, lock, evict (SGLang RadixAttention).

    Eviction uses a lazily pruned min-heap of unlocked device leaves (LRU), pushed on insert, unlock,
    eviction or offload of a last device child, and restore. Entries are (last_access_time, node id,
    node); a node has at most one entry (`TreeNode._in_heap`). Entries that went stale (the node was
    locked, got a device child, moved to the host or was removed) are dropped when popped, or
    compacted away when the heap outgrows twice the tree. Access times only grow, so an entry's time
    is a lower bound of its node's; a popped entry whose time is older than its node's is pushed back
    with the current time, which keeps the order exact LRU.

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
        self._host_size = 0
        self._num_nodes = 0

    @property
    def root(self) -> TreeNode:
        return self._root

    # Sizes (tokens)

    def evictable_size(self) -> int:
        """Device-resident cached tokens that no lock protects (what `evict` can free)."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Cached tokens on locked paths (all on the device)."""
        return self._protected_size

    def total_size(self) -> int:
        """All device-resident cached tokens."""
        return self._evictable_size + self._protected_size

    def host_size(self) -> int:
        """Cached tokens of host-resident nodes."""
        return self._host_size

    def num_nodes(self) -> int:
        """Nodes in the tree, the root excluded."""
        return self._num_nodes

    def is_tail(self, node: TreeNode) -> bool:
        """True for a tail leaf (fewer than page_size tokens in one partly filled page)."""
        return 0 < len(node.key) < self.page_size

    # Match and insert

    def match_prefix(self, key: Sequence[int], namespace: Hashable = None) -> MatchResult:
        """Find the longest cached prefix of `key` made of whole pages.

        A match that ends inside a node splits that node at the page boundary, so the returned
        `last_node` covers exactly the matched prefix. Refreshes `last_access_time` and increments
        `hit_count` of every matched node. The match goes on through host-resident nodes, which it
        reports in `host_nodes` without counting their tokens in `num_tokens`.

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
        host_nodes = []
        parent = node
        pos = num_device_tokens = 0
        while pos < len(key):
            child = parent.children.get(self._child_key(parent, key, pos, namespace))
            if child is None:
                break
            match_len = self._match_len(child.key, key, pos)
            is_partial = match_len < len(child.key)
            if is_partial:
                child = self._split(child, match_len)
            child.last_access_time = now
            child.hit_count += 1
            pos += match_len
            if child.is_on_device:
                matched_pages.append(child.pages)
                node, num_device_tokens = child, pos
            else:
                host_nodes.append(child)
            parent = child
            if is_partial:
                break
        pages = np.concatenate(matched_pages) if matched_pages else _EMPTY_PAGES
        return MatchResult(pages, num_device_tokens, node, tuple(host_nodes))

    def cached_prefix_len(self, key: Sequence[int], namespace: Hashable = None) -> int:
        """Tokens of the longest cached prefix of `key` in whole pages, device and host tiers together:
        `num_tokens + num_host_tokens` of `match_prefix`, read-only (no split, no access-time or hit
        update), so a probe (a storage prefetch deciding where to start) is not counted as a use."""
        if self.disable:
            return 0
        key = self._aligned_key(key)
        parent, pos = self._root, 0
        while pos < len(key):
            child = parent.children.get(self._child_key(parent, key, pos, namespace))
            if child is None:
                break
            match_len = self._match_len(child.key, key, pos)
            pos += match_len
            if match_len < len(child.key):
                break
            parent = child
        return pos

    def continuation(self, key: Sequence[int], max_tokens: int, namespace: Hashable = None) -> list[int]:
        """Up to `max_tokens` tokens that the tree holds right after `key` (read-only: no split, no
        lock, no access-time or hit update). Where several cached sequences continue `key`, the most
        recently used one. Speculative decoding drafts from it: other requests' continuations of the
        same prefix.

        Returns:
            The token ids after `key` on a cached path (empty when no cached path extends `key`).
        """
        if self.disable or max_tokens <= 0 or not key:
            return []
        key = tuple(int(t) for t in key)
        aligned = len(key) - len(key) % self.page_size
        node, pos, rest = self._root, 0, None
        while pos < aligned:
            child = node.children.get(self._child_key(node, key, pos, namespace))
            if child is None:
                return []
            m = self._match_len(child.key, key[:aligned], pos)
            if m < len(child.key):
                if pos + m < aligned:
                    return []  # diverges inside the node
                rest = child.key[m:]
                node = child
                break
            pos += m
            node = child
        tail = key[aligned:]
        if rest is None:  # at a node boundary: the child whose first tokens are the tail
            candidates = [
                c for k, c in node.children.items()
                if (k[1] if node is self._root else k)[: len(tail)] == tail
                and (node is not self._root or k[0] == namespace)
            ]
            if not candidates:
                return []
            node = max(candidates, key=lambda c: c.last_access_time)
            rest = node.key
        if rest[: len(tail)] != tail:
            return []
        out = list(rest[len(tail) : len(tail) + max_tokens])
        while len(out) < max_tokens and node.children:
            node = max(node.children.values(), key=lambda c: c.last_access_time)
            out += node.key[: max_tokens - len(out)]
        return out

    def insert(
        self,
        key: Sequence[int],
        pages: Sequence[int] | Int32[np.ndarray, " P"],
        namespace: Hashable = None,
    ) -> InsertResult:
        """Cache `key` with its KV `pages`.

        The already-cached part of `key` keeps the tree's pages: the caller's pages there that differ
        from the tree's are returned as `duplicate_pages` for the caller to free. The tree takes the
        caller's remaining pages, and its pages for host-resident nodes on the path (whose host
        copies come back in `freed_host_pages`). Refreshes `last_access_time` along the path (no hit
        is counted).

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
        freed_host_pages = []
        pos = 0
        while pos < len(key):
            child = node.children.get(self._child_key(node, key, pos, namespace))
            if child is None:
                break
            match_len = self._match_len(child.key, key, pos)
            if match_len < len(child.key):
                child = self._split(child, match_len)
            child.last_access_time = now
            if not child.is_on_device:
                start = pos // page_size
                freed_host_pages.append(self.restore(child, pages[start : start + len(child.host_pages)].copy()))
            tree_pages.append(child.pages)
            node = child
            pos += match_len
        num_existing_tokens = pos
        duplicate_pages = _EMPTY_PAGES
        if tree_pages:
            caller_pages = pages[: pos // page_size]
            duplicate_pages = caller_pages[caller_pages != np.concatenate(tree_pages)]
        if pos < len(key):
            node = self._add_leaf(node, key, pos, pages[pos // page_size :].copy(), namespace, now)
        host_freed = np.concatenate(freed_host_pages) if freed_host_pages else _EMPTY_PAGES
        return InsertResult(num_existing_tokens, duplicate_pages, node, host_freed)

    def insert_tail(
        self, parent: TreeNode, tail_key: Sequence[int], page: int, namespace: Hashable = None
    ) -> InsertResult:
        """Keep a short tail (fewer than page_size tokens) below `parent` in one partly filled page.

        Used by the release policy's coalescing stage for short private tails that a plain page-aligned
        insert would drop. Page-aligned matches never reach a tail; it is read by copy-on-write only.

        Args:
            parent: a device-resident node (or the root) ending right before `tail_key`.
            tail_key: 1..page_size-1 token ids.
            page: the page holding them in slots 0..len(tail_key)-1.
            namespace: the namespace, used when `parent` is the root.

        Returns:
            InsertResult; when the same tail is already cached, `duplicate_pages` is `[page]`.

        Raises:
            ValueError: bad tail length, or `parent` is not a device node in the tree.
        """
        if not 0 < len(tail_key) < self.page_size:
            raise ValueError(f"insert_tail: a tail holds 1..{self.page_size - 1} tokens, got {len(tail_key)}")
        if (parent.parent is None and parent is not self._root) or not parent.is_on_device:
            raise ValueError(f"insert_tail: {parent!r} is not a device node in the tree")
        pages = np.asarray([page], dtype=np.int32)
        if self.disable:
            return InsertResult(0, pages, self._root)
        tail_key = tuple(int(t) for t in tail_key)
        namespace = namespace if parent is self._root else parent.namespace
        now = self.time_fn()
        existing = parent.children.get(self._child_key(parent, tail_key, 0, namespace))
        if existing is not None:
            existing.last_access_time = now
            return InsertResult(len(tail_key), pages, existing)
        leaf = self._add_leaf(parent, tail_key, 0, pages, namespace, now)
        return InsertResult(0, _EMPTY_PAGES, leaf)

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
                if self._is_device_leaf(node):
                    self._push_candidate(node)
            node = node.parent
        self._evictable_size += num_released
        self._protected_size -= num_released
        return num_released

    # Eviction

    def evict(
        self,
        num_tokens: int,
        offload: Callable[[TreeNode], Int32[np.ndarray, " P"] | None] | None = None,
    ) -> Int32[np.ndarray, " F"]:
        """Free at least `num_tokens` device tokens (or all evictable ones if fewer), LRU first.

        Victims are unlocked device leaves (no child on the device), whole; a parent left an unlocked
        device leaf becomes a candidate. Without `offload` a victim is removed from the tree (a victim
        with host-resident children is skipped: only a host tier can release it).

        Args:
            num_tokens: device tokens to free.
            offload: host-tier hook (release policy stage 2), called with each victim before it is
                released. It returns the host page ids that will hold the victim's KV (the victim then
                stays in the tree, host-resident), or None to drop the victim; before returning None
                it must have removed the victim's host-resident children (`remove_leaf`).

        Returns:
            int32 device page ids no longer held by the tree; the caller returns them to its allocator.
        """
        if self.disable:
            return _EMPTY_PAGES
        freed = []
        num_freed = 0
        heap = self._heap
        while num_freed < num_tokens and heap:
            access_time, _, node = heapq.heappop(heap)
            node._in_heap = False
            if node.parent is None or node.lock_ref > 0 or not self._is_device_leaf(node):
                continue
            if access_time < node.last_access_time:
                self._push_candidate(node)
                continue
            host_pages = offload(node) if offload is not None else None
            if host_pages is not None:
                freed.append(self.offload(node, host_pages))
            elif node.children:
                continue
            else:
                freed.append(node.pages)
                self.remove_leaf(node)
            num_freed += len(node.key)
        return np.concatenate(freed) if freed else _EMPTY_PAGES

    # Tiers, removal and merging (the release policy's primitives)

    def offload(self, node: TreeNode, host_pages: Sequence[int] | Int32[np.ndarray, " P"]) -> Int32[np.ndarray, " P"]:
        """Make `node` host-resident: it keeps its place in the tree, its KV now lives in `host_pages`.

        The caller copies the KV before the returned device pages are reused.

        Args:
            node: an unlocked device node with no child on the device.
            host_pages: host-tier page ids, one per device page of the node.

        Returns:
            the node's former int32 device page ids; the caller frees them.

        Raises:
            ValueError: if `node` is locked, host-resident, not in the tree, has a device child, or
                the page count differs.
        """
        host_pages = np.asarray(host_pages, dtype=np.int32).reshape(-1)
        if node.parent is None or not node.is_on_device or node.lock_ref > 0 or not self._is_device_leaf(node):
            raise ValueError(f"offload: {node!r} is not an unlocked device leaf in the tree")
        if len(host_pages) != len(node.pages):
            raise ValueError(f"offload: {len(host_pages)} host pages for {len(node.pages)} pages of {node!r}")
        pages = node.pages
        node.pages = _EMPTY_PAGES
        node.host_pages = host_pages
        self._evictable_size -= len(node.key)
        self._host_size += len(node.key)
        parent = node.parent
        if parent is not self._root and parent.lock_ref == 0 and self._is_device_leaf(parent):
            self._push_candidate(parent)
        return pages

    def restore(self, node: TreeNode, pages: Sequence[int] | Int32[np.ndarray, " P"]) -> Int32[np.ndarray, " P"]:
        """Bring a host-resident `node` back to the device into `pages` (the caller copied its KV there).

        Returns:
            the node's former int32 host page ids; the host tier frees them.

        Raises:
            ValueError: if `node` is not host-resident, its parent is not on the device, or the page
                count differs.
        """
        pages = np.asarray(pages, dtype=np.int32).reshape(-1)
        if node.parent is None or node.is_on_device or not node.parent.is_on_device:
            raise ValueError(f"restore: {node!r} is not a host-resident node below a device node")
        if len(pages) != len(node.host_pages):
            raise ValueError(f"restore: {len(pages)} pages for {len(node.host_pages)} host pages of {node!r}")
        host_pages = node.host_pages
        node.pages = pages
        node.host_pages = None
        self._host_size -= len(node.key)
        self._evictable_size += len(node.key)
        self._push_candidate(node)
        return host_pages

    def remove_leaf(self, node: TreeNode) -> None:
        """Remove an unlocked leaf (either tier) from the tree.

        Its `pages` / `host_pages` stay readable on the removed node; the caller frees them.

        Raises:
            ValueError: if `node` is locked, has children or is not in the tree.
        """
        if node.parent is None or node.children or node.lock_ref > 0:
            raise ValueError(f"remove_leaf: {node!r} is not an unlocked leaf in the tree")
        parent = node.parent
        del parent.children[self._child_key(parent, node.key, 0, node.namespace)]
        node.parent = None
        self._num_nodes -= 1
        if node.host_pages is None:
            self._evictable_size -= len(node.key)
        else:
            self._host_size -= len(node.key)
        if parent is not self._root and parent.lock_ref == 0 and self._is_device_leaf(parent):
            self._push_candidate(parent)

    def can_merge_child(self, node: TreeNode) -> bool:
        """True when `node` and its only child are unlocked, in the same tier, and neither is a tail."""
        if node.parent is None or len(node.children) != 1 or node.lock_ref > 0:
            return False
        (child,) = node.children.values()
        return (
            child.lock_ref == 0
            and child.is_on_device == node.is_on_device
            and not self.is_tail(child)
            and not self.is_tail(node)
        )

    def merge_child(self, node: TreeNode) -> TreeNode:
        """Path compression: fold the only child of `node` into `node` (which keeps its identity).

        The merged node keeps `node`'s hit_count and the later of the two access times.

        Raises:
            ValueError: if `can_merge_child(node)` is False.
        """
        if not self.can_merge_child(node):
            raise ValueError(f"merge_child: {node!r} has no mergeable only child")
        (child,) = node.children.values()
        node.key = node.key + child.key
        if node.is_on_device:
            node.pages = np.concatenate([node.pages, child.pages])
        else:
            node.host_pages = np.concatenate([node.host_pages, child.host_pages])
        node.last_access_time = max(node.last_access_time, child.last_access_time)
        node.children = child.children
        for grandchild in node.children.values():
            grandchild.parent = node
        child.parent = None
        child.children = {}
        self._num_nodes -= 1
        if node.is_on_device and self._is_device_leaf(node):
            self._push_candidate(node)
        return node

    def reset(self) -> Int32[np.ndarray, " F"]:
        """Empty the tree.

        Returns:
            int32 device page ids of every page the tree held; the caller frees them (host pages
            belong to the host tier, which resets itself).

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
        """Verify sizes, locks, page counts, tiers, page uniqueness, links and heap coverage.

        Cost is linear in the tree size; run it in tests or when the engine is idle.

        Raises:
            AssertionError: naming the first inconsistency found.
        """
        root = self._root
        assert root.parent is None and root.key == () and len(root.pages) == 0, "root must be empty"
        assert root.host_pages is None, "root must be on the device"
        page_size = self.page_size
        evictable = protected = host = num_nodes = 0
        seen_pages: set[int] = set()
        seen_host_pages: set[int] = set()
        heap_ids = {entry[2].id for entry in self._heap}
        assert len(heap_ids) == len(self._heap), "a node has more than one eviction heap entry"
        for node in self.iter_nodes():
            num_nodes += 1
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
            if self.is_tail(node):
                assert not node.children, f"tail {node!r} has children"
            else:
                assert len(node.key) > 0 and len(node.key) % page_size == 0, (
                    f"{node!r}: key of {len(node.key)} tokens is not a positive multiple of page_size"
                )
            num_pages = -(-len(node.key) // page_size)
            assert node.pages.dtype == np.int32 and node.pages.ndim == 1, (
                f"{node!r}: pages must be a 1-D int32 array, got {node.pages.dtype} {node.pages.shape}"
            )
            if node.is_on_device:
                assert len(node.pages) == num_pages, f"{node!r}: {len(node.pages)} pages for {len(node.key)} tokens"
                for page in node.pages.tolist():
                    assert page not in seen_pages, f"page {page} is held twice (again by {node!r})"
                    seen_pages.add(page)
            else:
                assert len(node.pages) == 0, f"host-resident {node!r} still holds device pages"
                assert node.host_pages.dtype == np.int32 and len(node.host_pages) == num_pages, (
                    f"{node!r}: {len(node.host_pages)} host pages for {len(node.key)} tokens"
                )
                assert node.lock_ref == 0, f"host-resident {node!r} is locked"
                for page in node.host_pages.tolist():
                    assert page not in seen_host_pages, f"host page {page} is held twice (again by {node!r})"
                    seen_host_pages.add(page)
            assert parent.is_on_device or not node.is_on_device, (
                f"device node {node!r} below host-resident {parent!r}"
            )
            children_locks = sum(child.lock_ref for child in node.children.values())
            assert node.lock_ref >= children_locks, (
                f"{node!r}: lock_ref below its children's total ({children_locks})"
            )
            if not node.is_on_device:
                host += len(node.key)
            elif node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if self._is_device_leaf(node):
                    assert node._in_heap, f"unlocked device leaf {node!r} is not an eviction candidate"
        assert root.lock_ref == 0, f"root lock_ref is {root.lock_ref}"
        assert evictable == self._evictable_size, (
            f"evictable_size {self._evictable_size} != {evictable} tokens found in the tree"
        )
        assert protected == self._protected_size, (
            f"protected_size {self._protected_size} != {protected} tokens found in the tree"
        )
        assert host == self._host_size, f"host_size {self._host_size} != {host} tokens found in the tree"
        assert num_nodes == self._num_nodes, f"num_nodes {self._num_nodes} != {num_nodes} nodes found"
        stray = [entry[2] for entry in self._heap if entry[2].id in heap_ids]
        assert all(node.parent is None for node in stray), "eviction heap holds a node unreachable from the root"

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
        self._num_nodes += 1
        node.key = node.key[num_tokens:]
        node.pages = node.pages[num_pages:]
        node.parent = upper
        upper.children[self._child_key(upper, node.key, 0, node.namespace)] = node
        return upper

    def _add_leaf(
        self,
        parent: TreeNode,
        key: tuple[int, ...],
        pos: int,
        pages: Int32[np.ndarray, " P"],
        namespace: Hashable,
        now: float,
    ) -> TreeNode:
        leaf = TreeNode(key[pos:], pages, parent, namespace, now)
        parent.children[self._child_key(parent, key, pos, namespace)] = leaf
        self._num_nodes += 1
        self._evictable_size += len(leaf.key)
        self._push_candidate(leaf)
        return leaf

    @staticmethod
    def _is_device_leaf(node: TreeNode) -> bool:
        """On the device with no child on the device (the eviction candidates, when unlocked)."""
        if node.host_pages is not None:
            return False
        return not node.children or not any(child.host_pages is None for child in node.children.values())

    def _push_candidate(self, node: TreeNode) -> None:
        """Add `node` to the eviction heap unless it has an entry; compact the heap once it holds
        more than 2 x num_nodes + 64 entries."""
        if not node._in_heap:
            node._in_heap = True
            heapq.heappush(self._heap, (node.last_access_time, node.id, node))
            if len(self._heap) > 2 * self._num_nodes + 64:
                self._compact_heap()

    def _compact_heap(self) -> None:
        """Keep only current candidates, so the next compaction is at least num_nodes pushes away."""
        heap = self._heap
        kept = []
        for entry in heap:
            node = entry[2]
            if node.parent is not None and node.lock_ref == 0 and self._is_device_leaf(node):
                kept.append(entry)
            else:
                node._in_heap = False
        heap[:] = kept  # in place: `evict` holds a reference to the list
        heapq.heapify(heap)


def path_pages(node: TreeNode) -> Int32[np.ndarray, " P"]:
    """Device page ids from the root down to `node` (a device node: its whole path is on the device), in
    sequence order."""
    parts = []
    while node.parent is not None:
        parts.append(node.pages)
        node = node.parent
    return np.concatenate(parts[::-1]).astype(np.int32) if parts else _EMPTY_PAGES


def path_tokens(node: TreeNode) -> tuple[int, ...]:
    """Token ids from the root down to and including `node`, in sequence order."""
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)
