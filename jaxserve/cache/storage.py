"""The storage KV tier's file backend: one file per KV page in a directory that outlives the process.

Below the host tier (DESIGN.md, "Radix cache and release policy"), after SGLang's HiCache L3 `file`
backend (python/sglang/srt/mem_cache/hicache_storage.py, `HiCacheFile`), with SGLang's names for the
settings: the directory is `SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR` (default /tmp/hicache), the size
bound `max_size` in `--hicache-storage-backend-extra-config` or `SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE`
(SGLang's size syntax: 200G, 1Gi, bytes; 0 or unset: no bound), evicting least recently used files down
to `eviction_ratio` (`SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO`, 0.9) of the bound.

Keys. A page's key is a hash chain over the page-aligned token prefix that ends with it (as SGLang's
page hashes): `h[i] = sha256(h[i-1] + tokens of page i)`, seeded with `sha256(fingerprint, namespace)`.
The fingerprint (`storage_fingerprint`) covers everything that changes the KV bytes (model and weights
file, dtype, quantization, page size, pool layout, tp size, rope settings, the LoRA namespace through
the seed), so another model or configuration computes other keys and never reads a page not its own.

Files. `<dir>/<key hex>.kv` holds a fixed header (magic, key, page shape, dtype, payload length,
CRC-32 of the payload) followed by the page's K then V bytes, each `[num_layers, num_kv_heads,
page_size, head_dim]`. A write goes to a temporary name in the same directory and is renamed into
place (atomic on POSIX), so a reader sees a whole file or none; a process killed mid-write leaves only
a temporary file, which a later start removes. A read checks the header, the key and the checksum: a
truncated, corrupted, foreign or unreadable file is a miss, logged once per file, and removed. CRC-32
detects accidental damage, not a crafted file: the directory must be trusted like the weights.

Several processes may share one directory (replicas behind sglang-router, the ranks of one model):
writes are atomic and idempotent (a page's bytes depend only on its key), reads verify, and each
process bounds the directory's size by rescanning it before it evicts.

Writes are asynchronous: `submit_write` / `submit_read` queue pages for one writer thread (a bounded queue;
when it is full the pages are dropped and counted, never waiting on the step's critical path); the writer
also waits for a device -> host copy still in flight, so the engine thread never does. Reads for a
request run on one reader thread (`prefetch`) while the request waits in the queue.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import queue
import re
import socket
import struct
import threading
import time
import zlib
from decimal import Decimal, InvalidOperation
from typing import Any, Hashable, Mapping, NamedTuple, Sequence

import numpy as np

logger = logging.getLogger(__name__)

ENV_STORAGE_DIR = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
ENV_MAX_SIZE = "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"
ENV_EVICTION_RATIO = "SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO"
DEFAULT_STORAGE_DIR = "/tmp/hicache"  # SGLang's HiCacheFile default
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")

_MAGIC = b"JXSKV001"
# magic, key (sha256), num_layers, num_kv_heads, page_size, head_dim, dtype name, payload bytes, crc32
_HEADER = struct.Struct("<8s32sIIII16sQI")
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_S = 3600.0  # a temporary file this old is a leftover even when its writer's pid is reused
_RESCAN_INTERVAL_S = 1.0
# .<key hex or "probe">.<host>.<pid>.<random hex>.tmp
_TMP_NAME = re.compile(r"\.(?P<key>[^.]+)\.(?P<host>.+)\.(?P<pid>\d+)\.(?P<rand>[0-9a-f]+)\.tmp")
WRITE_QUEUE_BATCHES = 256
WRITER_NICE = 19  # the writer thread's nice value (Linux), so page writes never take CPU from a step (D-41)
MAX_OP_RECORDS = 1024  # the latest prefetch / backup operations kept for the per-operation histograms


class StorageError(ValueError):
    """The storage tier cannot start (bad setting, directory not writable); the message names the setting."""


# ---- settings -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StorageExtraConfig:
    """`--hicache-storage-backend-extra-config` as SGLang reads it (its prefetch knobs and the file
    backend's eviction keys); SGLang's defaults."""

    prefetch_threshold: int = 256  # tokens: a storage hit shorter than this is not fetched
    prefetch_timeout_base: float = 1.0  # seconds (the timeout policy)
    prefetch_timeout_per_ki_token: float = 0.25  # seconds per 1024 tokens to fetch (the timeout policy)
    hicache_storage_pass_prefix_keys: bool = False  # accepted; the file backend needs no prefix keys
    max_size: str | None = None  # the directory bound; overrides SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE
    eviction_ratio: float | None = None  # overrides SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO


def parse_extra_config(text: str | None) -> StorageExtraConfig:
    """Parse `--hicache-storage-backend-extra-config`: a JSON object, or `@path` of a .json / .toml file.

    Raises:
        StorageError: not JSON / not an object / unreadable file / an unknown key / a value of the wrong
            type, naming the key.
    """
    flag = "--hicache-storage-backend-extra-config"
    if not text:
        return StorageExtraConfig()
    try:
        if text.startswith("@"):
            path = text[1:]
            ext = os.path.splitext(path)[1].lower()
            if ext == ".toml":
                import tomllib

                with open(path, "rb") as f:
                    raw = tomllib.load(f)
            elif ext == ".json":
                with open(path) as f:
                    raw = json.load(f)
            else:
                raise StorageError(f"{flag} {text}: a config file must be .json or .toml")
        else:
            raw = json.loads(text)
    except (OSError, ValueError) as e:
        if isinstance(e, StorageError):
            raise
        raise StorageError(f"{flag}: not a JSON object or readable config file: {e}") from e
    if not isinstance(raw, dict):
        raise StorageError(f"{flag}: must be a JSON object, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(StorageExtraConfig)}
    for key in raw:
        if key not in fields:
            raise StorageError(f"{flag}: unknown key {key!r} for the file backend; known: {', '.join(fields)}")
    checks = {
        "prefetch_threshold": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "prefetch_timeout_base": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
        "prefetch_timeout_per_ki_token": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
        "hicache_storage_pass_prefix_keys": lambda v: isinstance(v, bool),
        "max_size": lambda v: isinstance(v, (str, int)) and not isinstance(v, bool),
        "eviction_ratio": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1,
    }
    for key, value in raw.items():
        if not checks[key](value):
            raise StorageError(f"{flag}: bad value {value!r} for {key!r}")
    if "max_size" in raw:
        raw["max_size"] = str(raw["max_size"])
        parse_size(raw["max_size"], f"{flag} max_size")
    return StorageExtraConfig(**raw)


def parse_size(value: str | None, name: str) -> int:
    """Bytes of a size in SGLang's syntax: an integer, or a number with an SI (k, M, G, T: powers of
    1000) or IEC (Ki, Mi, Gi, Ti: powers of 1024, integers only) suffix, case-sensitive; None, "" or "0"
    means no bound (0).

    Raises:
        StorageError: naming `name` for anything else (SGLang disables the bound with a warning instead).
    """
    if value is None or not str(value).strip():
        return 0
    s = str(value).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", s)
    if m is None or (m.group(2) and m.group(2).endswith("i") and "." in m.group(1)) or ("." in m.group(1) and not m.group(2)):
        raise StorageError(f"{name}: {value!r} is not a size (bytes, or a number with k/M/G/T or Ki/Mi/Gi/Ti)")
    number, suffix = m.groups()
    scale = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    try:
        return int(Decimal(number) * scale[suffix])
    except InvalidOperation as e:  # pragma: no cover - the regex admits only decimals
        raise StorageError(f"{name}: {value!r} is not a size") from e


@dataclasses.dataclass(frozen=True)
class StorageConfig:
    """Resolved settings of the storage tier (flags, extra config and SGLang's environment variables).

    Attributes:
        storage_dir: the directory of page files.
        max_size_bytes: the directory's size bound in bytes (0: none).
        eviction_ratio: eviction brings the directory down to this share of the bound.
        prefetch_policy: best_effort | wait_complete | timeout (`--hicache-storage-prefetch-policy`).
        write_policy: write_through | write_through_selective | write_back (`--hicache-write-policy`).
        extra: the parsed extra config (prefetch threshold and timeouts).
    """

    storage_dir: str
    max_size_bytes: int = 0
    eviction_ratio: float = 0.9
    prefetch_policy: str = "timeout"
    write_policy: str = "write_through"
    extra: StorageExtraConfig = StorageExtraConfig()

    @staticmethod
    def from_flags(backend: str | None, extra_config: str | None, prefetch_policy: str = "timeout",
                   write_policy: str = "write_through", environ: Mapping[str, str] = os.environ) -> "StorageConfig | None":
        """From SGLang's flags (`--hicache-storage-backend`, `--hicache-storage-backend-extra-config`,
        `--hicache-storage-prefetch-policy`, `--hicache-write-policy`) and its environment variables; None
        without a backend. The extra config's `max_size` / `eviction_ratio` win over the environment, as SGLang.

        Raises:
            StorageError: a bad extra config, size or ratio (naming it), or an unsupported backend.
        """
        if backend is None:
            return None
        if backend != "file":
            raise StorageError(f"--hicache-storage-backend {backend!r}: jaxserve has the file backend only")
        extra = parse_extra_config(extra_config)
        max_size = extra.max_size if extra.max_size is not None else environ.get(ENV_MAX_SIZE)
        ratio = extra.eviction_ratio
        if ratio is None:
            raw = environ.get(ENV_EVICTION_RATIO, "0.9")
            try:
                ratio = float(raw)
            except ValueError:
                ratio = -1.0
            if not 0 < ratio <= 1:
                raise StorageError(f"{ENV_EVICTION_RATIO}={raw!r}: must be a number in (0, 1]")
        return StorageConfig(
            storage_dir=environ.get(ENV_STORAGE_DIR) or DEFAULT_STORAGE_DIR,
            max_size_bytes=parse_size(max_size, f"{ENV_MAX_SIZE} / max_size"),
            eviction_ratio=ratio,
            prefetch_policy=prefetch_policy,
            write_policy=write_policy,
            extra=extra,
        )


# ---- keys -----------------------------------------------------------------------------------------

def storage_fingerprint(**fields: Any) -> str:
    """A hex digest of everything that changes the KV bytes of a page (model and weights identity,
    dtype, quantization, page size, pool layout, tp size, rope settings): keyword fields, order-free."""
    text = json.dumps({k: repr(v) for k, v in fields.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def page_keys(tokens: Sequence[int], page_size: int, fingerprint: str, namespace: Hashable = None) -> list[bytes]:
    """Storage keys (32-byte sha256 digests) of the whole pages of `tokens`, one per page in order; key i
    names the prefix `tokens[: (i + 1) * page_size]` under `fingerprint` and `namespace`."""
    arr = np.asarray(tokens, dtype=np.int64)
    num_pages = len(arr) // page_size
    h = hashlib.sha256(f"{fingerprint}|{namespace!r}".encode()).digest()
    keys = []
    for i in range(num_pages):
        h = hashlib.sha256(h + arr[i * page_size : (i + 1) * page_size].tobytes()).digest()
        keys.append(h)
    return keys


# ---- the file backend -----------------------------------------------------------------------------

@dataclasses.dataclass
class StorageCounters:
    """Cumulative counts of one process's storage tier (pages, bytes, files, operations)."""

    prefetch_hit_pages: int = 0  # pages a prefetch found in storage (in a row from its first) before reading
    pages_read: int = 0  # verified pages read (prefetch hits)
    bytes_read: int = 0
    pages_written: int = 0
    bytes_written: int = 0
    pages_dropped: int = 0  # not written: the write queue was full
    pages_failed: int = 0  # not written: the copy or the file system failed (a later backup tries again)
    files_evicted: int = 0
    bad_files: int = 0  # truncated, corrupted, foreign or unreadable: misses
    num_prefetch_ops: int = 0  # prefetches that read at least one page
    num_backup_ops: int = 0  # write batches that wrote at least one page


class StorageOp(NamedTuple):
    """One prefetch (a request's pages read in a row) or one write batch (a backup's new pages), for
    SGLang's per-operation histograms: pages, bytes moved and the wall time of the file I/O alone."""

    num_pages: int
    num_bytes: int
    seconds: float

    @property
    def gib_per_s(self) -> float:
        """Bandwidth in GB/s as SGLang's storage backends compute it (bytes / 2**30 per second)."""
        return self.num_bytes / (1 << 30) / max(self.seconds, 1e-9)


class Prefetch:
    """Pages of one request read from storage by the reader thread (see `FileStorage.prefetch`).

    Attributes:
        first_page: index (in the request's pages) of `keys[0]`.
        keys: the keys asked for, in order.
        pages: the (k, v) of the pages read so far, each `[num_layers, num_kv_heads, page_size, head_dim]`, in
            order from `keys[0]`; they stop at the first miss. Appended as pairs, so a reader on another
            thread never sees a k without its v.
        done: set when the reader stopped (all read, a miss, below the threshold, or cancelled).
    """

    def __init__(self, first_page: int, keys: list[bytes]):
        self.first_page = first_page
        self.keys = keys
        self.pages: list[tuple[np.ndarray, np.ndarray]] = []
        self.done = threading.Event()
        self.is_cancelled = False

    @property
    def num_pages_ready(self) -> int:
        return len(self.pages)

    def cancel(self) -> None:
        self.is_cancelled = True


class FileStorage:
    """One directory of page files (see the module docstring).

    Args:
        config: the resolved settings.
        page_shape: `(num_layers, num_kv_heads, page_size, head_dim)` of one page's K (and of its V).
        dtype: the pool's numpy dtype.

    Raises:
        StorageError: the directory cannot be created or written (start-up fails: no fall-back, D-41).
    """

    def __init__(self, config: StorageConfig, page_shape: tuple[int, int, int, int], dtype: np.dtype):
        self.config = config
        self.dir = config.storage_dir
        self.page_shape = tuple(int(x) for x in page_shape)
        self.dtype = np.dtype(dtype)
        self.page_bytes = int(np.prod(self.page_shape)) * self.dtype.itemsize  # K or V
        self.file_bytes = _HEADER.size + 2 * self.page_bytes
        self.counters = StorageCounters()
        self._lock = threading.Lock()
        self._prefetch_ops: collections.deque[StorageOp] = collections.deque(maxlen=MAX_OP_RECORDS)
        self._backup_ops: collections.deque[StorageOp] = collections.deque(maxlen=MAX_OP_RECORDS)
        self._failed_keys: list[bytes] = []
        self._logged_bad: set[str] = set()
        self._host_tag = f"{socket.gethostname()}.{os.getpid()}"
        self._check_writable()
        self._remove_stale_tmp()
        self._approx_bytes = self._scan()[1]
        self._last_scan = time.monotonic()
        self._write_queue: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE_BATCHES)
        self._read_queue: queue.Queue = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="hicache-storage-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="hicache-storage-reader", daemon=True)
        self._writer.start()
        self._reader.start()
        if config.max_size_bytes and self._approx_bytes > config.max_size_bytes:
            self.enforce_bound()

    # -- start-up checks

    def _check_writable(self) -> None:
        where = f"{ENV_STORAGE_DIR}={self.dir}"
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            raise StorageError(f"the storage tier's directory cannot be created ({where}): {e.strerror}") from e
        probe = os.path.join(self.dir, f".probe.{self._host_tag}.0{_TMP_SUFFIX}")
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * min(self.file_bytes, 1 << 20))  # one page (up to 1 MiB): a full disk fails here
            os.remove(probe)
        except OSError as e:
            try:
                os.remove(probe)
            except OSError:
                pass
            raise StorageError(f"the storage tier's directory is not writable ({where}): {e.strerror}") from e

    def _remove_stale_tmp(self) -> None:
        """Remove temporary files of writers that are gone (killed mid-write): same host and a dead pid, or
        older than an hour."""
        host = socket.gethostname()
        now = time.time()
        for entry in _scandir(self.dir):
            if not entry.name.endswith(_TMP_SUFFIX):
                continue
            m = _TMP_NAME.fullmatch(entry.name)
            try:
                age = now - entry.stat().st_mtime
                is_dead = m is not None and m["host"] == host and not _pid_alive(int(m["pid"]))
                if is_dead or age > _STALE_TMP_S:
                    os.remove(entry.path)
            except OSError:
                pass

    # -- synchronous I/O (the threads call these; tests may too)

    def path(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex() + _SUFFIX)

    def exists(self, key: bytes) -> bool:
        return os.path.exists(self.path(key))

    def write(self, key: bytes, k: np.ndarray, v: np.ndarray) -> int:
        """Write one page atomically unless its file exists. Returns the bytes written (0 if it existed).

        Raises:
            OSError: from the file system (the writer thread logs it and goes on).
        """
        final = self.path(key)
        if os.path.exists(final):
            return 0
        k = np.ascontiguousarray(k, dtype=self.dtype).reshape(self.page_shape)
        v = np.ascontiguousarray(v, dtype=self.dtype).reshape(self.page_shape)
        # as bytes: a buffer of an ml_dtypes dtype (bfloat16) cannot be cast by memoryview itself
        payload_k, payload_v = memoryview(k.reshape(-1).view(np.uint8)), memoryview(v.reshape(-1).view(np.uint8))
        crc = zlib.crc32(payload_v, zlib.crc32(payload_k))
        header = _HEADER.pack(_MAGIC, key, *self.page_shape, self.dtype.name.encode(), 2 * self.page_bytes, crc)
        tmp = os.path.join(self.dir, f".{key.hex()}.{self._host_tag}.{os.urandom(4).hex()}{_TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload_k)
                f.write(payload_v)
            os.replace(tmp, final)
        except BaseException:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise
        return self.file_bytes

    def read(self, key: bytes) -> tuple[np.ndarray, np.ndarray] | None:
        """The page of `key` as (k, v), each `page_shape`, or None on a miss. A bad file (truncated,
        corrupted, foreign, another layout) is a miss: logged once, counted and removed."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read(self.file_bytes + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._bad(path, f"unreadable ({e.strerror})", remove=False)
            return None
        reason = self._check(key, data)
        if reason is not None:
            self._bad(path, reason)
            return None
        try:
            os.utime(path)  # the LRU clock of eviction (shared with the other processes)
        except OSError:
            pass
        body = np.frombuffer(data, dtype=self.dtype, offset=_HEADER.size)
        n = body.size // 2
        return body[:n].reshape(self.page_shape), body[n:].reshape(self.page_shape)

    def _check(self, key: bytes, data: bytes) -> str | None:
        if len(data) != self.file_bytes:
            return f"{len(data)} bytes, a page file has {self.file_bytes}"
        magic, file_key, layers, heads, ps, dim, dtype, size, crc = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            return "not a jaxserve page file"
        if file_key != key:
            return "holds another key (a foreign file)"
        dtype = dtype.rstrip(b"\0").decode(errors="replace")
        if (layers, heads, ps, dim) != self.page_shape or dtype != self.dtype.name or size != 2 * self.page_bytes:
            return f"page layout {(layers, heads, ps, dim)} {dtype} differs from {self.page_shape} {self.dtype.name}"
        if zlib.crc32(memoryview(data)[_HEADER.size :]) != crc:
            return "checksum mismatch (corrupted)"
        return None

    def _bad(self, path: str, reason: str, remove: bool = True) -> None:
        with self._lock:
            self.counters.bad_files += 1
            first = path not in self._logged_bad
            self._logged_bad.add(path)
        if first:
            logger.warning("storage tier: %s is %s: a miss%s", path, reason, ", removed" if remove else "")
        if remove:
            try:
                os.remove(path)
            except OSError:
                pass

    # -- the bound

    def _scan(self) -> tuple[list[tuple[float, int, str]], int]:
        files, total = [], 0
        for entry in _scandir(self.dir):
            if entry.name.endswith(_SUFFIX):
                try:
                    st = entry.stat()
                except OSError:
                    continue
                files.append((st.st_mtime, st.st_size, entry.path))
                total += st.st_size
        return files, total

    def disk_bytes(self) -> int:
        """Bytes of page files in the directory now (all processes')."""
        return self._scan()[1]

    def enforce_bound(self) -> int:
        """If the directory holds more than the bound, remove least recently used page files until it holds
        at most `eviction_ratio` x the bound. Returns the files removed."""
        bound = self.config.max_size_bytes
        files, total = self._scan()
        self._last_scan = time.monotonic()
        removed = 0
        if bound and total > bound:
            target = int(bound * self.config.eviction_ratio)
            files.sort()
            for _, size, path in files:
                if total <= target:
                    break
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass  # another process evicted it
                except OSError:
                    continue
                total -= size
                removed += 1
        self._approx_bytes = total
        with self._lock:
            self.counters.files_evicted += removed
        return removed

    # -- asynchronous writes

    def submit_write(self, keys: Sequence[bytes], k: np.ndarray, v: np.ndarray) -> bool:
        """Queue pages for the writer thread: `keys[i]` names `k[:, i]`, `v[:, i]` (`[L, n, KVH, ps, D]`).
        Never blocks; returns False (and counts the pages as dropped) when the queue is full."""
        return self.submit_read(keys, _Ready(k, v))

    def submit_read(self, keys: Sequence[bytes], read: Any) -> bool:
        """`submit_write` of pages whose copy may still be in flight: `read.result()` (a `KVPageIO` read)
        gives their K and V, `[L, >= len(keys), KVH, ps, D]`; the writer thread waits for it."""
        if not keys:
            return True
        try:
            self._write_queue.put_nowait((list(keys), read))
            return True
        except queue.Full:
            with self._lock:
                self.counters.pages_dropped += len(keys)
            return False

    def _write_loop(self) -> None:
        try:  # Linux: a thread has its own nice value; the writer yields the CPU to the step's threads
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            item = self._write_queue.get()
            try:
                if item is None:
                    return
                self._write_batch(*item)
                bound = self.config.max_size_bytes
                if bound and (self._approx_bytes > bound or time.monotonic() - self._last_scan > _RESCAN_INTERVAL_S):
                    self.enforce_bound()
            except Exception:  # the writer must outlive one bad batch
                logger.exception("storage tier: write batch failed")
            finally:
                self._write_queue.task_done()

    def _write_batch(self, keys: list[bytes], read: Any) -> None:
        """Write one queued batch. Keys left unwritten by a failure (of the copy or the file system) are
        handed back through `take_failed_keys`, so a later backup of them tries again."""
        num_done = num_pages = num_bytes = 0
        started = time.perf_counter()
        try:
            k, v = read.result()
            started = time.perf_counter()
            for i, key in enumerate(keys):
                n = self.write(key, k[:, i], v[:, i])
                num_done = i + 1
                if n:
                    num_pages, num_bytes = num_pages + 1, num_bytes + n
                    with self._lock:
                        self.counters.pages_written += 1
                        self.counters.bytes_written += n
                    self._approx_bytes += n
        except OSError as e:
            logger.warning("storage tier: writing a page to %s failed: %s", self.dir, e)
        finally:
            if num_pages:  # pages already on disk moved no bytes: not part of the operation (as SGLang's)
                self._record_op(self._backup_ops, StorageOp(num_pages, num_bytes, time.perf_counter() - started))
            if num_done < len(keys):
                with self._lock:
                    self.counters.pages_failed += len(keys) - num_done
                    self._failed_keys.extend(keys[num_done:])

    def take_failed_keys(self) -> list[bytes]:
        """The keys whose writes failed since the last call (the caller may queue them again)."""
        with self._lock:
            failed, self._failed_keys = self._failed_keys, []
        return failed

    def _record_op(self, ops: collections.deque, op: StorageOp) -> None:
        with self._lock:
            ops.append(op)
            if ops is self._prefetch_ops:
                self.counters.num_prefetch_ops += 1
            else:
                self.counters.num_backup_ops += 1

    def snapshot(self) -> tuple[StorageCounters, tuple[StorageOp, ...], tuple[StorageOp, ...]]:
        """A consistent copy of the counters (the reader and writer threads update them) with the latest
        (up to `MAX_OP_RECORDS`) prefetch and backup operations, oldest first: from the cumulative
        `num_prefetch_ops` / `num_backup_ops` an exporter knows how many of those are new to it."""
        with self._lock:
            return dataclasses.replace(self.counters), tuple(self._prefetch_ops), tuple(self._backup_ops)

    def flush_writes(self) -> None:
        """Block until every queued write is on disk (tests, shutdown)."""
        self._write_queue.join()

    # -- asynchronous reads

    def prefetch(self, first_page: int, keys: list[bytes], min_pages: int = 0) -> Prefetch:
        """Start reading `keys` in order on the reader thread, stopping at the first miss or bad file. The
        reader first asks how many of them exist in a row from the first (SGLang's storage hit query,
        counted in `counters.prefetch_hit_pages`); when fewer than `min_pages` do (the prefetch
        threshold) nothing is read."""
        pf = Prefetch(first_page, keys)
        self._read_queue.put((pf, min_pages))
        return pf

    def _read_loop(self) -> None:
        while True:
            item = self._read_queue.get()
            if item is None:
                return
            pf, min_pages = item
            try:
                num_hit = 0
                while num_hit < len(pf.keys) and not pf.is_cancelled and self.exists(pf.keys[num_hit]):
                    num_hit += 1
                with self._lock:
                    self.counters.prefetch_hit_pages += num_hit
                if num_hit < min_pages:
                    continue
                started = time.perf_counter()
                for key in pf.keys:  # on to the first miss: a page written since the query is read too
                    if pf.is_cancelled:
                        break
                    kv = self.read(key)
                    if kv is None:
                        break
                    pf.pages.append(kv)
                    with self._lock:
                        self.counters.pages_read += 1
                        self.counters.bytes_read += self.file_bytes
                if pf.pages:
                    op = StorageOp(len(pf.pages), len(pf.pages) * self.file_bytes, time.perf_counter() - started)
                    self._record_op(self._prefetch_ops, op)
            except Exception:
                logger.exception("storage tier: prefetch failed")
            finally:
                pf.done.set()

    def close(self) -> None:
        """Finish the queued writes and stop the threads."""
        if self._closed:
            return
        self._closed = True
        self._write_queue.put(None)
        self._read_queue.put(None)
        self._writer.join()
        self._reader.join()


class _Ready:
    """K and V already on the host, as a read that is done."""

    def __init__(self, k: np.ndarray, v: np.ndarray):
        self._kv = (k, v)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return self._kv


def _scandir(path: str):
    try:
        with os.scandir(path) as it:
            yield from it
    except OSError:
        return


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
