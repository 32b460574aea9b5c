"""The device mesh and the tensor-parallel plan of a model (which tp sizes its shape allows).

One mesh for the process: axes ("data", "tensor") of sizes (1, tp). Devices default to `jax.devices()`,
which under `jax.distributed` lists every process's devices, so a multi-host mesh (docs/scaling.md) is the same
call with more devices.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

MESH_AXES = ("data", "tensor")


class HeadCounts(Protocol):
    """What the tensor-parallel plan reads of a model's shape (a `model.config.ModelConfig` has both)."""

    num_heads: int
    num_kv_heads: int


def make_mesh(tp_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (1, tp_size) mesh over the first `tp_size` of `devices` (default: all visible devices).

    Raises:
        ValueError: `tp_size` < 1, or more than the visible devices (the message names both numbers).
    """
    devices = list(jax.devices() if devices is None else devices)
    if tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {tp_size}")
    if tp_size > len(devices):
        hint = (
            " (on CPU, set JAX_NUM_CPU_DEVICES or XLA_FLAGS=--xla_force_host_platform_device_count before start)"
            if devices[0].platform == "cpu" else ""
        )
        raise ValueError(f"--tp-size {tp_size} needs {tp_size} devices, but {len(devices)} {'is' if len(devices) == 1 else 'are'} visible{hint}")
    return Mesh(np.asarray(devices[:tp_size]).reshape(1, tp_size), MESH_AXES)


class TensorParallelPlan(NamedTuple):
    """How a model runs at a tp size: `kv_replicas` copies of each kv head (1 when tp divides them)."""

    tp_size: int
    kv_replicas: int


def valid_tp_sizes(config: HeadCounts) -> list[int]:
    """Every tp size the model's head counts allow (see `plan_tensor_parallel`)."""
    return [t for t in range(1, config.num_heads + 1) if _refusal(config, t, "") is None]


def plan_tensor_parallel(config: HeadCounts, tp_size: int, model_name: str = "the model") -> TensorParallelPlan:
    """Check that `tp_size` splits the model's heads evenly: query heads must divide by tp; kv heads
    must divide by tp, or tp by them (then each kv head is replicated tp / num_kv_heads times, as
    SGLang and vLLM do for GQA models with few kv heads).

    Raises:
        ValueError: a shape tp does not divide, e.g. "SmolLM2-135M has 9 attention heads; --tp-size 2
            does not divide them (use 1, 3 or 9)".
    """
    refusal = _refusal(config, tp_size, model_name)
    if refusal is not None:
        sizes = [str(t) for t in valid_tp_sizes(config)]
        listed = ", ".join(sizes[:-1]) + f" or {sizes[-1]}" if len(sizes) > 1 else sizes[0]
        raise ValueError(f"{refusal} (use {listed})")
    nkv = config.num_kv_heads
    return TensorParallelPlan(tp_size, 1 if nkv % tp_size == 0 else tp_size // nkv)


def _refusal(config: HeadCounts, tp: int, name: str) -> str | None:
    if tp < 1:
        return f"--tp-size must be >= 1, got {tp}"
    if config.num_heads % tp:
        return f"{name} has {config.num_heads} attention heads; --tp-size {tp} does not divide them"
    nkv = config.num_kv_heads
    if nkv % tp and tp % nkv:
        return (f"{name} has {nkv} kv heads; --tp-size {tp} neither divides them nor is a multiple of them")
    return None
