"""The radix tree's eviction candidates: a lazily pruned min-heap of unlocked device leaves (LRU).

Entries are (last_access_time, node id, node). A node is pushed when it becomes an unlocked device
leaf and has at most one entry (`TreeNode._in_heap`); entries that went stale (the node was locked, got
a device child, moved to the host or was removed) are dropped when popped or compacted away when the
heap outgrows twice the tree. `RadixCache.evict` pops them.
"""

from __future__ import annotations

import heapq

from jaxserve.cache.radix_node import TreeNode

HeapEntry = tuple[float, int, TreeNode]


def is_device_leaf(node: TreeNode) -> bool:
    """On the device with no child on the device (the eviction candidates, when unlocked)."""
    if node.host_pages is not None:
        return False
    return not node.children or not any(child.host_pages is None for child in node.children.values())


def push_candidate(heap: list[HeapEntry], node: TreeNode, num_nodes: int) -> None:
    """Add `node` to `heap` unless it has an entry; compact the heap once it holds more than
    2 x `num_nodes` + 64 entries."""
    if not node._in_heap:
        node._in_heap = True
        heapq.heappush(heap, (node.last_access_time, node.id, node))
        if len(heap) > 2 * num_nodes + 64:
            compact_heap(heap)


def compact_heap(heap: list[HeapEntry]) -> None:
    """Keep only current candidates, so the next compaction is at least `num_nodes` pushes away."""
    kept = []
    for entry in heap:
        node = entry[2]
        if node.parent is not None and node.lock_ref == 0 and is_device_leaf(node):
            kept.append(entry)
        else:
            node._in_heap = False
    heap[:] = kept  # in place: `evict` holds a reference to the list
    heapq.heapify(heap)
