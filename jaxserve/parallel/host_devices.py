"""Forced CPU host devices (`JAX_NUM_CPU_DEVICES=N`, or `XLA_FLAGS=--xla_force_host_platform_device_count=N`):
XLA:CPU's thread pool sized so that a collective cannot starve it.

Why (jax 0.10.2, D-33): XLA:CPU runs every host
device's program on one shared Eigen thread pool of max(cores, N) threads, and an all-reduce thunk
that continues a parallel matmul blocks the pool thread it runs on until every device has reached the
rendezvous. At tp 3 on 2 cores (a pool of 3) the 256-token steps of the default model aborted after
the rendezvous' 40 s termination timeout (`xla_cpu_collective_call_terminate_timeout_seconds`; the
stack: `AllReduceThunk::Execute` on an `Eigen::ThreadPoolTempl::WorkerLoop` thread) in every run
(4 of 4, one with NPROC=3 set by hand); with the pool at N + 1 or 2N threads the same run finished. XLA sizes the pool from the `NPROC` environment
variable when it is set (`DefaultThreadPoolSize`, read once when the CPU client starts), so this module
sets it before jax creates its CPU backend, unless the user has set it.
"""

from __future__ import annotations

import os
import re
from typing import MutableMapping

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def requested_cpu_devices(environ: MutableMapping[str, str]) -> int:
    """The number of CPU host devices the environment asks jax for (1 when it asks for none);
    JAX_NUM_CPU_DEVICES wins over the XLA flag, as in jax."""
    value = environ.get("JAX_NUM_CPU_DEVICES", "").strip()
    if value.lstrip("-").isdigit() and int(value) > 0:
        return int(value)
    match = _DEVICE_COUNT_FLAG.search(environ.get("XLA_FLAGS", ""))
    return int(match.group(1)) if match else 1


def cpu_thread_pool_size(num_devices: int, cpu_count: int) -> int:
    """Threads for XLA:CPU's pool with `num_devices` host devices on `cpu_count` cores: twice the devices
    (each device blocked in a collective holds a thread; N + 1 and 2N both passed the run that N
    aborted), never fewer than the cores."""
    return max(cpu_count, 2 * num_devices)


def configure_cpu_thread_pool(environ: MutableMapping[str, str] | None = None, cpu_count: int | None = None) -> int | None:
    """Set `NPROC` in `environ` (default `os.environ`) for more than one forced host device, unless it is
    set already. Returns the pool size set, or None when nothing was changed. It takes effect only
    if jax has not created its CPU backend yet (jaxserve.parallel calls it on import)."""
    environ = os.environ if environ is None else environ
    num_devices = requested_cpu_devices(environ)
    if num_devices <= 1 or "NPROC" in environ:
        return None
    size = cpu_thread_pool_size(num_devices, cpu_count or os.cpu_count() or 1)
    environ["NPROC"] = str(size)
    return size
