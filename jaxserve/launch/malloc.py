"""glibc malloc settings of the server process (D-45).

XLA:CPU allocates each program's temporary buffers with malloc on every run and frees them after. By
default glibc serves a block above its mmap threshold (dynamic, at most 32 MiB on 64-bit) with a fresh
mmap, and a thread's arena unmaps a heap that a free emptied; either way the next run faults the block in
again page by page (a batch-16 greedy sample over Gemma 3's 262,144-token vocabulary: 6,500-8,200
faults per call and 2.7x the time). `keep_freed_memory` makes the process reuse what it freed instead:
one arena (every thread allocates from the main heap), no mmap, no automatic trim.
`return_freed_memory` (malloc_trim) still hands back what start-up freed.

Only where the server runs on CPU (`server_platform`, decided before jax is imported): the settings were
measured on XLA:CPU alone. On a GPU or TPU host the programs' temporaries live in device memory, and one
arena for every thread of a many-core host was never measured (it could serialize the host threads).

The offline `Engine` leaves its host process's malloc alone (a library should not, and the arena limit
must come before jax starts its threads); a script gets the same settings from the environment:
`GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647`.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import pkgutil
from typing import NamedTuple

from jaxserve.server_args import DEVICE_PLATFORMS

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
# the largest value mallopt takes (an int): a free never shrinks the heap by itself
NEVER_TRIM = 2**31 - 1
# a user's own malloc settings (glibc's tunables or its older environment variables) win
USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_",
                 "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


# top-level modules that give JAX an accelerator: its CUDA kernels (each beside a `jax_plugins` PJRT module) and
# the TPU runtime
ACCELERATOR_MODULES = ("jax_cuda13_plugin", "jax_cuda12_plugin", "libtpu")
# environment variables that load a PJRT plugin or the TPU runtime from a path
ACCELERATOR_PATHS = ("PJRT_NAMES_AND_LIBRARY_PATHS", "TPU_LIBRARY_PATH")


class ServerPlatform(NamedTuple):
    """Whether the server will run on XLA:CPU, and what said so (for the log line)."""

    is_cpu: bool
    reason: str


def server_platform(device: str | None) -> ServerPlatform:
    """Whether the server will run on CPU, decided before jax is imported (D-45 applies on CPU only).

    The first rule that speaks decides:
    1. The environment names JAX's platform: `JAX_PLATFORMS`' first entry (JAX's default backend) and
       `JAX_PLATFORM_NAME` (JAX's older name for the default), whichever are set and non-empty: CPU when
       each of them says cpu.
    2. `--device` (`device`): CPU when it says cpu; any other value is not CPU. The flag does not choose the
       platform, but the server refuses to start on another one (`ServerArgs.check_platform_flags`).
    3. Neither: CPU only when no accelerator back end of JAX is installed (`accelerator_plugins`), since with
       one JAX takes the accelerator when the host has it. A plugin installed on a host without its device
       is counted as not CPU: in doubt the settings stay off.
    """
    named = {name: os.environ[name] for name in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME") if os.environ.get(name, "").strip()}
    if named:
        is_cpu = all(value.split(",")[0].strip().lower() == "cpu" for value in named.values())
        return ServerPlatform(is_cpu, ", ".join(f"{name}={value}" for name, value in named.items()))
    if device is not None:
        return ServerPlatform(DEVICE_PLATFORMS.get(device.lower()) == "cpu", f"--device {device}")
    if plugins := accelerator_plugins():
        return ServerPlatform(False, f"neither JAX_PLATFORMS nor --device is set, and {plugins[0]} is installed")
    return ServerPlatform(True, "no accelerator back end of JAX is installed")


def accelerator_plugins() -> list[str]:
    """The accelerator back ends JAX would find, found without importing jax or them: the variables of
    `ACCELERATOR_PATHS` that are set, the modules of `ACCELERATOR_MODULES` that are installed, and JAX's PJRT
    plugins as JAX discovers them (modules of the `jax_plugins` namespace package, `jax_plugins` entry
    points: jax-cuda12-pjrt, jax-cuda13-pjrt, jax-rocm*-pjrt and others). Empty when there is none."""
    found = [name for name in ACCELERATOR_PATHS if os.environ.get(name)]
    found += [name for name in ACCELERATOR_MODULES if importlib.util.find_spec(name) is not None]
    namespace = importlib.util.find_spec("jax_plugins")
    if namespace is not None and namespace.submodule_search_locations:
        found += [f"jax_plugins.{module.name}" for module in pkgutil.iter_modules(namespace.submodule_search_locations)]
    found += [entry.value for entry in importlib.metadata.entry_points(group="jax_plugins")]
    return found


def keep_freed_memory(device: str | None) -> str:
    """On CPU (`server_platform`, with the server's `--device`), make glibc keep freed memory for reuse:
    `M_ARENA_MAX` 1, `M_MMAP_MAX` 0, `M_TRIM_THRESHOLD` 2**31 - 1 (D-45). Call it before any thread allocates
    (before jax starts): a thread keeps the arena it first took. A no-op elsewhere, without glibc, and where
    the environment sets malloc's own tunables (`GLIBC_TUNABLES` with `glibc.malloc.*`, or `MALLOC_*_`).
    Returns the line to log, saying which and why."""
    platform = server_platform(device)
    if not platform.is_cpu:
        return f"malloc: left as it is: D-45 is for CPU only, and this server may not run on CPU ({platform.reason})"
    user = [name for name in USER_SETTINGS if name in os.environ
            and (name != "GLIBC_TUNABLES" or "glibc.malloc." in os.environ[name])]
    if user:
        return f"malloc: glibc's settings from {', '.join(user)} (D-45 would keep freed memory for reuse)"
    libc = glibc()
    if libc is None:
        return "malloc: not glibc, left as it is"
    if not (libc.mallopt(M_ARENA_MAX, 1) and libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)):
        return "malloc: glibc refused mallopt, left as it is"
    return f"malloc: freed memory kept for reuse: one arena, no mmap, no automatic trim (D-45; CPU: {platform.reason})"


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
