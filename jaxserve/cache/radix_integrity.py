"""`RadixCache.check_integrity`: a linear-time audit of every invariant the radix tree keeps.

Kept apart from jaxserve/cache/radix_tree.py because it is a debugging aid, not part of the tree's
operations; it reads the tree's private bookkeeping on purpose, to check it against a recount.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxserve.cache.radix_tree import RadixCache


def check_integrity(tree: RadixCache) -> None:
    """Verify sizes, locks, page counts, tiers, page uniqueness, links and heap coverage.

    Cost is linear in the tree size; run it in tests or when the engine is idle.

    Raises:
        AssertionError: naming the first inconsistency found.
    """
    root = tree._root
    assert root.parent is None and root.key == () and len(root.pages) == 0, "root must be empty"
    assert root.host_pages is None, "root must be on the device"
    page_size = tree.page_size
    evictable = protected = host = num_nodes = 0
    seen_pages: set[int] = set()
    seen_host_pages: set[int] = set()
    heap_ids = {entry[2].id for entry in tree._heap}
    assert len(heap_ids) == len(tree._heap), "a node has more than one eviction heap entry"
    for node in tree.iter_nodes():
        num_nodes += 1
        assert node._in_heap == (node.id in heap_ids), (
            f"{node!r}: in-heap flag {node._in_heap} disagrees with the eviction heap"
        )
        heap_ids.discard(node.id)
        parent = node.parent
        assert parent is not None, f"{node!r} has no parent"
        child_key = tree._child_key(parent, node.key, 0, node.namespace)
        assert parent.children.get(child_key) is node, (
            f"{node!r} is not its parent's child under its first page {child_key!r}"
        )
        assert parent is root or parent.namespace == node.namespace, (
            f"{node!r} namespace differs from its parent's ({parent.namespace!r})"
        )
        if tree.is_tail(node):
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
            if tree._is_device_leaf(node):
                assert node._in_heap, f"unlocked device leaf {node!r} is not an eviction candidate"
    assert root.lock_ref == 0, f"root lock_ref is {root.lock_ref}"
    assert evictable == tree._evictable_size, (
        f"evictable_size {tree._evictable_size} != {evictable} tokens found in the tree"
    )
    assert protected == tree._protected_size, (
        f"protected_size {tree._protected_size} != {protected} tokens found in the tree"
    )
    assert host == tree._host_size, f"host_size {tree._host_size} != {host} tokens found in the tree"
    assert num_nodes == tree._num_nodes, f"num_nodes {tree._num_nodes} != {num_nodes} nodes found"
    stray = [entry[2] for entry in tree._heap if entry[2].id in heap_ids]
    assert all(node.parent is None for node in stray), "eviction heap holds a node unreachable from the root"
