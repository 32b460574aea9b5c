"""The host KV tier: numpy K/V arrays with the device pool's page layout and a free list.

Release policy stage 2 (DESIGN.md, "Radix cache and release policy") moves the KV of cold radix-tree
nodes here instead of dropping it, and copies it back on a later match. The layout mirrors the device
pool, `[num_layers, num_pages, num_kv_heads, page_size, head_dim]`, so one page moves with one slice.
After SGLang's hierarchical cache (`HostKVCache`, python/sglang/srt/mem_cache/memory_pool_host.py),
sized by `--hicache-ratio` (host pages / device pages) or `--hicache-size` (GB).

The arrays are created with `np.zeros`, whose pages the OS maps lazily, so an unused tier costs
address space, not memory. Page ids run 0..num_pages-1 (no dummy page).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Int32

from jaxserve.cache.kv_pool import PoolShape


def num_host_pages(device_shape: PoolShape, hicache_ratio: float, hicache_size_gb: float) -> int:
    """Host tier size in pages: `hicache_size_gb` GB (1e9 bytes) when > 0, else `hicache_ratio` x the
    device pool's usable pages.

    Raises:
        ValueError: if the result is below one page.
    """
    page_bytes = device_shape.bytes_per_token * device_shape.page_size
    if hicache_size_gb > 0:
        num_pages = int(hicache_size_gb * 1e9 // page_bytes)
    else:
        num_pages = int(hicache_ratio * (device_shape.num_pages - 1))
    if num_pages < 1:
        raise ValueError(
            f"the host KV tier would hold {num_pages} pages of {page_bytes} bytes: raise --hicache-ratio or --hicache-size"
        )
    return num_pages


class HostKVPool:
    """Host pages for K and V: `allocate` / `free` page ids, `write` / `read` their contents.

    Args:
        device_shape: the device pool's shape; the host pool copies every dimension but the page count.
        num_pages: host pages.

    Freeing a page twice or an id out of range raises ValueError, like the device `PageAllocator`.
    """

    def __init__(self, device_shape: PoolShape, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        s = device_shape
        self.num_pages = num_pages
        # a compressed pool's pages arrive as bytes, each row its values then its scale (PoolShape.host_head_dim)
        self.page_shape = (s.num_kv_heads, s.page_size, s.host_head_dim)
        # [L, H, KVH, ps, D]
        self.k = np.zeros((s.num_layers, num_pages, *self.page_shape), s.host_dtype)
        self.v = np.zeros((s.num_layers, num_pages, *self.page_shape), s.host_dtype)
        self.bytes_per_page = 2 * self.k[:, 0].nbytes
        self.reset()

    def reset(self) -> None:
        """Mark every page free (contents are left as they are)."""
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._is_free = np.ones(self.num_pages, bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> Int32[np.ndarray, " P"]:
        """Take `num_pages` host pages. Raises MemoryError when not enough are free."""
        if num_pages > len(self._free):
            raise MemoryError(f"host KV tier: asked for {num_pages} pages, {len(self._free)} free")
        if num_pages == 0:
            return np.zeros((0,), np.int32)
        pages = self._free[-num_pages:]
        del self._free[-num_pages:]
        self._is_free[pages] = False
        return np.asarray(pages, np.int32)

    def free(self, pages) -> None:
        """Return host pages. Raises ValueError on a double free or a bad id."""
        arr = np.asarray(pages, dtype=np.int64).reshape(-1)
        if len(arr) == 0:
            return
        if arr.min() < 0 or arr.max() >= self.num_pages:
            raise ValueError(f"host page id out of range in {arr.tolist()}")
        if self._is_free[arr].any() or len(np.unique(arr)) != len(arr):
            raise ValueError(f"double free of host pages {sorted(arr[self._is_free[arr]].tolist())} or repeated ids")
        self._is_free[arr] = True
        self._free.extend(arr.tolist())

    def write(self, pages: Int32[np.ndarray, " P"], k: np.ndarray, v: np.ndarray) -> None:
        """Store K/V `[L, len(pages), KVH, ps, D]` into `pages` (extra rows of k/v are ignored)."""
        n = len(pages)
        self.k[:, pages] = k[:, :n]
        self.v[:, pages] = v[:, :n]

    def read(self, pages: Int32[np.ndarray, " P"]) -> tuple[np.ndarray, np.ndarray]:
        """K/V of `pages`, each `[L, len(pages), KVH, ps, D]` (copies)."""
        return self.k[:, pages], self.v[:, pages]
