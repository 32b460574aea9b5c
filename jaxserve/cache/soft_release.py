"""Release policy stage 2: decay-aware soft release to a host tier, and recall.

A radix-tree node whose KV is not needed on the device right now is *soft-freed*: its pages are copied
to the host tier (`HostKVPool`), its device pages go back to the allocator, and it keeps its place in
the tree as a host-resident node (`RadixCache.offload`). A later match reports it
(`MatchResult.host_nodes`) and `recall` copies it back into fresh device pages instead of recomputing
it. After SGLang's hierarchical cache (HiRadixCache: evict = write back to host, match = load back),
with a decay-aware trigger:

- Hit sampling. Every sample period (1 s, or the threshold when that is shorter) the unit records each
  node's new hits (`TreeNode.hit_count` deltas) in a sliding window (10 s). A node that is unlocked and
  had no hit or insert for `--radix-cache-soft-free-threshold` seconds (`now - last_access_time`,
  checked at sample times) is *cold*. When the adaptive mode allows it and device usage is above
  `--radix-cache-evict-threshold`, cold device leaves are soft-freed proactively, those with the fewest
  windowed hits first, until usage is back under the threshold or the host tier has no free page
  (proactive release never drops host KV).
- Pressure. When an allocation needs pages, `evict` takes the tree's LRU device leaves and soft-frees
  them; when the host tier is full it first drops its own LRU host-resident leaves, and only a node the
  host tier cannot hold at all is dropped outright.

Copies stay off the decode loop's critical path: a device -> host copy is started (`KVPageIO.read_pages`,
`copy_to_host_async` on the device) when the node is released and finished at the next scheduler
iteration (`finish_pending`), after a forward step has run. The device pages can be reused at once:
the device executes the copy before any later step writes them. A recall writes the host copy into
fresh pages with one scatter before the step that reads them.
"""

from __future__ import annotations

import collections
import heapq
import time
from typing import Callable

import numpy as np
from jaxtyping import Int32

from jaxserve.cache.host_pool import HostKVPool
from jaxserve.cache.kv_pool import PageAllocator
from jaxserve.cache.page_io import KVPageIO, PendingRead
from jaxserve.cache.radix_tree import RadixCache, TreeNode

_EMPTY_PAGES = np.zeros((0,), np.int32)
MAX_LATENCY_OBSERVATIONS = 1024


class SoftRelease:
    """Moves tree nodes between the device pool and the host tier (see the module docstring).

    Args:
        tree: the radix cache.
        allocator: the device page allocator.
        host: the host tier.
        threshold_s: seconds without a hit after which an unlocked node is cold.
        window_s: length of the hit window (seconds).
        sample_period_s: seconds between hit samples; the effective period is
            `min(sample_period_s, threshold_s)`, so a threshold of 0 samples at every call.

    `io` must be set (the model runner, or `NumpyKVPages`) before anything is released.
    """

    def __init__(
        self,
        tree: RadixCache,
        allocator: PageAllocator,
        host: HostKVPool,
        threshold_s: float,
        window_s: float = 10.0,
        sample_period_s: float = 1.0,
    ):
        self.tree = tree
        self.allocator = allocator
        self.host = host
        self.io: KVPageIO | None = None
        # called with a node about to leave the tree for good, while it still holds its KV (write_back)
        self.on_drop: Callable[[TreeNode], None] | None = None
        self.threshold_s = threshold_s
        self.sample_period_s = max(0.0, min(sample_period_s, threshold_s))
        self._window_len = max(1, int(round(window_s / max(sample_period_s, 1e-9))))
        self._last_sample = -float("inf")
        # node id -> (hit_count at the last sample, hits per sample over the window)
        self._windows: dict[int, tuple[int, collections.deque]] = {}
        # (node, device pages, host pages): released this call, copy not started yet
        self._to_copy: list[tuple[TreeNode, np.ndarray, np.ndarray]] = []
        # (host pages, copy in flight)
        self._pending: list[tuple[np.ndarray, PendingRead]] = []
        # LRU heap of host-resident leaves (lazy deletion, like the tree's eviction heap)
        self._host_heap: list[tuple[float, int, TreeNode]] = []
        self._host_heap_ids: set[int] = set()
        self.num_soft_freed_pages = 0
        self.num_recalled_pages = 0
        self.num_recalls = 0
        self.num_host_drops = 0
        self.num_device_drops = 0
        self.recall_latencies_s: collections.deque = collections.deque(maxlen=MAX_LATENCY_OBSERVATIONS)

    # Hit sampling

    def is_sample_due(self, now: float) -> bool:
        return now - self._last_sample >= self.sample_period_s

    def sample(self, now: float) -> None:
        """Record every node's hits since the last sample (O(nodes))."""
        windows = {}
        for node in self.tree.iter_nodes():
            entry = self._windows.get(node.id)
            if entry is None:
                window = collections.deque(maxlen=self._window_len)
            else:
                window = entry[1]
                window.append(node.hit_count - entry[0])
            windows[node.id] = (node.hit_count, window)
        self._windows = windows
        self._last_sample = now

    def window_hits(self, node: TreeNode) -> int:
        """Hits of `node` over the sliding window (0 for a node not sampled yet)."""
        entry = self._windows.get(node.id)
        return sum(entry[1]) if entry is not None else 0

    def is_cold(self, node: TreeNode, now: float) -> bool:
        return node.lock_ref == 0 and now - node.last_access_time >= self.threshold_s

    # Device -> host

    def release_cold(self, now: float, max_pages: int) -> int:
        """Soft-free up to `max_pages` device pages of cold, unlocked device leaves into free host pages.

        Children go before their parents (a parent becomes a leaf once its children are released).

        Returns:
            device pages freed (back in the allocator).
        """
        nodes = list(self.tree.iter_nodes())
        nodes.reverse()  # children before parents; the stable sort keeps that order among equals
        cold = [n for n in nodes if n.is_on_device and self.is_cold(n, now)]
        cold.sort(key=lambda n: (self.window_hits(n), n.last_access_time))
        num_freed = 0
        for node in cold:
            if num_freed >= max_pages:
                break
            if node.parent is None or any(c.is_on_device for c in node.children.values()):
                continue
            num_pages = len(node.pages)
            if not self.host.can_allocate(num_pages):
                continue
            host_pages = self.host.allocate(num_pages)
            self._to_copy.append((node, node.pages.copy(), host_pages))
            self.allocator.free(self.tree.offload(node, host_pages))
            self._push_host(node)
            num_freed += num_pages
        self._start_copies()
        return num_freed

    def evict(self, num_tokens: int) -> Int32[np.ndarray, " F"]:
        """Free at least `num_tokens` device tokens, LRU first, soft-freeing before dropping.

        Returns:
            int32 device page ids to return to the allocator.
        """
        freed = self.tree.evict(num_tokens, offload=self._offload_victim)
        for node, _, _ in self._to_copy:
            self._push_host(node)
        self._start_copies()
        return freed

    def _offload_victim(self, node: TreeNode) -> Int32[np.ndarray, " P"] | None:
        num_pages = len(node.pages)
        while not self.host.can_allocate(num_pages) and self._drop_host_lru():
            pass
        if not self.host.can_allocate(num_pages):
            self._drop_host_subtree(node)
            if self.on_drop is not None:
                self.on_drop(node)
            self.num_device_drops += 1
            return None
        host_pages = self.host.allocate(num_pages)
        self._to_copy.append((node, node.pages.copy(), host_pages))
        return host_pages

    def _start_copies(self) -> None:
        if not self._to_copy:
            return
        pages = np.concatenate([entry[1] for entry in self._to_copy])
        host_pages = np.concatenate([entry[2] for entry in self._to_copy])
        self._to_copy = []
        self._pending.append((host_pages, self.io.read_pages(pages)))
        self.num_soft_freed_pages += len(pages)

    def finish_pending(self) -> None:
        """Complete the device -> host copies started earlier (blocks only if one is still running)."""
        for host_pages, read in self._pending:
            k, v = read.result()
            self.host.write(host_pages, k, v)
        self._pending = []

    # Host -> device

    def recall(self, host_nodes: tuple[TreeNode, ...], reserve: Callable[[int], bool]) -> list[TreeNode]:
        """Copy host-resident `host_nodes` (a path continuing a device node) back to the device.

        Args:
            host_nodes: from `MatchResult.host_nodes`; the caller holds a lock on their device parent.
            reserve: makes `n` device pages free (evicting if needed); returns whether it could.

        Returns:
            the restored nodes, a prefix of `host_nodes` (shorter when the pool cannot take them all
            or the host tier dropped some while pages were being freed).
        """
        num_pages = sum(len(n.host_pages) for n in host_nodes)
        reserve(num_pages)
        nodes, total = [], 0
        for node in host_nodes:
            if node.parent is None or node.is_on_device:
                break
            if total + len(node.host_pages) > self.allocator.num_free:
                break
            nodes.append(node)
            total += len(node.host_pages)
        if not nodes:
            return []
        t0 = time.perf_counter()
        self.finish_pending()
        host_pages = np.concatenate([n.host_pages for n in nodes])
        pages = np.asarray(self.allocator.allocate(total), np.int32)
        k, v = self.host.read(host_pages)
        self.io.write_pages(pages, k, v)
        offset = 0
        for node in nodes:
            n = len(node.host_pages)
            self.tree.restore(node, pages[offset : offset + n])
            offset += n
        self.host.free(host_pages)
        self.recall_latencies_s.append(time.perf_counter() - t0)
        self.num_recalls += 1
        self.num_recalled_pages += total
        return nodes

    # Host tier bookkeeping

    def free_host_pages(self, host_pages: Int32[np.ndarray, " H"]) -> None:
        """Free host pages the tree gave back (e.g. `InsertResult.freed_host_pages`)."""
        if len(host_pages):
            self.finish_pending()
            self.host.free(host_pages)

    def _push_host(self, node: TreeNode) -> None:
        if node.parent is not None and not node.is_on_device and not node.children and node.id not in self._host_heap_ids:
            self._host_heap_ids.add(node.id)
            heapq.heappush(self._host_heap, (node.last_access_time, node.id, node))

    def rebuild_host_heap(self) -> None:
        """Recompute the host LRU heap from the tree (after merges reshape it)."""
        self._host_heap, self._host_heap_ids = [], set()
        for node in self.tree.iter_nodes():
            self._push_host(node)

    def _drop_host_lru(self) -> bool:
        """Drop the least recently used host-resident leaf. Returns False when there is none."""
        for attempt in range(2):
            heap = self._host_heap
            while heap:
                access_time, _, node = heapq.heappop(heap)
                self._host_heap_ids.discard(node.id)
                if node.parent is None or node.is_on_device or node.children:
                    continue
                if access_time < node.last_access_time:
                    self._push_host(node)
                    continue
                self._drop_host_node(node)
                return True
            if attempt == 0 and self.tree.host_size() > 0:
                self.rebuild_host_heap()
        return False

    def _drop_host_node(self, node: TreeNode) -> None:
        if self.on_drop is not None:
            self.on_drop(node)
        parent = node.parent
        self.tree.remove_leaf(node)
        # A copy into these pages that has not started yet is moot; one in flight must land first.
        self._to_copy = [entry for entry in self._to_copy if entry[0] is not node]
        self.free_host_pages(node.host_pages)
        self.num_host_drops += 1
        self._push_host(parent)

    def _drop_host_subtree(self, node: TreeNode) -> None:
        order, stack = [], list(node.children.values())
        while stack:
            child = stack.pop()
            order.append(child)
            stack.extend(child.children.values())
        for child in reversed(order):  # children before parents
            self._drop_host_node(child)

    def reset(self) -> None:
        """Forget all host-resident state (after the tree was reset)."""
        self.finish_pending()
        self._to_copy = []
        self._windows = {}
        self._host_heap, self._host_heap_ids = [], set()
        self.host.reset()
