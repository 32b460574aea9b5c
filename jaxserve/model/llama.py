"""The Llama-family decoder as pure functions over a params pytree.

One definition covers LlamaForCausalLM (Llama 2/3.x, SmolLM2), MistralForCausalLM (same graph; sliding
windows are not applied), Qwen2ForCausalLM (q/k/v bias) and Qwen3ForCausalLM (RMSNorm on q and k per
head), switched by `ModelConfig` flags. The forward runs on the paged KV pool: the pools are carried
through `lax.scan` over layers, each layer scatters its new K/V and then attends through the attention
backend given as a static function.

Numerics follow transformers' modeling_llama.py: RMSNorm in float32, rotate-half RoPE, SiLU-gated MLP.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jaxserve.config import ModelConfig
from jaxserve.model.forward_batch import ForwardBatch
from jaxserve.pallas.reference import write_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """Weights of all decoder layers, stacked on a leading layer axis L (x @ W layout: [in, out]).

    Optional fields are None for architectures without them (fixed for a model's lifetime).
    """

    attn_norm: Float[Array, "L E"]
    wq: Float[Array, "L E HD"]
    wk: Float[Array, "L E KD"]
    wv: Float[Array, "L E KD"]
    wo: Float[Array, "L HD E"]
    mlp_norm: Float[Array, "L E"]
    w_gate: Float[Array, "L E I"]
    w_up: Float[Array, "L E I"]
    w_down: Float[Array, "L I E"]
    bq: Float[Array, "L HD"] | None = None
    bk: Float[Array, "L KD"] | None = None
    bv: Float[Array, "L KD"] | None = None
    q_norm: Float[Array, "L D"] | None = None
    k_norm: Float[Array, "L D"] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelParams:
    """All weights. `lm_head` is None when the output projection is tied to `embed`."""

    embed: Float[Array, "V E"]
    layers: LayerParams
    final_norm: Float[Array, " E"]
    lm_head: Float[Array, "E V"] | None = None


AttentionFn = Callable[..., jax.Array]


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [D/2] (float64 numpy, a trace-time constant), with rope scaling applied.

    llama3 scaling follows Meta's Llama 3.1 reference (as in transformers' `_compute_llama3_parameters`):
    long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = config.rope_scaling
    if rs.kind == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs.kind == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq


def rms_norm(x: Float[Array, "... E"], weight: Float[Array, " E"], eps: float) -> Float[Array, "... E"]:
    """RMSNorm (Zhang & Sennrich 2019) computed in float32, cast back to x's dtype before the weight."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def apply_rope(
    x: Float[Array, "T N D"], cos: Float[Array, "T D"], sin: Float[Array, "T D"]
) -> Float[Array, "T N D"]:
    """Rotate-half RoPE (Su et al. 2021, the layout of HF checkpoints)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def _layer(
    config: ModelConfig,
    attn_fn: AttentionFn,
    batch: ForwardBatch,
    cos: jax.Array,
    sin: jax.Array,
    carry: tuple,
    p: LayerParams,
):
    h, k_pool, v_pool, layer = carry
    num_tokens = h.shape[0]
    nh, nkv, hd = config.num_heads, config.num_kv_heads, config.head_dim

    with jax.named_scope("attention"):
        x = rms_norm(h, p.attn_norm, config.rms_norm_eps)
        q = x @ p.wq
        k = x @ p.wk
        v = x @ p.wv
        if p.bq is not None:
            q, k, v = q + p.bq, k + p.bk, v + p.bv
        q = q.reshape(num_tokens, nh, hd)  # [T, H, D]
        k = k.reshape(num_tokens, nkv, hd)  # [T, KVH, D]
        v = v.reshape(num_tokens, nkv, hd)
        if p.q_norm is not None:
            q = rms_norm(q, p.q_norm, config.rms_norm_eps)
            k = rms_norm(k, p.k_norm, config.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k_pool, v_pool = write_kv(k_pool, v_pool, layer, k, v, batch.slot_mapping)
        o = attn_fn(q, k_pool, v_pool, layer, batch.attn, 1.0 / math.sqrt(hd))
        h = h + o.reshape(num_tokens, nh * hd) @ p.wo

    with jax.named_scope("mlp"):
        x = rms_norm(h, p.mlp_norm, config.rms_norm_eps)
        h = h + (jax.nn.silu(x @ p.w_gate) * (x @ p.w_up)) @ p.w_down
    return (h, k_pool, v_pool, layer + 1), None


def forward(
    params: ModelParams,
    k_pool: Float[Array, "L N ps KVH D"],
    v_pool: Float[Array, "L N ps KVH D"],
    batch: ForwardBatch,
    *,
    config: ModelConfig,
    attn_fn: AttentionFn,
) -> tuple[Float[Array, "T E"], Float[Array, "L N ps KVH D"], Float[Array, "L N ps KVH D"]]:
    """Run the decoder over a ragged batch: write every token's K/V into the pools and return the final
    (normed) hidden states [T, E] with the updated pools.

    `config` and `attn_fn` are static (bind them with functools.partial before jit). The pools should be
    donated by the caller's jit so the per-layer scatters update them in place.
    """
    h = params.embed[batch.input_ids]  # [T, E]
    inv_freq = jnp.asarray(rope_inv_freq(config), jnp.float32)
    angles = batch.positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, D]
    cos, sin = jnp.cos(angles).astype(h.dtype), jnp.sin(angles).astype(h.dtype)

    step = lambda carry, p: _layer(config, attn_fn, batch, cos, sin, carry, p)  # noqa: E731
    (h, k_pool, v_pool, _), _ = jax.lax.scan(step, (h, k_pool, v_pool, jnp.int32(0)), params.layers)
    h = rms_norm(h, params.final_norm, config.rms_norm_eps)
    return h, k_pool, v_pool


def compute_logits(params: ModelParams, hidden: Float[Array, "N E"]) -> Float[Array, "N V"]:
    """Output projection in float32 (tied to the embedding when `lm_head` is None)."""
    if params.lm_head is None:
        return jnp.einsum("ne,ve->nv", hidden, params.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("ne,ev->nv", hidden, params.lm_head, preferred_element_type=jnp.float32)
