"""What the engine holds in memory: the weights, the KV pool and the process's resident set.

The array sizes are read from the placed arrays once the model runner holds them (they do not change
while serving: LoRA slots and pages are allocated at start-up); the RSS is read when asked. The server
logs one line after start-up and reports the same numbers in /get_server_info, as bytes (`memory`) and
as SGLang 0.5.23's `internal_states[i]["memory_usage"]` (GiB per device, its keys).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.parallel import placed_nbytes

GIB = 1 << 30  # SGLang's GB (mem_cache/memory_pool.py: 1024 ** 3)


@dataclasses.dataclass(frozen=True)
class ArrayBytes:
    """Bytes of the engine's device arrays: in all (logical arrays) and the most one device holds
    (tensor parallelism splits the weights' large matrices and the pool's kv heads; replicated
    arrays count whole on every device)."""

    weights_bytes: int
    weights_bytes_per_device: int
    kv_pool_bytes: int
    kv_pool_bytes_per_device: int
    num_devices: int


def measure_array_bytes(params, k_pool, v_pool, num_devices: int) -> ArrayBytes:
    """`params` (every leaf: LoRA slots and quantization scales included) and the K and V pools
    [L, N, KVH, ps, D] each, page 0 included: the pool's bytes are num_pages x page_size x bytes_per_token."""
    weights, weights_per_device = placed_nbytes(params)
    pool, pool_per_device = placed_nbytes((k_pool, v_pool))
    return ArrayBytes(weights, weights_per_device, pool, pool_per_device, num_devices)


@dataclasses.dataclass(frozen=True)
class MemoryUsage:
    """`arrays` and the process's resident set size in bytes when read (None where /proc is absent)."""

    arrays: ArrayBytes
    rss_bytes: int | None

    def log_line(self) -> str:
        a = self.arrays
        per_device = a.num_devices > 1

        def mib(total: int, one: int) -> str:
            return f"{total / (1 << 20):.1f} MiB" + (f" ({one / (1 << 20):.1f} MiB per device)" if per_device else "")

        rss = "unknown" if self.rss_bytes is None else f"{self.rss_bytes / (1 << 20):.1f} MiB"
        return (f"memory after start-up: weights {mib(a.weights_bytes, a.weights_bytes_per_device)}, KV pool "
                f"{mib(a.kv_pool_bytes, a.kv_pool_bytes_per_device)}"
                + (f" over {a.num_devices} devices" if per_device else "") + f", process RSS {rss}")

    def as_dict(self) -> dict[str, Any]:
        """/get_server_info's `memory` block: the `ArrayBytes` fields and `rss_bytes`."""
        return {**dataclasses.asdict(self.arrays), "rss_bytes": self.rss_bytes}

    def sglang_memory_usage(self, token_capacity: int, token_capacity_swa: int | None = None) -> dict[str, Any]:
        """SGLang's `memory_usage` entry (scheduler_components/memory_usage.py `build_memory_usage`): per
        device (one TP rank's GPU), in GiB rounded to 3 digits. `token_capacity_swa`: the window layers'
        tokens of the hybrid window pool (D-46), None without one (as SGLang reports a model without a
        hybrid pool). SGLang's `startup_available` and `graph` (CUDA graph capture) have no jaxserve
        counterpart."""
        a = self.arrays
        return {
            "weight": round(a.weights_bytes_per_device / GIB, 3),
            "kvcache": round(a.kv_pool_bytes_per_device / GIB, 3),
            "token_capacity": int(token_capacity),
            "token_capacity_swa": token_capacity_swa,
        }


def process_rss_bytes() -> int | None:
    """This process's resident set size in bytes (Linux: `VmRSS` of /proc/self/status), else None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass
    return None
