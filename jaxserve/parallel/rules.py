"""The one table that maps logical axis names to mesh axes (tensor parallelism over the "tensor" axis).

Megatron-LM's split (Shoeybi et al. 2019): Q/K/V and gate/up are column-parallel (their output
features, i.e. heads and MLP units, are split), O and down are row-parallel (their input features are
split, so GSPMD inserts one all-reduce after each), and the embedding and output head are split over
the vocabulary. The KV pool is split over kv heads, like the K/V projections that fill it.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec

# logical axis -> mesh axis (None: replicated). Every axis a Param or the pool names is listed.
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "embed": None,
    "vocab": "tensor",
    "q_heads": "tensor",  # the flat (heads x head_dim) input axis of wo: split between heads
    "kv_heads": "tensor",  # the kv-head axis of wqkv / bqkv and of the pool
    "qkv": None,  # within one kv head: its G query heads, K and V rows
    "head_dim": None,
    "mlp": "tensor",
    "gate_up": None,
    "layers": None,
    "pages": None,
    "page": None,
}

# the KV pool [L, N, KVH, ps, D]
POOL_AXES = ("layers", "pages", "kv_heads", "page", "head_dim")


def partition_spec(axes: tuple[str | None, ...], shape: tuple[int, ...] | None = None, tp_size: int = 1) -> PartitionSpec:
    """The PartitionSpec of an array whose dims have logical names `axes`.

    With `shape` given, a dim whose size `tp_size` does not divide stays replicated (a vocabulary of an
    odd size, say): JAX cannot place an uneven split.

    Raises:
        KeyError: an axis name missing from `LOGICAL_AXIS_RULES`.
    """
    mesh_axes = []
    for i, name in enumerate(axes):
        mesh_axis = None if name is None else LOGICAL_AXIS_RULES[name]
        if mesh_axis is not None and shape is not None and shape[i] % tp_size:
            mesh_axis = None
        mesh_axes.append(mesh_axis)
    return PartitionSpec(*mesh_axes)
