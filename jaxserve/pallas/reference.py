"""Pure-XLA ragged paged attention: the CPU fast path and the reference the Pallas kernel is tested against.

Each query block gathers the pages of its own sequence from the pool and runs a masked softmax over
them, so cost is `NB * Bq * P * page_size`: proportional to the tokens of the step times the kv bucket
of their own sequence, never to the whole batch's KV.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int32

from jaxserve.pallas.metadata import AttentionMetadata

_MASK_VALUE = -1e30


def write_kv(
    k_pool: Float[Array, "L N ps KVH D"],
    v_pool: Float[Array, "L N ps KVH D"],
    layer: Int32[Array, ""],
    k: Float[Array, "T KVH D"],
    v: Float[Array, "T KVH D"],
    slot_mapping: Int32[Array, " T"],
) -> tuple[Float[Array, "L N ps KVH D"], Float[Array, "L N ps KVH D"]]:
    """Scatter the step's new K/V into layer `layer` of the pools.

    `slot_mapping[t] = page * page_size + slot`; padding tokens point at the dummy page 0. Out-of-range
    slots are dropped rather than clamped.
    """
    page_size = k_pool.shape[2]
    page = slot_mapping // page_size
    slot = slot_mapping % page_size
    k_pool = k_pool.at[layer, page, slot].set(k.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[layer, page, slot].set(v.astype(v_pool.dtype), mode="drop")
    return k_pool, v_pool


def ragged_paged_attention_xla(
    q: Float[Array, "T H D"],
    k_pool: Float[Array, "L N ps KVH D"],
    v_pool: Float[Array, "L N ps KVH D"],
    layer: Int32[Array, ""],
    meta: AttentionMetadata,
    sm_scale: float,
) -> Float[Array, "T H D"]:
    """Causal attention of each packed query token over its sequence's KV in layer `layer` of the pool.

    The K/V of this step's tokens must already be written (see `write_kv`). Query heads are grouped over
    kv heads (GQA, `H = KVH * G`). Softmax is computed in float32. Rows of padding tokens hold garbage.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_pool.shape
    group = num_heads // num_kv_heads
    num_blocks, block_q = meta.block_token_idx.shape
    pages_per_seq = meta.page_table.shape[1]
    kv_len = pages_per_seq * page_size

    qb = q[meta.block_token_idx].reshape(num_blocks, block_q, num_kv_heads, group, head_dim)
    pages = meta.page_table[meta.block_seq_id]  # [NB, P]
    k = k_pool[layer, pages].reshape(num_blocks, kv_len, num_kv_heads, head_dim)
    v = v_pool[layer, pages].reshape(num_blocks, kv_len, num_kv_heads, head_dim)

    scores = jnp.einsum("bqkgd,bskd->bkgqs", qb, k, preferred_element_type=jnp.float32) * sm_scale
    q_pos = meta.block_q_start[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]  # [NB, Bq]
    kv_pos = jnp.arange(kv_len, dtype=jnp.int32)
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # [NB, Bq, S]
    scores = jnp.where(mask[:, None, None], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.reshape(num_blocks * block_q, num_heads, head_dim)
    return out[meta.token_out_idx].astype(q.dtype)


def dense_causal_attention(
    q: Float[Array, "T H D"], k: Float[Array, "T KVH D"], v: Float[Array, "T KVH D"], sm_scale: float
) -> Float[Array, "T H D"]:
    """Plain causal attention of one contiguous sequence (no pool): a brute-force reference for tests."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    mask = jnp.tril(jnp.ones((num_tokens, num_tokens), bool))
    probs = jax.nn.softmax(jnp.where(mask, scores, _MASK_VALUE), axis=-1)
    return jnp.einsum("hqk,khd->qhd", probs, v.astype(jnp.float32)).astype(q.dtype)
