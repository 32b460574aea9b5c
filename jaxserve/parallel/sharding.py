"""Shardings of the params and the KV pool on the mesh, and attention per device under shard_map."""

from __future__ import annotations

import collections
import math
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.parallel.rules import POOL_AXES, partition_spec

P = PartitionSpec


def replicated(mesh: Mesh) -> NamedSharding:
    """A whole copy on every device of the mesh."""
    return NamedSharding(mesh, P())


def tp_size(mesh: Mesh) -> int:
    return mesh.shape["tensor"]


def param_shardings(params, axes, mesh: Mesh):
    """NamedShardings for a params tree from the matching tree of logical axis names (`axes`:
    `functional.logical_axes(config)`; stacked layers get a leading unsplit "layers" axis)."""

    def one(x, names):
        names = tuple(names)
        if len(names) < x.ndim:  # stacked layers [L, ...]
            names = ("layers",) * (x.ndim - len(names)) + names
        return NamedSharding(mesh, partition_spec(names, x.shape, tp_size(mesh)))

    return jax.tree.map(one, params, _align(axes, params), is_leaf=lambda a: isinstance(a, tuple))


def _align(axes, params):
    """`axes` restricted and shaped to `params`' tree (per-layer or stacked layers)."""
    if isinstance(params, dict):
        if "layers" in params and isinstance(axes.get("layers"), dict):
            layer_axes = next(iter(axes["layers"].values())) if axes["layers"] else {}
            layers = params["layers"]
            if layers and isinstance(next(iter(layers)), int):
                aligned_layers = {i: _align(layer_axes, p) for i, p in layers.items()}
            else:
                aligned_layers = _align(layer_axes, layers)
            rest = {k: _align(axes[k], v) for k, v in params.items() if k != "layers"}
            return {**rest, "layers": aligned_layers}
        return {k: _align(axes[k], v) for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        return type(params)(_align(axes, p) for p in params)
    return tuple(axes)


def put(x, sharding: NamedSharding) -> jax.Array:
    """`jax.device_put(x, sharding)`, also when the mesh spans several processes: each
    process then places only its own devices' slices of `x`, which every process holds whole (same
    weights, same zero pool), since device_put refuses devices of other processes."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params, axes, mesh: Mesh):
    """Place `params` on the mesh by the rules table (`param_shardings`)."""
    return jax.tree.map(put, params, param_shardings(params, axes, mesh))


def num_shards(axes: tuple[str | None, ...], shape: tuple[int, ...], tp: int) -> int:
    """Into how many pieces tensor parallelism of size `tp` splits an array with logical `axes` and
    `shape` (`tp` if the rules table splits one of its dims and tp divides it, else 1: replicated)."""
    return tp if "tensor" in tuple(partition_spec(axes, shape, tp)) else 1


def per_device_nbytes(params, axes, tp: int) -> int:
    """Bytes of `params` one device holds at tensor parallelism `tp`: each array's bytes divided by its
    `num_shards` (split arrays) or whole (replicated ones: norms, an odd-sized vocabulary). Pure
    arithmetic on shapes (arrays or ShapeDtypeStructs), no device needed. `axes`: `functional.logical_axes(config)`."""
    shapes, names = jax.tree.leaves(params), jax.tree.leaves(_align(axes, params), is_leaf=lambda a: isinstance(a, tuple))
    total = 0
    for x, axis_names in zip(shapes, names):
        axis_names = ("layers",) * (x.ndim - len(axis_names)) + tuple(axis_names)
        total += math.prod(x.shape) * np.dtype(x.dtype).itemsize // num_shards(axis_names, x.shape, tp)
    return total


def placed_nbytes(tree) -> tuple[int, int]:
    """(bytes of the arrays in `tree`, the most bytes of them one device holds), read from the placed
    arrays' shards: a split array counts its slice on each device, a replicated one its whole copy on
    each. Only this process's devices are seen (multi-host: each rank reports its own)."""
    total, per_device = 0, collections.Counter()
    for x in jax.tree.leaves(tree):
        total += x.nbytes
        for shard in x.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    return total, max(per_device.values(), default=0)


def pool_shards(num_kv_heads: int, tp: int) -> int:
    """Into how many pieces the KV pool [L, N, KVH, ps, D] is split over kv heads at `tp` (after kv-head
    replication, `num_kv_heads` is a multiple of tp; 1 when tp does not divide it)."""
    return num_shards(POOL_AXES, (1, 1, num_kv_heads, 1, 1), tp)


def pool_sharding(mesh: Mesh, num_kv_heads: int) -> NamedSharding:
    """The KV pool [L, N, KVH, ps, D] split over kv heads. The spec names the first three axes only, so
    it also places a compressed pool's scales [L, N, KVH, ps] (`jaxserve.pallas.quantized_kv.QuantizedKV`)."""
    shape = (1, 1, num_kv_heads)
    return NamedSharding(mesh, partition_spec(POOL_AXES[:3], shape, tp_size(mesh)))


def vocab_sharding(mesh: Mesh, vocab_size: int) -> NamedSharding:
    """Logits [S, V] split over the vocabulary (replicated when tp does not divide V)."""
    return NamedSharding(mesh, partition_spec((None, "vocab"), (1, vocab_size), tp_size(mesh)))


def shard_attention(attn_fn: Callable, mesh: Mesh) -> Callable:
    """Run the model's `attn_fn(q, k, v, k_pool, v_pool, layer, slot_mapping, meta, sm_scale,
    sliding_window=None, logit_softcap=None)` (the K/V write and attention, `functional.paged_attention`;
    the window a traced scalar, replicated) once per
    device on its own heads under `jax.shard_map`: q [T, H, D], k/v [T, KVH, D] and the pools split over
    heads, the batch metadata replicated. Heads never talk to each other in attention, so no collective
    runs inside. `check_vma=False`: a `pallas_call` inside shard_map needs it (JAX 0.10.2).
    """
    heads = P(None, "tensor", None)
    pool = P(None, None, "tensor")  # [L, N, KVH, ...]: the pool's values and a compressed pool's scales

    def sharded(q, k, v, k_pool, v_pool, layer, slot_mapping, meta, sm_scale, sliding_window=None, logit_softcap=None):
        args, specs = [q, k, v, k_pool, v_pool, layer, slot_mapping, meta], [heads, heads, heads, pool, pool, P(), P(), P()]
        if sliding_window is not None:  # a traced scalar, replicated
            args.append(sliding_window)
            specs.append(P())

        def local(*a):
            window = a[8] if len(a) > 8 else None
            return attn_fn(*a[:8], sm_scale, sliding_window=window, logit_softcap=logit_softcap)

        fn = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=(heads, pool, pool), check_vma=False)
        return fn(*args)

    sharded.writes_kv = True
    return sharded
