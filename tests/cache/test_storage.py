"""The storage tier's file backend (no model): keys, atomic files, verification, the size bound, faults.

Page contents are synthetic and derived from the key (`page_of`), so a page read back can be checked
against the bytes that were meant for that key, independently of the backend.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from jaxserve.cache.storage import (
    ENV_EVICTION_RATIO,
    ENV_MAX_SIZE,
    ENV_STORAGE_DIR,
    FileStorage,
    StorageConfig,
    StorageError,
    page_keys,
    parse_extra_config,
    parse_size,
    storage_fingerprint,
)

PAGE_SHAPE = (2, 1, 4, 8)  # layers, kv heads, page size, head dim


def page_of(key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """K and V for `key`: numpy's generator seeded from the key's bytes (not from the backend)."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
    k = rng.standard_normal(PAGE_SHAPE).astype(np.float32)
    return k, -k


def make_storage(path, max_size_bytes=0, **kw) -> FileStorage:
    return FileStorage(StorageConfig(str(path), max_size_bytes=max_size_bytes, **kw), PAGE_SHAPE, np.float32)


def test_page_keys_are_a_chain_over_whole_pages():
    tokens = list(range(10))
    keys = page_keys(tokens, 4, "fp")
    assert len(keys) == 2  # the partial third page has no key
    # key i names the prefix up to page i: independent of later tokens, changed by any earlier one
    assert page_keys(tokens[:8] + [99, 98], 4, "fp") == keys
    changed = page_keys([7] + tokens[1:], 4, "fp")
    assert changed[0] != keys[0] and changed[1] != keys[1]
    assert page_keys(tokens, 4, "fp")[1] != page_keys(tokens[4:8] + tokens[:4], 4, "fp")[1]
    # brute force: key 1 is sha256(sha256(seed + page 0) + page 1)
    seed = hashlib.sha256(b"fp|None").digest()
    h0 = hashlib.sha256(seed + np.arange(4, dtype=np.int64).tobytes()).digest()
    assert keys == [h0, hashlib.sha256(h0 + np.arange(4, 8, dtype=np.int64).tobytes()).digest()]
    # another fingerprint or namespace (LoRA adapter, cache salt) never shares a key
    assert not set(keys) & set(page_keys(tokens, 4, "other"))
    assert not set(keys) & set(page_keys(tokens, 4, "fp", namespace="lora-1"))


def test_fingerprint_changes_with_any_field():
    base = dict(weights="abc", dtype="float32", quantization=None, page_size=16, tp_size=1)
    fp = storage_fingerprint(**base)
    assert storage_fingerprint(**dict(reversed(list(base.items())))) == fp
    for field, other in (("weights", "abd"), ("dtype", "bfloat16"), ("quantization", "w8a8_int8"),
                         ("page_size", 32), ("tp_size", 2)):
        assert storage_fingerprint(**{**base, field: other}) != fp, field


def test_write_read_round_trip_and_atomic_names(tmp_path):
    s = make_storage(tmp_path)
    keys = page_keys(range(16), 4, "fp")
    for key in keys:
        assert s.read(key) is None
        assert s.write(key, *page_of(key)) == s.file_bytes
        assert s.write(key, *page_of(key)) == 0  # idempotent
    for key in keys:
        k, v = s.read(key)
        np.testing.assert_array_equal(k, page_of(key)[0])
        np.testing.assert_array_equal(v, page_of(key)[1])
    names = sorted(os.listdir(tmp_path))
    assert names == sorted(key.hex() + ".kv" for key in keys)  # no temporary file left
    s.close()


def _bad_file_cases(s, key, other_key):
    path = s.path(key)
    good = open(path, "rb").read()
    yield "truncated", good[: len(good) // 2]
    yield "header only (half-written)", good[:60]
    yield "empty", b""
    flipped = bytearray(good)
    flipped[-5] ^= 0x01
    yield "one bit flipped in the payload", bytes(flipped)
    flipped = bytearray(good)
    flipped[0] ^= 0xFF
    yield "bad magic", bytes(flipped)
    yield "too long", good + b"\0"
    s.write(other_key, *page_of(other_key))
    yield "another key's file (foreign)", open(s.path(other_key), "rb").read()


def test_bad_files_are_misses_logged_once_and_removed(tmp_path, caplog):
    s = make_storage(tmp_path)
    key, other = page_keys(range(8), 4, "fp")
    s.write(key, *page_of(key))
    for name, data in list(_bad_file_cases(s, key, other)):
        with open(s.path(key), "wb") as f:
            f.write(data)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jaxserve.cache.storage"):
            assert s.read(key) is None, name
        assert not os.path.exists(s.path(key)), f"{name}: a bad file must be removed"
    assert s.counters.bad_files == 7
    # logged once per file: the same bad file again logs nothing more
    with open(s.path(key), "wb") as f:
        f.write(b"junk")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve.cache.storage"):
        assert s.read(key) is None
    assert not caplog.records
    s.close()


def test_another_page_layout_reads_nothing(tmp_path):
    s = make_storage(tmp_path)
    (key,) = page_keys(range(4), 4, "fp")
    s.write(key, *page_of(key))
    other = FileStorage(StorageConfig(str(tmp_path)), (2, 1, 4, 4), np.float32)  # another head_dim
    assert other.read(key) is None
    half = FileStorage(StorageConfig(str(tmp_path)), PAGE_SHAPE, np.float16)
    assert half.read(key) is None
    s.close(), other.close(), half.close()


def test_bfloat16_pages_round_trip_and_are_not_read_as_float16(tmp_path):
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    s = FileStorage(StorageConfig(str(tmp_path)), PAGE_SHAPE, bf16)
    (key,) = page_keys(range(4), 4, "fp")
    k, v = (x.astype(bf16) for x in page_of(key))
    s.write(key, k, v)
    got_k, got_v = s.read(key)
    assert got_k.dtype == bf16
    np.testing.assert_array_equal(got_k.astype(np.float32), k.astype(np.float32))
    np.testing.assert_array_equal(got_v.astype(np.float32), v.astype(np.float32))
    half = FileStorage(StorageConfig(str(tmp_path)), PAGE_SHAPE, np.float16)  # same bytes per value
    assert half.read(key) is None
    s.close(), half.close()


def test_size_bound_evicts_least_recently_used_files(tmp_path):
    probe = make_storage(tmp_path / "probe")
    file_bytes = probe.file_bytes
    probe.close()
    s = make_storage(tmp_path / "d", max_size_bytes=10 * file_bytes, eviction_ratio=0.5)
    keys = page_keys(range(4 * 30), 4, "fp")
    for i, key in enumerate(keys[:10]):
        s.write(key, *page_of(key))
        os.utime(s.path(key), (1000 + i, 1000 + i))
    assert s.read(keys[0]) is not None  # read: now the most recently used
    assert s.enforce_bound() == 0  # at the bound, not over it
    s.submit_write(keys[10:11], *(x[:, None] for x in page_of(keys[10])))
    s.flush_writes()
    assert s.disk_bytes() <= 5 * file_bytes
    assert os.path.exists(s.path(keys[0])) and os.path.exists(s.path(keys[10]))
    assert not os.path.exists(s.path(keys[1]))  # the oldest not read since
    assert s.counters.files_evicted == 6
    for key in keys[11:]:
        s.submit_write([key], *(x[:, None] for x in page_of(key)))
    s.flush_writes()
    assert s.disk_bytes() <= 10 * file_bytes
    s.close()


def test_bound_holds_at_start_up(tmp_path):
    s = make_storage(tmp_path)
    for key in page_keys(range(40), 4, "fp"):
        s.write(key, *page_of(key))
    s.close()
    s = make_storage(tmp_path, max_size_bytes=4 * s.file_bytes)
    assert s.disk_bytes() <= 4 * s.file_bytes
    s.close()


def test_prefetch_reads_up_to_the_first_miss_and_honours_the_threshold(tmp_path):
    s = make_storage(tmp_path)
    keys = page_keys(range(24), 4, "fp")
    for key in keys[:3] + keys[4:]:
        s.write(key, *page_of(key))
    pf = s.prefetch(0, keys)
    assert pf.done.wait(10)
    assert pf.num_pages_ready == 3
    for i in range(3):
        np.testing.assert_array_equal(pf.pages[i][0], page_of(keys[i])[0])
        np.testing.assert_array_equal(pf.pages[i][1], page_of(keys[i])[1])
    short = s.prefetch(0, keys, min_pages=4)  # only 3 pages in a row exist
    assert short.done.wait(10) and short.num_pages_ready == 0
    counters, prefetch_ops, backup_ops = s.snapshot()
    assert counters.pages_read == 3 and counters.bytes_read == 3 * s.file_bytes
    assert counters.prefetch_hit_pages == 3 + 3  # both queries found 3 pages in a row; one read them
    assert counters.num_prefetch_ops == 1 and backup_ops == ()
    [op] = prefetch_ops
    assert op.num_pages == 3 and op.num_bytes == 3 * s.file_bytes and op.seconds > 0
    assert op.gib_per_s == pytest.approx(3 * s.file_bytes / 2**30 / op.seconds)
    s.close()


def test_unwritable_directory_is_an_error_at_start_up(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(StorageError, match=ENV_STORAGE_DIR):
        make_storage(blocker / "hicache")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        with pytest.raises(StorageError, match="not writable"):
            make_storage(ro)


def test_full_queue_drops_writes_without_blocking(tmp_path, monkeypatch):
    import jaxserve.cache.storage as storage_mod

    monkeypatch.setattr(storage_mod, "WRITE_QUEUE_BATCHES", 1)
    s = make_storage(tmp_path)
    gate, started = threading.Event(), threading.Event()
    write = s.write

    def stalled_write(key, k, v):  # a slow disk: the writer thread waits here
        started.set()
        gate.wait()
        return write(key, k, v)

    s.write = stalled_write
    keys = page_keys(range(4 * 5), 4, "fp")
    pages = [tuple(x[:, None] for x in page_of(key)) for key in keys]
    assert s.submit_write(keys[:1], *pages[0])
    assert started.wait(10)  # the writer holds batch 0; the queue (1 batch) is empty
    t0 = time.monotonic()
    results = [s.submit_write([key], *page) for key, page in zip(keys[1:], pages[1:])]
    assert time.monotonic() - t0 < 5  # never waits for the disk (a hang guard, not a timing claim)
    assert results == [True, False, False, False]
    gate.set()
    s.flush_writes()
    assert s.counters.pages_dropped == 3 and s.counters.pages_written == 2
    assert sorted(os.listdir(tmp_path)) == sorted(k.hex() + ".kv" for k in keys[:2])
    s.close()


_WRITER = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    from test_storage import make_storage, page_of
    from jaxserve.cache.storage import page_keys
    s = make_storage({dir!r})
    keys = page_keys(range(4 * 100000), 4, "fp")
    print("ready", flush=True)
    for key in keys:
        s.write(key, *page_of(key))
""")


def test_kill_during_writes_then_restart_serves_no_torn_page(tmp_path):
    d = tmp_path / "d"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = _WRITER.format(root=root, tests=os.path.dirname(os.path.abspath(__file__)), dir=str(d))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 30
    while len(os.listdir(d)) < 50 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # a writer killed between its write and its rename would leave a temporary file: make one, as it would
    (key,) = page_keys(range(4), 4, "torn")
    (d / f".{key.hex()}.{os.uname().nodename}.{proc.pid}.0a.tmp").write_bytes(b"partial")
    # and a file torn under its final name (a non-atomic writer) must not be served either
    (torn_key,) = page_keys(range(4), 4, "torn2")
    (d / f"{torn_key.hex()}.kv").write_bytes(b"JXSKV001" + b"\0" * 40)
    s = make_storage(d)
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")], "a dead writer's temporary files are removed"
    keys = page_keys(range(4 * 100000), 4, "fp")
    names = {n for n in os.listdir(d) if n.endswith(".kv")}
    num_ok = 0
    for key in keys:
        if key.hex() + ".kv" not in names:
            break
        k, v = s.read(key)
        np.testing.assert_array_equal(k, page_of(key)[0])
        np.testing.assert_array_equal(v, page_of(key)[1])
        num_ok += 1
    assert num_ok >= 50
    assert s.read(torn_key) is None
    s.close()


def test_extra_config_and_sizes():
    assert parse_extra_config(None).prefetch_threshold == 256
    cfg = parse_extra_config('{"prefetch_threshold": 16, "prefetch_timeout_base": 0.5, "max_size": "1Gi"}')
    assert cfg.prefetch_threshold == 16 and cfg.prefetch_timeout_base == 0.5 and cfg.max_size == "1Gi"
    for bad, word in (("[1]", "object"), ("{", "JSON"), ('{"nope": 1}', "nope"),
                      ('{"prefetch_threshold": "16"}', "prefetch_threshold"), ('{"max_size": "10XB"}', "max_size"),
                      ('{"eviction_ratio": 1.5}', "eviction_ratio")):
        with pytest.raises(StorageError, match=word):
            parse_extra_config(bad)
    assert parse_size("200G", "x") == 200 * 10**9 and parse_size("1Gi", "x") == 2**30
    assert parse_size("1.5k", "x") == 1500 and parse_size("4096", "x") == 4096 and parse_size("0", "x") == 0
    for bad in ("1.5Gi", "1GB", "-1", "1.5"):
        with pytest.raises(StorageError):
            parse_size(bad, "x")


def test_config_from_flags_and_sglang_environment(tmp_path):
    env = {ENV_STORAGE_DIR: str(tmp_path), ENV_MAX_SIZE: "2M", ENV_EVICTION_RATIO: "0.5"}
    cfg = StorageConfig.from_flags("file", None, "wait_complete", "write_back", env)
    assert (cfg.storage_dir, cfg.max_size_bytes, cfg.eviction_ratio) == (str(tmp_path), 2 * 10**6, 0.5)
    assert (cfg.prefetch_policy, cfg.write_policy) == ("wait_complete", "write_back")
    extra = '{"max_size": "1Mi", "eviction_ratio": 0.8}'
    cfg = StorageConfig.from_flags("file", extra, environ=env)
    assert (cfg.max_size_bytes, cfg.eviction_ratio) == (2**20, 0.8)  # the extra config wins, as SGLang
    assert StorageConfig.from_flags("file", extra, environ={}).storage_dir == "/tmp/hicache"
    with pytest.raises(StorageError, match=ENV_EVICTION_RATIO):
        StorageConfig.from_flags("file", None, environ={ENV_EVICTION_RATIO: "2"})
    assert StorageConfig.from_flags(None, extra, environ=env) is None


def test_storage_flags_are_validated_naming_the_flag():
    from jaxserve.engine.config import EngineConfig
    from jaxserve.launch.cli import check_start_up_args
    from jaxserve.server_args import ServerArgs

    ServerArgs(hicache_storage_backend="file", hicache_storage_backend_extra_config='{"prefetch_threshold": 0}').validate()
    for kwargs, flag in (
        (dict(hicache_storage_backend="mooncake"), "--hicache-storage-backend"),
        (dict(hicache_write_policy="write_around"), "--hicache-write-policy"),
        (dict(hicache_storage_prefetch_policy="never"), "--hicache-storage-prefetch-policy"),
    ):
        with pytest.raises(ValueError, match=flag):
            ServerArgs(**kwargs).validate()
    # the extra config's contents are the storage tier's: refused where the flags become the engine's configs,
    # and by serve.py before anything loads (`check_start_up_args`: exit 2 naming the flag)
    bad = ServerArgs(hicache_storage_backend="file", hicache_storage_backend_extra_config="{bad json")
    for check in (lambda: EngineConfig.of(bad.resolved("cpu")), lambda: check_start_up_args(bad)):
        with pytest.raises(ValueError, match="--hicache-storage-backend-extra-config"):
            check()
