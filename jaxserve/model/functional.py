"""The model's functional boundary: pure functions over a plain params dict, which the model runner compiles.

How the NNX engines sglang-jax and tpu-inference do it: the model is built abstract with `nnx.eval_shape`
and split once (`model_defs`); the params live as a plain nested dict (`nnx.to_pure_dict`'s form:
`{"embed": ..., "layers": {0: {...}, 1: {...}}, ...}`) that the loaders fill by path; `nnx.merge(graphdef,
params)` runs only inside traced functions. Only plain arrays cross a jit boundary: a State of Variables
crossing jit each step costs Python time per leaf (tpu-inference #2607).

`embed_tokens`, `decoder_layers`, `final_hidden`, `compute_logits` and `forward` build the Modules of
`config.architecture` (registry.py). `params["layers"]` is either per-layer (int keys, the host layer
loop's storage; `forward` unrolls them) or stacked on a leading L axis (`stack_layers`; `forward` runs
`lax.scan`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int32

from jaxserve.model import lora as lora_lib
from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder import DEFAULT_LOGITS_LAYOUT, AttentionFn, Decoder, Params
from jaxserve.model.forward_batch import ForwardBatch
from jaxserve.model.registry import get_model_class
from jaxserve.pallas.reference import write_kv


class ModelDefs(NamedTuple):
    """The graph definitions `nnx.merge` rebuilds Modules from: the model without its layers (embedding,
    final norm, head) and one decoder layer."""

    outer: Any
    layer: Any


def model_class(config: ModelConfig) -> type[Decoder]:
    """The outer Module of `config.architecture` (a `Decoder`; its `layer_cls` is the decoder layer), from
    the registry.

    Raises:
        ValueError: the architecture is not supported.
    """
    return get_model_class(config.architecture)


@functools.cache
def model_defs(config: ModelConfig) -> ModelDefs:
    """Build the abstract model once per config (`nnx.eval_shape`: no memory) and split it."""
    cls = model_class(config)
    outer, _ = nnx.split(nnx.eval_shape(lambda: cls(dataclasses.replace(config, num_layers=0))))
    layer, _ = nnx.split(nnx.eval_shape(lambda: cls.layer_cls(config)))
    return ModelDefs(outer, layer)


def abstract_params(config: ModelConfig, dtype=jnp.float32) -> Params:
    """The params dict of `config` as ShapeDtypeStructs (per-layer storage): what a loader must fill."""
    _, state = nnx.split(nnx.eval_shape(lambda: model_class(config)(config, dtype)))
    return nnx.to_pure_dict(state)


def logical_axes(config: ModelConfig) -> Params:
    """The params dict's tree with each leaf's logical axis names (a tuple of str, one per dim)."""
    _, state = nnx.split(nnx.eval_shape(lambda: model_class(config)(config)))
    return nnx.to_pure_dict(jax.tree.map(lambda v: v.get_metadata()["out_sharding"], state,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))


def compute_dtype(params: Params) -> jnp.dtype:
    """The activations' (and the KV pool's) dtype: the final norm's, since quantized weights may be int8."""
    return params["final_norm"].dtype


def outer_params(params: Params) -> Params:
    """`params` without its layers (what embed and head programs take)."""
    return {k: v for k, v in params.items() if k != "layers"}


def is_stacked(layers) -> bool:
    """Whether `layers` is stacked on a leading L axis (str keys) rather than per layer (int keys)."""
    return bool(layers) and not isinstance(next(iter(layers)), int)


def per_layer(params: Params) -> tuple[Params, ...]:
    """The per-layer params trees in layer order (`params["layers"]` not stacked)."""
    layers = params["layers"]
    return tuple(layers[i] for i in sorted(layers))


def stack_layers(params: Params) -> Params:
    """Per-layer `params["layers"]` -> one tree stacked on a leading L axis (for `lax.scan`)."""
    layers = params["layers"]
    if is_stacked(layers):
        return params
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[i] for i in sorted(layers)])
    return {**params, "layers": stacked}


def unstack_layers(params: Params) -> Params:
    """Stacked `params["layers"]` -> per-layer trees, each in its own buffers (the host loop reads them
    in place; a slice of a stacked buffer is copied before each matmul on XLA:CPU)."""
    layers = params["layers"]
    if not is_stacked(layers):
        return params
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    per_layer = {i: jax.tree.map(lambda x, i=i: jnp.array(x[i]), layers) for i in range(num_layers)}
    return {**params, "layers": per_layer}


def embed_tokens(
    params: Params, batch: ForwardBatch, *, config: ModelConfig
) -> tuple[Float[Array, "E T"], Float[Array, "T D"], Float[Array, "T D"]]:
    """`Decoder.embed_tokens` over `params` (its layers, if any, are ignored)."""
    return nnx.merge(model_defs(config).outer, outer_params(params)).embed_tokens(batch)


def decoder_layers(
    ps: tuple[Params, ...],
    h: Float[Array, "E T"],
    k_pool: Float[Array, "L N KVH ps D"],
    v_pool: Float[Array, "L N KVH ps D"],
    first_layer: Int32[Array, ""],
    batch: ForwardBatch,
    cos: Float[Array, "T D"],
    sin: Float[Array, "T D"],
    *,
    config: ModelConfig,
    attn_fn: AttentionFn,
) -> tuple[Float[Array, "E T"], Float[Array, "L N KVH ps D"], Float[Array, "L N KVH ps D"]]:
    """Consecutive decoder layers `first_layer`, `first_layer + 1`, ... with per-layer params `ps`
    (unrolled): write each layer's K/V into the pools, attend, run the MLP."""
    layer_def, attn_fn = model_defs(config).layer, paged_attention(attn_fn)
    for i, p in enumerate(ps):
        p, lora = lora_lib.split_lora(p)
        extra = {} if lora is None else {"lora": lora}
        h, k_pool, v_pool = nnx.merge(layer_def, p)(h, k_pool, v_pool, first_layer + i, batch, cos, sin, attn_fn, **extra)
    return h, k_pool, v_pool


def final_hidden(params: Params, h: Float[Array, "E T"], *, config: ModelConfig) -> Float[Array, "T E"]:
    """The final RMSNorm, back in the token-major layout [T, E]."""
    return nnx.merge(model_defs(config).outer, outer_params(params)).final_hidden(h)


def compute_logits(
    params: Params, hidden: Float[Array, "N E"], *, config: ModelConfig, layout: str = DEFAULT_LOGITS_LAYOUT
) -> Float[Array, "N V"]:
    """Output projection [N, V] in float32 (tied to the embedding when the head is absent). `layout`
    (static): one of `LOGITS_LAYOUTS`; the default is the one measured fastest on XLA:CPU."""
    return nnx.merge(model_defs(config).outer, outer_params(params)).logits(hidden, layout)


def forward(
    params: Params,
    k_pool: Float[Array, "L N KVH ps D"],
    v_pool: Float[Array, "L N KVH ps D"],
    batch: ForwardBatch,
    *,
    config: ModelConfig,
    attn_fn: AttentionFn,
) -> tuple[Float[Array, "T E"], Float[Array, "L N KVH ps D"], Float[Array, "L N KVH ps D"]]:
    """Run the decoder over a ragged batch: write every token's K/V into the pools and return the final
    (normed) hidden states [T, E] with the updated pools.

    Stacked `params["layers"]` run under `lax.scan` (one layer body in the compiled program; the pools
    ride in the carry, never as xs/ys); per-layer params are unrolled. `config` and `attn_fn` are static
    (bind them with functools.partial before jit): an attention backend, or a function that also
    writes K/V (`paged_attention`).
    The pools should be donated by the caller's jit so the per-layer scatters update them in place.
    """
    attn_fn = paged_attention(attn_fn)
    h, cos, sin = embed_tokens(params, batch, config=config)
    layers = params["layers"]
    if is_stacked(layers):
        layer_def = model_defs(config).layer

        def step(carry, p):
            h, k_pool, v_pool, layer = carry
            p, lora = lora_lib.split_lora(p)
            extra = {} if lora is None else {"lora": lora}
            h, k_pool, v_pool = nnx.merge(layer_def, p)(h, k_pool, v_pool, layer, batch, cos, sin, attn_fn, **extra)
            return (h, k_pool, v_pool, layer + 1), None

        (h, k_pool, v_pool, _), _ = jax.lax.scan(step, (h, k_pool, v_pool, jnp.int32(0)), layers)
    else:
        ps = tuple(layers[i] for i in sorted(layers))
        h, k_pool, v_pool = decoder_layers(
            ps, h, k_pool, v_pool, jnp.int32(0), batch, cos, sin, config=config, attn_fn=attn_fn
        )
    return final_hidden(params, h, config=config), k_pool, v_pool


@functools.cache
def paged_attention(attention: Callable) -> AttentionFn:
    """Wrap a ragged paged attention backend (`(q, k_pool, v_pool, layer, meta, sm_scale,
    [sliding_window=, logit_softcap=]) -> out`, see `jaxserve.pallas.get_attention_backend`) as the
    model's `attn_fn`: scatter the step's K/V into layer `layer` of the pools, then attend. The window
    (a traced int32 scalar) and the soft-cap (static) reach the backend only when given, so a backend
    without them serves models without windows. A function already in that form (marked `writes_kv`, like this
    wrapper or `jaxserve.parallel.shard_attention`'s) is returned as it is, so every entry point takes
    either."""
    if getattr(attention, "writes_kv", False):
        return attention

    def attn_fn(q, k, v, k_pool, v_pool, layer, slot_mapping, meta, sm_scale, sliding_window=None, logit_softcap=None):
        k_pool, v_pool = write_kv(k_pool, v_pool, layer, k, v, slot_mapping)
        extra = {} if sliding_window is None else dict(sliding_window=sliding_window)
        if logit_softcap is not None:
            extra["logit_softcap"] = logit_softcap
        return attention(q, k_pool, v_pool, layer, meta, sm_scale, **extra), k_pool, v_pool

    attn_fn.writes_kv = True
    return attn_fn
