"""The hybrid sliding-window KV pool: full-attention layers keep every page, window layers a smaller space
that must hold only the pages inside the running requests' windows (SGLang's hybrid SWA memory pool,
`--swa-full-tokens-ratio`; D-46).

Every page has one id in the **full page space** `1..N-1`: the page tables, the radix tree, the scheduler
and the integrity check know only these ids. A window layer stores a page in a smaller **window page
space** `1..Nw-1`: `window_page_of[page]` is the page's window page, 0 while it has none (it fell out of
every window that reads it; a tombstone in SGLang's words). Page 0 of either space is the dummy page that
padding writes to.

Device layout (`WindowLayout`): one array per K and V, `[1, F, KVH, ps, D]` of F flat pages. The full
layers' pages come first (full layer i at flat pages `i * N + page`), then each window layer's block of Nw
pages (window layer j at `Lf * N + j * Nw + window_page`): F = Lf * N + Lw * Nw. A step carries both page
tables, and each layer picks its own with `page_base` and `uses_window`
(`jaxserve.model.forward_batch.WindowTables`), so the compiled layer body stays one for every layer
(`lax.scan` and the host layer loop index layers by a traced number). The arrays are flat from the
start: reshaping `[R, N, ...]` pools to flat pages inside the step made XLA:CPU copy both pools in every
layer (a Gemma 3 270m decode step 38x slower), which the flat arrays avoid (D-46).

Lifetime of a window page (`HybridPageAllocator`): a page gets one when it is allocated (new tokens are
always inside the window) and loses it when it is freed, or earlier when `drop_window` is called for it:
the cache manager does that for a request's decoded tokens once its window left them, and for the tree's
pages (kept as cache) when the window space runs short (jaxserve/scheduler/cache_manager.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from jaxserve.cache.kv_pool import PageAllocator, PoolShape, size_pool

logger = logging.getLogger(__name__)

DEFAULT_SWA_FULL_TOKENS_RATIO = 0.8  # SGLang's default: window-layer tokens per full-layer token


@dataclasses.dataclass(frozen=True)
class WindowLayout:
    """Where each layer's pages live in the hybrid pool (static for the process).

    Fields:
        num_pages: N, pages of the full page space (page 0 included).
        num_window_pages: Nw, pages of the window page space (page 0 included).
        window: tokens a window layer attends to (the largest window of the model's layers).
        layer_windowed: per layer, whether it is a window layer.
    """

    num_pages: int
    num_window_pages: int
    window: int
    layer_windowed: tuple[bool, ...]

    @property
    def num_full_layers(self) -> int:
        return sum(not w for w in self.layer_windowed)

    @property
    def num_window_layers(self) -> int:
        return sum(self.layer_windowed)

    @property
    def num_flat_pages(self) -> int:
        """F: pages of the device pool, every layer's page space one after the other."""
        return self.num_full_layers * self.num_pages + self.num_window_layers * self.num_window_pages

    def device_pool_shape(self, shape: PoolShape) -> PoolShape:
        """The device arrays' shape, `[1, F, KVH, ps, D]`, for the full-space pool `shape`."""
        return dataclasses.replace(shape, num_layers=1, num_pages=self.num_flat_pages)

    def page_base(self) -> np.ndarray:
        """[L] int32: the flat page where each layer's page space starts."""
        base, full, window = np.zeros(len(self.layer_windowed), np.int32), 0, 0
        for layer, windowed in enumerate(self.layer_windowed):
            if windowed:
                base[layer] = self.num_full_layers * self.num_pages + window * self.num_window_pages
                window += 1
            else:
                base[layer] = full * self.num_pages
                full += 1
        return base

    def uses_window(self) -> np.ndarray:
        """[L] int32: 1 for a window layer (it reads the window page table), 0 for a full layer."""
        return np.asarray(self.layer_windowed, np.int32)


def plan_window_layout(
    layer_windows: tuple[int | None, ...], num_pages: int, swa_full_tokens_ratio: float
) -> WindowLayout:
    """The layout of a pool of `num_pages` full pages whose window layers get `swa_full_tokens_ratio`
    as many pages (at least 2, so one is usable).

    Raises:
        ValueError: no layer has a window, or the ratio is not in (0, 1].
    """
    windows = [w for w in layer_windows if w is not None]
    if not windows:
        raise ValueError("the model has no sliding-window layer: the hybrid pool does not apply")
    if not 0 < swa_full_tokens_ratio <= 1:
        raise ValueError(f"--swa-full-tokens-ratio must be in (0, 1], got {swa_full_tokens_ratio}")
    num_window_pages = max(2, int((num_pages - 1) * swa_full_tokens_ratio) + 1)
    return WindowLayout(num_pages, num_window_pages, max(windows), tuple(w is not None for w in layer_windows))


def layers_per_full_token(layer_windows: tuple[int | None, ...], swa_full_tokens_ratio: float) -> float:
    """Layers of KV one full-space token costs in the hybrid pool: Lf + Lw * ratio (pool sizing)."""
    num_window = sum(w is not None for w in layer_windows)
    return len(layer_windows) - num_window + num_window * swa_full_tokens_ratio


def window_pages_needed(num_tokens: int, window: int, page_size: int) -> int:
    """Window pages one sequence of `num_tokens` tokens holds at most between steps: the pages that
    cover its last `window` tokens (the next token's window reaches back `window - 1` of them)."""
    if num_tokens <= 0:
        return 0
    first = max(0, num_tokens - window + 1) // page_size
    return math.ceil(num_tokens / page_size) - first


def size_hybrid_pool(
    layer_windows: tuple[int | None, ...], swa_full_tokens_ratio: float, **size_pool_args
) -> tuple[PoolShape, WindowLayout]:
    """`kv_pool.size_pool` for the hybrid pool: the budget buys full-space tokens at
    `layers_per_full_token` layers each (`--max-total-tokens` counts full-space tokens); returns the
    full page space's shape (what every layer's pages would take: its `num_tokens` is the capacity)
    and the layout (`layout.device_pool_shape(shape)`: the arrays).

    Raises:
        ValueError: as `size_pool` and `plan_window_layout`.
    """
    plan_window_layout(layer_windows, 3, swa_full_tokens_ratio)  # refuse a bad ratio before sizing
    shape = size_pool(num_layers=len(layer_windows),
                      layers_per_token=layers_per_full_token(layer_windows, swa_full_tokens_ratio), **size_pool_args)
    layout = plan_window_layout(layer_windows, shape.num_pages, swa_full_tokens_ratio)
    per_page = shape.bytes_per_token // shape.num_layers * shape.page_size
    logger.info(
        "Hybrid sliding-window KV pool: %d full layers hold %d tokens, %d window layers (window %d) hold %d "
        "tokens (--swa-full-tokens-ratio %g); %.2f GiB in all, against %.2f GiB for every layer's pages",
        layout.num_full_layers, (layout.num_pages - 1) * shape.page_size, layout.num_window_layers, layout.window,
        (layout.num_window_pages - 1) * shape.page_size, swa_full_tokens_ratio,
        layout.num_flat_pages * per_page / (1 << 30), len(layer_windows) * shape.num_pages * per_page / (1 << 30),
    )
    return shape, layout


def check_window_pool_fits(layout: WindowLayout, max_extend_tokens: int, page_size: int) -> None:
    """Refuse a window space too small for one request: its window and a whole prefill chunk.

    Raises:
        ValueError: naming --swa-full-tokens-ratio and the tokens needed.
    """
    need = min(layout.num_pages - 1, -(-(layout.window + max_extend_tokens) // page_size) + 1)
    if layout.num_window_pages - 1 < need:
        raise ValueError(
            f"the window layers' pool holds {(layout.num_window_pages - 1) * page_size} tokens, and one request "
            f"needs up to {need * page_size} of it (its {layout.window}-token window plus a "
            f"{max_extend_tokens}-token prefill chunk, at most the whole pool): raise --swa-full-tokens-ratio or "
            "--max-total-tokens, or lower --chunked-prefill-size")


class HybridPageAllocator(PageAllocator):
    """The full page space's free list (a `PageAllocator`) with each page's window page.

    `allocate(n)` gives n pages, each with a window page; `free(pages)` frees both parts;
    `drop_window(pages)` frees only the window parts. `num_free` is what both spaces can give.
    `window_locks[page]`: how many running requests' windows cover the page (kept by the cache
    manager); freeing or dropping a page that a window still covers raises.
    """

    def __init__(self, layout: WindowLayout):
        super().__init__(layout.num_pages)
        self.layout = layout
        self.window = PageAllocator(layout.num_window_pages)
        self.window_page_of = np.zeros(layout.num_pages, np.int32)
        self.window_locks = np.zeros(layout.num_pages, np.int32)

    @property
    def num_free(self) -> int:
        """Pages `allocate` can give now: the smaller of the two spaces' free counts."""
        return min(super().num_free, self.window.num_free)

    @property
    def num_free_full(self) -> int:
        """Free pages of the full page space."""
        return super().num_free

    @property
    def num_usable(self) -> int:
        """Pages both spaces could give with nothing allocated."""
        return min(super().num_usable, self.window.num_usable)

    def can_allocate(self, num_pages: int) -> bool:
        return super().can_allocate(num_pages) and self.window.can_allocate(num_pages)

    def allocate(self, num_pages: int) -> list[int]:
        if not self.window.can_allocate(num_pages):
            raise MemoryError(f"asked for {num_pages} pages, {self.window.num_free} window pages free")
        pages = super().allocate(num_pages)
        if pages:
            self.window_page_of[pages] = self.window.allocate(num_pages)
        return pages

    def free(self, pages) -> None:
        pages = np.asarray(pages, np.int64).reshape(-1)
        if len(pages) and self.window_locks[pages].any():
            raise ValueError(f"freeing pages a running request's window still reads: {pages[self.window_locks[pages] > 0][:10]}")
        super().free(pages)
        self._free_window_parts(pages)

    def drop_window(self, pages) -> None:
        """Free the window parts of `pages` (those that have one); their full parts stay."""
        pages = np.asarray(pages, np.int64).reshape(-1)
        if len(pages) and self.window_locks[pages].any():
            raise ValueError(f"dropping window pages a running request still reads: {pages[self.window_locks[pages] > 0][:10]}")
        self._free_window_parts(pages)

    def has_window(self, pages) -> np.ndarray:
        """bool [n]: whether each page has its window part."""
        return self.window_page_of[np.asarray(pages, np.int64).reshape(-1)] != 0

    def move_window(self, src: int, dst: int) -> None:
        """Give page `dst` (which has no window part) the window part of `src` (same tokens, kept by the
        tree under `dst`); `src` keeps none."""
        assert self.window_page_of[dst] == 0, dst
        self.window_page_of[dst], self.window_page_of[src] = self.window_page_of[src], 0

    def window_page_table(self, page_table: np.ndarray) -> np.ndarray:
        """The window page ids of a page table (0 where a page has none)."""
        return self.window_page_of[page_table]

    def check_integrity(self) -> None:
        """Assert: window pages in use are held by exactly one allocated page each, and with the free
        ones they make up the whole window space."""
        held = self.window_page_of[self.window_page_of != 0]
        assert len(np.unique(held)) == len(held), "a window page is held by two pages"
        free_full = np.asarray(self.free_pages(), np.int64)
        assert not self.window_page_of[free_full].any(), "a free page still holds a window page"
        free_window = set(self.window.free_pages())
        assert not free_window & set(held.tolist()), "a window page is both free and held"
        assert len(free_window) + len(held) == self.window.num_usable, (
            f"{self.window.num_usable - len(free_window) - len(held)} window pages leaked")
        assert (self.window_locks >= 0).all()

    def _free_window_parts(self, pages: np.ndarray) -> None:
        held = self.window_page_of[pages]
        if held.any():
            self.window.free(held[held != 0])
            self.window_page_of[pages] = 0
