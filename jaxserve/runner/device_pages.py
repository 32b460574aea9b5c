"""Whole-page copies of the device KV pools `[L, N, KVH, ps, D]`, for `ModelRunner`'s `KVPageIO`
methods (jaxserve/cache/page_io.py): the host tier's device <-> host copies and copy-on-write of a
partly matched page. Page counts are padded to powers of two with the dummy page 0, so each count
bucket compiles once; writes are donated updates of the pools."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jaxserve.runner.buckets import pow2_at_least


class DevicePageRead:
    """A device -> host copy of K/V pages in flight (`PendingRead`)."""

    def __init__(self, k: jax.Array, v: jax.Array):
        self._k, self._v = k, v

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self._k), np.asarray(self._v)


def padded_page_ids(pages) -> np.ndarray:
    """`pages` as int32 ids padded with the dummy page 0 to a power of two (one compile per bucket)."""
    pages = np.asarray(pages, np.int32).reshape(-1)
    out = np.zeros(pow2_at_least(len(pages)), np.int32)
    out[: len(pages)] = pages
    return out


def _gather_pages(k_pool, v_pool, pages):
    # [L, N, KVH, ps, D] -> [L, n, KVH, ps, D]
    return k_pool[:, pages], v_pool[:, pages]


def _scatter_pages(k_pool, v_pool, pages, k, v):
    return k_pool.at[:, pages].set(k.astype(k_pool.dtype)), v_pool.at[:, pages].set(v.astype(v_pool.dtype))


def _copy_pages(k_pool, v_pool, src, dst):
    return k_pool.at[:, dst].set(k_pool[:, src]), v_pool.at[:, dst].set(v_pool[:, src])


# the page copies of a single-device pool (the results stay on its device)
PAGE_JITS: dict[str, Callable] = {
    "gather": jax.jit(_gather_pages),
    "scatter": jax.jit(_scatter_pages, donate_argnums=(0, 1)),
    "copy": jax.jit(_copy_pages, donate_argnums=(0, 1)),
}


def sharded_page_jits(rep, pool) -> dict[str, Callable]:
    """The page copies over a sharded pool: their results keep the pool's sharding (the compiled steps
    take exactly that), and pages read for the host come back whole."""
    return {
        "gather": jax.jit(_gather_pages, out_shardings=(rep, rep)),
        "scatter": jax.jit(_scatter_pages, donate_argnums=(0, 1), out_shardings=(pool, pool)),
        "copy": jax.jit(_copy_pages, donate_argnums=(0, 1), out_shardings=(pool, pool)),
    }
