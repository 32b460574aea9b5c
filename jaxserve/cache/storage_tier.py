"""The storage tier as the release policy uses it: prefetch while a request waits, backup by the write
policy, and the bookkeeping of both.

The file backend (jaxserve/cache/storage.py) stores pages by key and knows nothing of the tree or the
device. This unit maps requests and tree paths to page keys and moves KV between the device pool (through
`KVPageIO`) and the backend:

- Prefetch (SGLang's L3 -> host prefetch, `--hicache-storage-prefetch-policy`). When a request enters the
  waiting queue, the pages of its prompt past what the device and host tiers hold are read on the
  backend's reader thread. The scheduler admits the request when `is_ready` says so: `best_effort` at
  once (with whatever was read by then), `wait_complete` when the read stopped, `timeout` when it stopped
  or after `prefetch_timeout_base + prefetch_timeout_per_ki_token x tokens / 1024` seconds (SGLang's
  formula and defaults). Fewer than `prefetch_threshold` tokens in storage are not fetched.
- Backup (`--hicache-write-policy`). The release policy calls `backup` with a tree path's tokens and
  device pages: after every insert (`write_through`), when a cached prefix is matched again
  (`write_through_selective`), or when a node is dropped from the last tier that held it
  (`write_back`). The device -> host copy is started at once and handed, still in flight, to the
  backend's writer thread, which waits for it: the engine thread never waits on the copy or the disk.
"""

from __future__ import annotations

import logging
import time
from typing import Hashable, Sequence

import numpy as np
from jaxtyping import Int32

from jaxserve.cache.kv_pool import PoolShape
from jaxserve.cache.page_io import DoneRead, KVPageIO, PendingRead
from jaxserve.cache.storage import FileStorage, Prefetch, StorageConfig, page_keys

MAX_REMEMBERED_KEYS = 1 << 20  # keys this process backed up (about 100 MB of set): forgotten beyond


logger = logging.getLogger(__name__)

class StorageTier:
    """Prefetch and backup of KV pages through a `FileStorage` (see the module docstring).

    Args:
        storage: the backend.
        fingerprint: `storage_fingerprint(...)` of this model and pool (salts every key).
        page_size: tokens per page.
        time_fn: clock in seconds for the prefetch timeout and wait times (inject a fake clock in tests).

    `io` must be set before anything is backed up. Not thread-safe: the engine loop owns it.
    """

    def __init__(self, storage: FileStorage, fingerprint: str, page_size: int, time_fn=time.monotonic):
        self.storage = storage
        self.time_fn = time_fn
        self.config: StorageConfig = storage.config
        self.fingerprint = fingerprint
        self.page_size = page_size
        self.io: KVPageIO | None = None
        self._prefetches: dict[str, tuple[Prefetch, float]] = {}  # rid -> (prefetch, its deadline)
        self._waiting: dict[str, float] = {}  # rid -> when it was first held back by its prefetch
        self._backed_up: set[bytes] = set()
        self.num_prefetch_waits = 0  # requests held in the queue by their prefetch
        self.prefetch_wait_s = 0.0  # their total time held, in seconds
        self.num_backup_pages = 0  # pages handed to the writer

    @staticmethod
    def open(config: StorageConfig, pool_shape: PoolShape, fingerprint: str) -> "StorageTier":
        """The tier over a `FileStorage` of `config` for pages of `pool_shape` (every layer's K/V of one
        page per file), its keys salted with `fingerprint`.

        Raises:
            StorageError (a ValueError): the directory cannot be written.
        """
        shape = pool_shape
        page_shape = (shape.num_layers, shape.num_kv_heads, shape.page_size, shape.host_head_dim)
        storage = FileStorage(config, page_shape, shape.host_dtype)  # a compressed pool's pages as bytes
        logger.info("storage tier: %s (bound %s bytes), prefetch %s, writes %s", config.storage_dir,
                    config.max_size_bytes or "no", config.prefetch_policy, config.write_policy)
        return StorageTier(storage, fingerprint, shape.page_size)

    @property
    def write_policy(self) -> str:
        return self.config.write_policy

    def keys(self, tokens: Sequence[int], namespace: Hashable = None) -> list[bytes]:
        """The storage keys of the whole pages of `tokens`."""
        return page_keys(tokens, self.page_size, self.fingerprint, namespace)

    # ---- prefetch ----------------------------------------------------------------------------------

    def start_prefetch(self, rid: str, tokens: Sequence[int], namespace: Hashable, num_cached_tokens: int) -> None:
        """Read the pages of `tokens` (a request's match key) from page `num_cached_tokens // page_size` on."""
        self.cancel_prefetch(rid)
        keys = self.keys(tokens, namespace)
        first = num_cached_tokens // self.page_size
        num_pages = len(keys) - first
        min_pages = max(1, -(-self.config.extra.prefetch_threshold // self.page_size))
        if num_pages < min_pages:
            return
        extra = self.config.extra
        timeout = extra.prefetch_timeout_base + extra.prefetch_timeout_per_ki_token * num_pages * self.page_size / 1024
        self._prefetches[rid] = (self.storage.prefetch(first, keys[first:], min_pages), self.time_fn() + timeout)

    def is_ready(self, rid: str) -> bool:
        """Whether the request may be admitted now, by the prefetch policy (True without a prefetch)."""
        entry = self._prefetches.get(rid)
        if entry is None:
            return True
        pf, deadline = entry
        policy = self.config.prefetch_policy
        now = self.time_fn()
        ready = policy == "best_effort" or pf.done.is_set() or (policy == "timeout" and now >= deadline)
        if not ready and rid not in self._waiting:
            self._waiting[rid] = now
            self.num_prefetch_waits += 1
        return ready

    def take_prefetch(self, rid: str) -> Prefetch | None:
        """The request's prefetch, removed from the table (its reads stop); None without one."""
        entry = self._prefetches.pop(rid, None)
        since = self._waiting.pop(rid, None)
        if since is not None:
            self.prefetch_wait_s += self.time_fn() - since
        if entry is None:
            return None
        entry[0].cancel()
        return entry[0]

    def cancel_prefetch(self, rid: str) -> None:
        """Forget a request's prefetch (it left the queue without a match)."""
        self.take_prefetch(rid)

    def wait_any(self, timeout_s: float) -> None:
        """Block up to `timeout_s` seconds until a prefetch that holds its request back stops reading."""
        for rid in self._waiting:
            pf = self._prefetches[rid][0]
            if not pf.done.is_set():
                pf.done.wait(timeout_s)
                return

    def prefetch_of(self, rid: str) -> Prefetch | None:
        """The request's prefetch in flight or done (None without one), left in place."""
        entry = self._prefetches.get(rid)
        return entry[0] if entry is not None else None

    @property
    def num_prefetching(self) -> int:
        return len(self._prefetches)

    # ---- backup ------------------------------------------------------------------------------------

    def backup(
        self, tokens: Sequence[int], namespace: Hashable, pages: Int32[np.ndarray, " P"], first_page: int = 0
    ) -> None:
        """Start writing pages of `tokens` that this process has not written yet: device page `pages[i]`
        holds page `first_page + i`. The device -> host copy starts now; the writer thread finishes it."""
        keys = self.keys(tokens, namespace)[first_page : first_page + len(pages)]
        new = self._new(keys)
        if not new:
            return
        if len(self._backed_up) + len(new) > MAX_REMEMBERED_KEYS:
            self._backed_up.clear()
        new_keys = [keys[i] for i in new]
        self._backed_up.update(new_keys)
        self._submit(new_keys, self.io.read_pages(np.asarray(pages, np.int32)[new]))

    def backup_host(self, tokens: Sequence[int], namespace: Hashable, first_page: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write pages already on the host: `k[:, i]` / `v[:, i]` hold page `first_page + i` of `tokens`."""
        keys = self.keys(tokens, namespace)[first_page : first_page + k.shape[1]]
        new = self._new(keys)
        if new:
            self._backed_up.update(keys[i] for i in new)
            self._submit([keys[i] for i in new], DoneRead(k[:, new], v[:, new]))

    def _new(self, keys: list[bytes]) -> list[int]:
        """Indices of `keys` this process has not written (nor queued); keys whose writes failed count as
        not written, so a failed write is tried again by the next backup of its page."""
        failed = self.storage.take_failed_keys()
        if failed:
            self._backed_up.difference_update(failed)
        return [i for i, key in enumerate(keys) if key not in self._backed_up]

    def _submit(self, keys: list[bytes], read: PendingRead) -> None:
        if self.storage.submit_read(keys, read):
            self.num_backup_pages += len(keys)
        else:
            self._backed_up.difference_update(keys)  # dropped: a later backup may try again

    def reset(self) -> None:
        """Forget which pages this process wrote (after a flush; the files stay)."""
        self._backed_up.clear()

    def close(self) -> None:
        """Finish the queued writes and stop the backend's threads."""
        self.storage.close()
