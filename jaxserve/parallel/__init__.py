"""Devices live here: the mesh, the logical-axis rules table, and the helpers that shard params and the
KV pool and run attention per device (DESIGN.md, "Parallelism").

The model only names logical axes on its Params; the model runner asks this package for shardings.
On import it sizes XLA:CPU's thread pool for forced host devices (`host_devices`), which must happen
before jax creates its CPU backend.
"""

from jaxserve.parallel.host_devices import configure_cpu_thread_pool
from jaxserve.parallel.mesh import MESH_AXES, TensorParallelPlan, make_mesh, plan_tensor_parallel
from jaxserve.parallel.rules import LOGICAL_AXIS_RULES, POOL_AXES, partition_spec
from jaxserve.parallel.sharding import (
    num_shards,
    param_shardings,
    per_device_nbytes,
    placed_nbytes,
    pool_sharding,
    pool_shards,
    replicated,
    shard_attention,
    shard_params,
    vocab_sharding,
)

__all__ = [
    "LOGICAL_AXIS_RULES", "MESH_AXES", "POOL_AXES", "TensorParallelPlan", "make_mesh", "num_shards",
    "param_shardings", "partition_spec", "per_device_nbytes", "placed_nbytes", "plan_tensor_parallel", "pool_shards", "pool_sharding", "replicated", "shard_attention", "shard_params",
    "vocab_sharding",
]

configure_cpu_thread_pool()
