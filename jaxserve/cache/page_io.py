"""Page copies between the device KV pool, the host tier and fresh device pages (the policy's I/O port).

The release policy moves KV pages but must not own the device pools (the model runner does, and it is
the only jit boundary) nor import the engine. It talks to this protocol instead:

    read_pages(pages)          start a device -> host copy; returns a `PendingRead`
    write_pages(pages, k, v)   host -> device
    copy_pages(src, dst)       device -> device (copy-on-write of a partly matched page)

`ModelRunner` implements it over its jax pools (jitted, donated updates; reads started with
`copy_to_host_async` and finished one step later). `NumpyKVPages` implements it over numpy arrays for
tests and benchmarks without a model.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from jaxtyping import Int32

from jaxserve.cache.kv_pool import PoolShape


class PendingRead(Protocol):
    """A device -> host copy in flight."""

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """Block until done; K and V as numpy `[L, >=n, KVH, ps, D]` (the first n rows are the pages)."""
        ...


class KVPageIO(Protocol):
    """Copies of whole KV pages; K and V move together. Arrays are `[L, n, KVH, ps, D]` in the pool's dtype,
    or for a compressed pool `[L, n, KVH, ps, PoolShape.host_head_dim]` bytes (values, then the scale)."""

    def read_pages(self, pages: Int32[np.ndarray, " n"]) -> PendingRead: ...

    def write_pages(self, pages: Int32[np.ndarray, " n"], k: np.ndarray, v: np.ndarray) -> None: ...

    def copy_pages(self, src: Int32[np.ndarray, " n"], dst: Int32[np.ndarray, " n"]) -> None: ...


class DoneRead:
    """A `PendingRead` that is already complete."""

    def __init__(self, k: np.ndarray, v: np.ndarray):
        self._kv = (k, v)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return self._kv


class NumpyKVPages:
    """A device pool made of numpy arrays `[L, N, KVH, ps, D]` (synchronous `KVPageIO`)."""

    def __init__(self, shape: PoolShape):
        host = (*shape.shape[:-1], shape.host_head_dim)  # a compressed pool's pages as their bytes
        self.k = np.zeros(host, shape.host_dtype)
        self.v = np.zeros(host, shape.host_dtype)

    def read_pages(self, pages: Int32[np.ndarray, " n"]) -> DoneRead:
        return DoneRead(self.k[:, pages], self.v[:, pages])

    def write_pages(self, pages: Int32[np.ndarray, " n"], k: np.ndarray, v: np.ndarray) -> None:
        self.k[:, pages] = k[:, : len(pages)]
        self.v[:, pages] = v[:, : len(pages)]

    def copy_pages(self, src: Int32[np.ndarray, " n"], dst: Int32[np.ndarray, " n"]) -> None:
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
