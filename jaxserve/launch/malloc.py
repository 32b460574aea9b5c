"""glibc malloc settings of the server process (D-45).

XLA:CPU allocates each program's temporary buffers with malloc on every run and frees them after. By
default glibc serves a block above its mmap threshold (dynamic, at most 32 MiB on 64-bit) with a fresh
mmap, and a thread's arena unmaps a heap that a free emptied; either way the next run faults the block in
again page by page (a batch-16 greedy sample over Gemma 3's 262,144-token vocabulary: 6,500-8,200
faults per call and 2.7x the time). `keep_freed_memory` makes the process reuse what it freed instead:
one arena (every thread allocates from the main heap), no mmap, no automatic trim.
`return_freed_memory` (malloc_trim) still hands back what start-up freed.

The offline `Engine` leaves its host process's malloc alone (a library should not, and the arena limit
must come before jax starts its threads); a script gets the same settings from the environment:
`GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647`.
"""

from __future__ import annotations

import ctypes
import os

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
# the largest value mallopt takes (an int): a free never shrinks the heap by itself
NEVER_TRIM = 2**31 - 1
# a user's own malloc settings (glibc's tunables or its older environment variables) win
USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_",
                 "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> str:
    """Make glibc keep freed memory for reuse: `M_ARENA_MAX` 1, `M_MMAP_MAX` 0, `M_TRIM_THRESHOLD`
    2**31 - 1 (D-45). Call it before any thread allocates (before jax starts): a thread keeps the arena
    it first took. A no-op without glibc, and where the environment sets malloc's own tunables
    (`GLIBC_TUNABLES` with `glibc.malloc.*`, or `MALLOC_*_`). Returns the line to log, saying which."""
    user = [name for name in USER_SETTINGS if name in os.environ
            and (name != "GLIBC_TUNABLES" or "glibc.malloc." in os.environ[name])]
    if user:
        return f"malloc: glibc's settings from {', '.join(user)} (D-45 would keep freed memory for reuse)"
    libc = glibc()
    if libc is None:
        return "malloc: not glibc, left as it is"
    if not (libc.mallopt(M_ARENA_MAX, 1) and libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)):
        return "malloc: glibc refused mallopt, left as it is"
    return "malloc: freed memory kept for reuse: one arena, no mmap, no automatic trim (D-45)"


def return_freed_memory() -> None:
    """Hand the heap that loading and compiling freed back to the OS (glibc's malloc_trim), so the
    server's RSS after start-up is what it holds, not its peak. A no-op without glibc."""
    if (libc := glibc()) is not None:
        libc.malloc_trim(0)


def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc, else None."""
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return None
        return ctypes.CDLL("libc.so.6")
    except (ValueError, OSError):  # no such name where the C library is not glibc
        return None
