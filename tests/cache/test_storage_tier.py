"""The storage tier under the release policy (numpy pools, no model): backup by each write policy, prefetch
by each prefetch policy, recall into the tree across a "restart", and no leaked page.

KV contents are synthetic (`kv_value` of test_release_policy: the K of token t at position p), so a page
recalled from storage is checked against the bytes computed for the tokens the tree says it holds.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np
import pytest

from jaxserve.cache.kv_pool import PageAllocator, PoolShape
from jaxserve.cache.page_io import NumpyKVPages
from jaxserve.cache.radix_tree import RadixCache
from jaxserve.cache.release_policy import ReleasePolicy, ReleasePolicyConfig
from jaxserve.cache.storage import FileStorage, StorageConfig, StorageExtraConfig
from jaxserve.cache.storage_tier import StorageTier
from jaxserve.scheduler.cache_manager import CacheManager
from tests.cache.test_release_policy import NUM_LAYERS, FakeClock, assert_all_kv, write_kv

PAGE_SIZE = 2
HEAD_DIM = 4


@dataclasses.dataclass
class Server:
    """One "process": a tree, a device pool and a release policy over a storage directory."""

    clock: FakeClock
    tree: RadixCache
    allocator: PageAllocator
    io: NumpyKVPages
    policy: ReleasePolicy
    storage: StorageTier

    def compute(self, tokens, namespace=None):
        """A request computed `tokens` and its prefix went into the tree (as CacheManager does)."""
        n = len(tokens) // PAGE_SIZE * PAGE_SIZE
        assert self.policy.reserve(n // PAGE_SIZE)
        pages = self.allocator.allocate(n // PAGE_SIZE)
        write_kv(self.io, pages, tokens, 0, n, PAGE_SIZE)
        result = self.tree.insert(tokens[:n], pages, namespace)
        self.allocator.free(result.duplicate_pages)
        self.policy.on_insert(result, tokens[:n], namespace)
        return result.last_node

    def sync(self):
        """The next scheduler iteration, then wait for the writer thread."""
        self.policy.on_schedule(0)
        self.storage.storage.flush_writes()

    def admit(self, rid, tokens, namespace=None):
        """Match `tokens` as an admitted request: device, host, then the prefetched storage pages."""
        result = self.tree.match_prefix(tokens, namespace)
        self.tree.inc_lock_ref(result.last_node)
        return self.policy.extend_match(result, tokens, namespace, self.policy.take_prefetch(rid))

    def prefetch(self, rid, tokens, namespace=None):
        """The request waits in the queue until its prefetch is done."""
        self.policy.start_prefetch(rid, tokens, namespace)
        pf = self.storage.prefetch_of(rid)
        if pf is not None:
            assert pf.done.wait(10)
        return pf

    def check(self):
        CacheManager(self.allocator, self.tree, PAGE_SIZE, self.policy).check_integrity([])

    def close(self):
        self.policy.close()


def make_server(path, fingerprint="fp", num_pages=33, host=False, write_policy="write_through",
                prefetch_policy="wait_complete", threshold=0, max_size_bytes=0) -> Server:
    clock = FakeClock()
    tree = RadixCache(PAGE_SIZE, time_fn=clock)
    shape = PoolShape(NUM_LAYERS, num_pages, PAGE_SIZE, 1, HEAD_DIM, "float32")
    allocator = PageAllocator(num_pages)
    io = NumpyKVPages(shape)
    config = StorageConfig(str(path), max_size_bytes=max_size_bytes, prefetch_policy=prefetch_policy,
                           write_policy=write_policy, extra=StorageExtraConfig(prefetch_threshold=threshold))
    files = FileStorage(config, (NUM_LAYERS, 1, PAGE_SIZE, HEAD_DIM), np.float32)
    storage = StorageTier(files, fingerprint, PAGE_SIZE, time_fn=clock)
    policy_config = ReleasePolicyConfig(enable_host_tier=host, hicache_ratio=0.25, conservative_batch_size=0,
                                        aggressive_batch_size=0, evict_threshold=1.0, soft_free_threshold_s=1e9)
    policy = ReleasePolicy(policy_config, tree, allocator, shape, storage=storage)
    policy.attach_io(io)
    return Server(clock, tree, allocator, io, policy, storage)


def num_files(path) -> int:
    return sum(name.endswith(".kv") for name in os.listdir(path))


TOKENS = list(range(100, 120))  # 10 pages


def test_restart_recalls_the_same_kv_bytes(tmp_path):
    a = make_server(tmp_path)
    a.compute(TOKENS)
    a.sync()
    assert num_files(tmp_path) == 10
    a.close()
    b = make_server(tmp_path)  # a new process: empty tree, a zeroed pool
    b.prefetch("r", TOKENS + [7])
    match = b.admit("r", TOKENS + [7])
    assert (match.num_tokens, match.num_storage_tokens) == (20, 20)
    assert match.last_node.lock_ref == 1 and len(match.pages) == 10
    assert_all_kv(b)  # every page recalled holds the bytes computed for its tokens and positions
    b.tree.dec_lock_ref(match.last_node)
    b.check()
    b.policy.record_lookup(21, match)
    stats = b.policy.stats()
    assert stats.storage_hit_tokens == 20 and stats.storage_bytes_read == 10 * b.storage.storage.file_bytes
    b.close()


def test_storage_continues_a_device_match(tmp_path):
    a = make_server(tmp_path)
    a.compute(TOKENS)
    a.sync()
    b = make_server(tmp_path)
    b.compute(TOKENS[:6])  # the first 3 pages are on b's device already
    assert b.prefetch("r", TOKENS).first_page == 3
    # finding where the read starts is a probe, not a use of the cached prefix
    assert [node.hit_count for node in b.tree.iter_nodes()] == [0]
    match = b.admit("r", TOKENS)
    assert (match.num_tokens, match.num_storage_tokens) == (20, 14)
    assert_all_kv(b)
    b.tree.dec_lock_ref(match.last_node)
    b.check()
    a.close(), b.close()


def test_another_fingerprint_gets_no_hits(tmp_path):
    a = make_server(tmp_path, fingerprint="model-a")
    a.compute(TOKENS)
    a.sync()
    b = make_server(tmp_path, fingerprint="model-a, w8a8_int8")
    b.prefetch("r", TOKENS)
    match = b.admit("r", TOKENS)
    assert match.num_tokens == 0 and match.num_storage_tokens == 0
    b.tree.dec_lock_ref(match.last_node)
    b.check()
    a.close(), b.close()


def test_pool_short_recalls_what_fits_and_leaks_nothing(tmp_path):
    a = make_server(tmp_path)
    a.compute(TOKENS)
    a.sync()
    b = make_server(tmp_path, num_pages=5)  # 4 usable pages
    b.prefetch("r", TOKENS)
    match = b.admit("r", TOKENS)
    assert match.num_storage_tokens == 8
    assert_all_kv(b)
    b.tree.dec_lock_ref(match.last_node)
    b.check()
    a.close(), b.close()


def test_removed_and_corrupted_files_are_misses(tmp_path):
    a = make_server(tmp_path)
    a.compute(TOKENS)
    a.sync()
    keys = a.storage.keys(TOKENS)
    os.remove(a.storage.storage.path(keys[6]))  # removed while serving
    with open(a.storage.storage.path(keys[3]), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    b = make_server(tmp_path)
    b.prefetch("r", TOKENS)
    match = b.admit("r", TOKENS)
    assert match.num_storage_tokens == 6  # pages 0-2; page 3 is corrupted: the chain stops there
    assert_all_kv(b)
    b.tree.dec_lock_ref(match.last_node)
    b.check()
    stats = b.policy.stats()
    assert stats.storage_bad_files == 1
    # the hit query found pages 0-5 (page 6 is gone); the read stopped at the corrupted page 3
    assert (stats.storage_prefetch_hit_tokens, stats.storage_prefetched_tokens) == (12, 6)
    assert stats.storage_prefetch_ops == (stats.storage_prefetch_ops[0],) and stats.storage_num_prefetch_ops == 1
    assert stats.storage_prefetch_ops[0][:2] == (3, 3 * b.storage.storage.file_bytes)
    a.close(), b.close()


def test_a_failed_write_is_tried_again_by_the_next_backup(tmp_path):
    a = make_server(tmp_path)
    files = a.storage.storage
    write, calls = files.write, []

    def full_disk_once(key, k, v):
        calls.append(key)
        if len(calls) == 4:
            raise OSError(28, "No space left on device")
        return write(key, k, v)

    files.write = full_disk_once
    a.compute(TOKENS)
    a.sync()
    stats = a.policy.stats()
    assert num_files(tmp_path) == 3 and stats.storage_pages_failed == 7  # the batch stops at the failure
    assert (stats.storage_num_backup_ops, stats.storage_backup_ops[0][0]) == (1, 3)
    a.compute(TOKENS)  # the prefix is inserted again (a request reused it): its backup writes the rest
    a.sync()
    assert num_files(tmp_path) == 10
    stats = a.policy.stats()
    assert stats.storage_backuped_tokens == 20 and stats.storage_num_backup_ops == 2
    assert stats.storage_backup_ops[1][:2] == (7, 7 * files.file_bytes)
    a.check()
    a.close()


def test_write_through_selective_writes_a_prefix_when_it_is_matched_again(tmp_path):
    a = make_server(tmp_path, write_policy="write_through_selective")
    a.compute(TOKENS)
    a.sync()
    assert num_files(tmp_path) == 0
    match = a.admit("r", TOKENS[:8] + [1])
    a.sync()
    assert num_files(tmp_path) == 4
    a.tree.dec_lock_ref(match.last_node)
    a.check()
    a.close()


def test_write_back_writes_what_leaves_the_device(tmp_path):
    a = make_server(tmp_path, write_policy="write_back")
    a.compute(TOKENS)
    a.sync()
    assert num_files(tmp_path) == 0
    a.allocator.free(a.policy.evict(20))
    a.sync()
    assert num_files(tmp_path) == 10 and a.tree.total_size() == 0
    a.check()
    b = make_server(tmp_path)
    b.prefetch("r", TOKENS)
    match = b.admit("r", TOKENS)
    assert match.num_storage_tokens == 20
    assert_all_kv(b)
    b.tree.dec_lock_ref(match.last_node)
    a.close(), b.close()


def test_write_back_with_a_host_tier_writes_what_the_host_tier_drops(tmp_path):
    a = make_server(tmp_path, write_policy="write_back", host=True, num_pages=17)  # host tier: 4 pages
    a.compute(TOKENS[:8])
    a.allocator.free(a.policy.evict(8))  # 4 pages to the host tier
    a.sync()
    assert a.tree.host_size() == 8 and num_files(tmp_path) == 0
    a.compute(TOKENS[10:])  # another 5 pages; then evicting them needs the host tier's room
    a.allocator.free(a.policy.evict(10))
    a.sync()
    assert num_files(tmp_path) >= 4  # the host tier's LRU pages (the first prompt's) went to storage
    a.check()
    b = make_server(tmp_path)
    b.prefetch("r", TOKENS[:8])
    match = b.admit("r", TOKENS[:8])
    assert match.num_storage_tokens == 8
    assert_all_kv(b)
    b.tree.dec_lock_ref(match.last_node)
    a.close(), b.close()


def _stalled(server: Server):
    """Make the server's storage reads wait for the returned event."""
    gate = threading.Event()
    read = server.storage.storage.read

    def stalled_read(key):
        gate.wait()
        return read(key)

    server.storage.storage.read = stalled_read
    return gate


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies_decide_when_a_request_is_admitted(tmp_path, policy):
    a = make_server(tmp_path)
    a.compute(TOKENS)
    a.sync()
    b = make_server(tmp_path, prefetch_policy=policy)
    gate = _stalled(b)
    b.policy.start_prefetch("r", TOKENS)
    assert b.policy.is_prefetch_ready("r") == (policy == "best_effort")
    b.clock.now = 1.0 + 0.25 * 20 / 1024 - 1e-6  # SGLang's default timeout: 1 s + 0.25 s per 1024 tokens
    assert b.policy.is_prefetch_ready("r") == (policy == "best_effort")
    b.clock.now = 1.0 + 0.25 * 20 / 1024
    assert b.policy.is_prefetch_ready("r") == (policy != "wait_complete")
    gate.set()
    assert b.storage.prefetch_of("r").done.wait(10)
    assert b.policy.is_prefetch_ready("r")
    assert b.policy.stats().storage_prefetch_waits == (0 if policy == "best_effort" else 1)
    match = b.admit("r", TOKENS)
    assert match.num_storage_tokens == 20
    b.tree.dec_lock_ref(match.last_node)
    b.check()
    a.close(), b.close()


def test_below_the_threshold_nothing_is_fetched(tmp_path):
    a = make_server(tmp_path)
    a.compute(TOKENS)
    a.sync()
    b = make_server(tmp_path, threshold=22)  # 11 pages: more than the 10 the prompt has
    b.policy.start_prefetch("r", TOKENS)
    assert b.policy.is_prefetch_ready("r") and b.policy.take_prefetch("r") is None
    a.close(), b.close()


def test_two_servers_share_one_directory(tmp_path):
    a, b = make_server(tmp_path), make_server(tmp_path)
    a.compute(TOKENS[:10])
    a.sync()
    b.prefetch("r", TOKENS[:10])
    match = b.admit("r", TOKENS[:10])
    assert match.num_storage_tokens == 10
    b.tree.dec_lock_ref(match.last_node)
    b.compute(TOKENS)  # b computes the rest; a reads b's pages
    b.sync()
    a.prefetch("s", TOKENS)
    match = a.admit("s", TOKENS)
    assert (match.num_tokens, match.num_storage_tokens) == (20, 10)
    assert_all_kv(a)
    a.tree.dec_lock_ref(match.last_node)
    a.check(), b.check()
    a.close(), b.close()
