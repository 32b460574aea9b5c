"""The radix tree's node type and the typed results of its match and insert (jaxserve/cache/radix_tree.py).

A node is one edge of the tree together with the node below it: its token keys, its KV page ids on
the device or, while host-resident, on the host tier, its lock_ref and the access statistics the
release policy reads (last_access_time, hit_count).
"""

from __future__ import annotations

import itertools
from typing import Hashable, NamedTuple

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
