"""The paged KV pool: device arrays and the host-side page allocator.

Layout (DESIGN.md): `k_pool, v_pool : [num_layers, num_pages, num_kv_heads, page_size, head_dim]`: a page holds
each kv head's `page_size x head_dim` rows contiguously, which decode attention reads as whole blocks
(D-01).
Page 0 is a reserved dummy page that padding tokens write to; it is never handed out.

Sizing (`pool_budget` / `size_pool`): `--max-total-tokens` wins; otherwise `--mem-fraction-static`
of the device's memory minus the weights (on accelerators the default fraction is 0.85, SGLang's
rule). On CPU, where JAX reports no device memory, the base is the RAM available now
(`/proc/meminfo` MemAvailable); with neither flag the CPU pool gets min(1.5 GiB, 10% of that RAM), so a
laptop stays usable (D-04: a 30% share took 7.6 GB of RSS for a 135M model). The memory-derived
size is rounded down to 3 significant bits so that restarts reuse compiled executables. The rule and
the size are logged at start-up.

Tensor parallelism splits the pool over kv heads: each of `pool_shards` devices holds 1/pool_shards of
every page. On accelerators each device has its own memory, so the budget is one device's (its free
memory times the fraction, minus its share of the weights) and it must hold one share of the pool:
the pool gets `pool_shards` times the tokens one whole-pool device would. CPU host devices
(JAX_NUM_CPU_DEVICES) all live in the one RAM, so there the budget covers the whole pool at any tp.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PoolShape:
    """Shape of one pool; `bytes_per_token` counts K and V over all layers.

    `dtype` is the stored values' dtype; `scale_bytes` > 0 marks a compressed pool (`--kv-cache-dtype`,
    jaxserve/pallas/quantized_kv.py), whose every row (one token's K or V of one kv head) also has a
    scale of that many bytes. The host and storage tiers keep such a row as `host_head_dim` bytes."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    scale_bytes: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_pages, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row: head_dim values and, in a compressed pool, their scale."""
        return self.head_dim * jnp.dtype(self.dtype).itemsize + self.scale_bytes

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.row_bytes

    @property
    def host_dtype(self) -> np.dtype:
        """The dtype of the host tiers' copy of a page: the pool's, or bytes for a compressed pool."""
        return np.dtype(np.uint8) if self.scale_bytes else np.dtype(jnp.dtype(self.dtype))

    @property
    def host_head_dim(self) -> int:
        """The last axis of the host tiers' copy of a page: head_dim, or a compressed row's bytes."""
        return self.row_bytes if self.scale_bytes else self.head_dim

    @property
    def num_tokens(self) -> int:
        """Usable tokens (page 0 excluded)."""
        return (self.num_pages - 1) * self.page_size


def available_memory_bytes(devices=None) -> int:
    """Free memory in bytes of the least free of `devices` (default: the first device), each of which
    holds one share of the pool; on CPU (no device memory stats), MemAvailable from /proc/meminfo. Only
    this process's devices are read (PjRt has no memory stats for another process's devices)."""
    free = []
    for dev in list(devices) if devices is not None else jax.devices()[:1]:
        if dev.process_index != jax.process_index():
            continue
        stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
        if stats and "bytes_limit" in stats:
            free.append(int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    if free:
        return min(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


CPU_DEFAULT_POOL_CAP_BYTES = 3 << 29  # 1.5 GiB: with 2 GiB the default server's RSS measured 3.36-3.51 GB, at the 3.5 GB limit (D-04)
CPU_DEFAULT_POOL_RAM_FRACTION = 0.10
ACCELERATOR_DEFAULT_FRACTION = 0.85


@dataclasses.dataclass(frozen=True)
class PoolBudget:
    """The KV pool's memory budget in bytes and the rule that chose it (logged at start-up)."""

    budget_bytes: int
    rule: str


def pool_budget(
    *, mem_fraction_static: float | None, weights_bytes: int, platform: str, available_bytes: int
) -> PoolBudget:
    """The pool's budget when --max-total-tokens is not given (bytes; see the module docstring).

    Args:
        mem_fraction_static: --mem-fraction-static, or None.
        weights_bytes: the model's weights one device holds (subtracted on accelerators, where the
            fraction covers both; with tensor parallelism, one device's share).
        platform: "cpu", "gpu" or "tpu".
        available_bytes: free memory of one device (the least free of the mesh), or on CPU the
            available RAM (`available_memory_bytes()`, read after the weights are loaded: on CPU the
            fraction is of what the weights leave, so they are not subtracted again).

    On accelerators the budget is one device's; on CPU, the whole pool's (see the module docstring).
    """
    gib = available_bytes / (1 << 30)
    if platform == "cpu" and mem_fraction_static is None:
        cap = min(CPU_DEFAULT_POOL_CAP_BYTES, int(available_bytes * CPU_DEFAULT_POOL_RAM_FRACTION))
        return PoolBudget(cap, f"CPU default: min(1.5 GiB, 10% of {gib:.1f} GiB available RAM); "
                               "--max-total-tokens or --mem-fraction-static override it")
    if platform == "cpu":
        return PoolBudget(int(available_bytes * mem_fraction_static),
                          f"--mem-fraction-static {mem_fraction_static:g} of {gib:.1f} GiB available RAM")
    fraction = mem_fraction_static or ACCELERATOR_DEFAULT_FRACTION
    return PoolBudget(int(available_bytes * fraction - weights_bytes),
                      f"{fraction:g} of {gib:.1f} GiB free device memory minus {weights_bytes / (1 << 30):.2f} GiB of weights")


def size_pool(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: str,
    max_total_tokens: int | None,
    mem_fraction_static: float | None,
    weights_bytes: int,
    platform: str,
    max_num_pages: int | None = None,
    pool_shards: int = 1,
    available_bytes: int | None = None,
    layers_per_token: float | None = None,
    scale_bytes: int = 0,
) -> PoolShape:
    """Choose the number of pages (see the module docstring for the rule); `max_num_pages`
    (`--radix-cache-max-num-blocks`) caps the usable pages.

    Args:
        num_kv_heads: kv heads of the pool (after kv-head replication for tensor parallelism).
        weights_bytes: the weights one device holds (`jaxserve.parallel.per_device_nbytes`).
        pool_shards: devices the pool is split over by kv heads (`jaxserve.parallel.pool_shards`): on
            accelerators each holds `bytes_per_token / pool_shards` per token against its own budget.
        available_bytes: free memory of the least free device (default `available_memory_bytes()`).
        layers_per_token: layers of K/V one token of the page space costs, when not `num_layers` (the
            hybrid window pool, `jaxserve.cache.window_pool.size_hybrid_pool`).
        dtype, scale_bytes: the stored values' dtype and, for a compressed pool (`--kv-cache-dtype`), the
            bytes of each row's scale (`PoolShape`).

    Raises:
        ValueError: the memory budget leaves no room for two pages.
    """
    probe = PoolShape(num_layers, 2, page_size, num_kv_heads, head_dim, dtype, scale_bytes)
    bytes_per_token = probe.bytes_per_token if layers_per_token is None else int(
        probe.bytes_per_token / num_layers * layers_per_token)
    if max_total_tokens is not None:
        num_tokens = max_total_tokens
        rule = "--max-total-tokens"
    else:
        budget = pool_budget(
            mem_fraction_static=mem_fraction_static, weights_bytes=weights_bytes, platform=platform,
            available_bytes=available_memory_bytes() if available_bytes is None else available_bytes,
        )
        # host devices share one RAM, so the CPU budget is the whole pool's at any tp
        shards = 1 if platform == "cpu" else pool_shards
        bytes_per_token_per_device = bytes_per_token // shards  # kv heads divide by the shards
        num_tokens = _round_down_coarse(int(max(0, budget.budget_bytes) // bytes_per_token_per_device))
        rule = budget.rule + (f", per device: the pool is split over {shards} devices" if shards > 1 else "")
    num_pages = num_tokens // page_size + 1
    if max_num_pages is not None:
        num_pages = min(num_pages, max_num_pages + 1)
    if num_pages < 3:
        raise ValueError(f"the KV pool would hold {num_tokens} tokens: raise --max-total-tokens or --mem-fraction-static")
    shape = dataclasses.replace(probe, num_pages=num_pages)
    logger.info(
        "KV pool: %d tokens (%d pages, %.2f GiB in all, %.2f GiB per device, %s) by %s", shape.num_tokens, num_pages,
        shape.num_tokens * bytes_per_token / (1 << 30),
        shape.num_tokens * bytes_per_token / max(1, pool_shards) / (1 << 30),
        f"{shape.dtype} with a {scale_bytes}-byte scale per token and kv head" if scale_bytes else shape.dtype, rule,
    )
    return shape


def _round_down_coarse(n: int) -> int:
    """Round down to 3 significant bits (at most 8 sizes per octave): free memory drifts between
    starts, and a pool of a different size is a different shape, which would miss the compilation cache."""
    if n < 16:
        return n
    step = 1 << (n.bit_length() - 3)
    return n // step * step


class PageAllocator:
    """Free list of page ids 1..num_pages-1 (numpy only; page 0 is the dummy page).

    `can_allocate(n)` / `allocate(n)` / `free(pages)`. Freeing a page that is already free or out of
    range raises, so double frees surface in tests instead of corrupting the pool.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("need at least one page besides the dummy page 0")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))
        self._is_free = np.ones(num_pages, bool)
        self._is_free[0] = False

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_used(self) -> int:
        """Pages handed out and not freed."""
        return self.num_pages - 1 - len(self._free)

    def free_pages(self) -> list[int]:
        """The page ids now free (a copy), for integrity checks."""
        return list(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        """Take `num_pages` pages. Raises MemoryError when not enough are free."""
        if num_pages > len(self._free):
            raise MemoryError(f"asked for {num_pages} pages, {len(self._free)} free")
        if num_pages == 0:
            return []
        pages = self._free[-num_pages:]
        del self._free[-num_pages:]
        self._is_free[pages] = False
        return pages

    def free(self, pages) -> None:
        """Return pages to the free list. Raises ValueError on a double free or a bad id."""
        pages = [int(p) for p in np.asarray(pages, dtype=np.int64).reshape(-1)]
        if not pages:
            return
        arr = np.asarray(pages)
        if arr.min() < 1 or arr.max() >= self.num_pages:
            raise ValueError(f"page id out of range in {pages}")
        if not self._is_free[arr].any() and len(set(pages)) == len(pages):
            self._is_free[arr] = True
            self._free.extend(pages)
            return
        raise ValueError(f"double free of pages {sorted(p for p in pages if self._is_free[p])} or repeated ids")
