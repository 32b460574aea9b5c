"""Pure-XLA ragged paged attention: the CPU fast path and the reference the Pallas kernel is tested against.

Each query block reads the pages of its own sequence from the pool, a block of keys at a time, up to its
last causal position: cost is proportional to the step's tokens times the KV each one attends to, never
to the whole batch's KV or to the bucket's padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int32

from jaxserve.pallas.metadata import AttentionMetadata
from jaxserve.pallas.numerics import pairwise_sum
from jaxserve.pallas.quantized_kv import is_quantized, write_rows

_MASK_VALUE = -1e30
# the window of a layer without one, when a model's layers mix windowed and full attention (Gemma 2/3):
# larger than any position, so `kv_pos > q_pos - NO_WINDOW` holds for every key
NO_WINDOW = 1 << 30
KV_BLOCK_TOKENS = 256  # keys per inner-loop step of the XLA path; measured best of 128/256/1024 on CPU


def write_kv(
    k_pool: Float[Array, "L N KVH ps D"],
    v_pool: Float[Array, "L N KVH ps D"],
    layer: Int32[Array, ""],
    k: Float[Array, "T KVH D"],
    v: Float[Array, "T KVH D"],
    slot_mapping: Int32[Array, " T"],
) -> tuple[Float[Array, "L N KVH ps D"], Float[Array, "L N KVH ps D"]]:
    """Scatter the step's new K/V into layer `layer` of the pools (plain arrays, or `QuantizedKV` pools,
    which quantize each token's rows: jaxserve/pallas/quantized_kv.py).

    `slot_mapping[t] = page * page_size + slot`; padding tokens point at the dummy page 0. Out-of-range
    slots are dropped rather than clamped.
    """
    page_size = k_pool.shape[3]
    page = slot_mapping // page_size
    slot = slot_mapping % page_size
    # two index arrays around a slice: the indexed view is [T, KVH, D], the shape of k and v
    return write_rows(k_pool, layer, page, slot, k), write_rows(v_pool, layer, page, slot, v)


def ragged_paged_attention_xla(
    q: Float[Array, "T H D"],
    k_pool: Float[Array, "L N KVH ps D"],
    v_pool: Float[Array, "L N KVH ps D"],
    layer: Int32[Array, ""],
    meta: AttentionMetadata,
    sm_scale: float,
    kv_block: int = KV_BLOCK_TOKENS,
    *,
    sliding_window: Int32[Array, ""] | int | None = None,
    logit_softcap: float | None = None,
) -> Float[Array, "T H D"]:
    """Causal attention of each packed query token over its sequence's KV in layer `layer` of the pool.

    The K/V of this step's tokens must already be written (see `write_kv`). Query heads are grouped over
    kv heads (GQA, `H = KVH * G`). Rows of padding tokens are zero.
    `kv_block` is the number of keys per inner-loop step (static; rounded down to whole pages, at
    least one page); `sm_scale` is usually head_dim ** -0.5.
    `sliding_window` (tokens; a traced int32 scalar, so one program serves windowed and full layers;
    `NO_WINDOW` for none): a query at position p attends to keys at positions p - window < kv <= p, the
    last `window` tokens including itself (transformers' `sliding_window_overlay`; Mistral, Gemma 2/3);
    the keys before the first row's window are never read. None (static): plain causal attention.
    `logit_softcap` (static): scores become `cap * tanh(score / cap)` after scaling (Gemma 2).

    Algorithm: flash attention (Dao et al., 2022) run as XLA loops. For each query block, a loop over
    blocks of `kv_block` tokens of its own sequence keeps a running max, denominator and output in
    float32 (the online softmax), and stops at the block's last causal position. So a block reads only
    the KV it attends to: the pages a shorter sequence leaves unused in the bucket are never read, and
    a prefill does about half the work of a full square. The loop over blocks stops after the batch's
    real ones (the builder packs them first), so a bucket's padding blocks cost nothing: a speculative
    verification of one sequence runs in a 16-token bucket with 16 sequence slots, 16 padding blocks
    that a map over all blocks spent about a fifth of its attention time on (D-16).
    Materializing every block's whole KV bucket at once was 1.5-17x slower on CPU (D-14,
    `benchmarks/attention/bench_attention.py`).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, num_kv_heads, page_size, _ = k_pool.shape
    group = num_heads // num_kv_heads
    num_blocks, block_q = meta.block_token_idx.shape
    pages_per_seq = meta.page_table.shape[1]
    pages_per_chunk = max(1, min(kv_block // page_size, pages_per_seq))
    chunk = pages_per_chunk * page_size
    # Pad the page table to whole chunks plus one; the extra entries (dummy page 0) are never read past
    # a block's last chunk. The extra chunk keeps a chunk's start `c * pages_per_chunk` a live function
    # of the loop index: without it, a bucket of at most one chunk (pages_per_seq <= 16 at page size 16,
    # any context <= 256 tokens) has a start XLA clamps to 0, so the K/V gathers leave the loop, XLA
    # fuses the write_kv scatter into the hoisted V gather, and to keep the pre-scatter pool alive for
    # that fusion it copies the whole V pool every layer: 50-100x slower decode (D-15).
    page_table = jnp.pad(meta.page_table, ((0, 0), (0, -pages_per_seq % pages_per_chunk + pages_per_chunk)))
    row_offset = jnp.tile(jnp.arange(block_q, dtype=jnp.int32), group)  # [G * Bq] query row of each row
    rows = group * block_q

    def attend_block(b, out):
        seq, q_start, num_q = meta.block_seq_id[b], meta.block_q_start[b], meta.block_num_q[b]
        token_idx = meta.block_token_idx[b]
        # Rows of a block are laid out head-group-major, [KVH, G * Bq, D], so each kv head is one matmul.
        q_blk = q[token_idx].reshape(block_q, num_kv_heads, group, head_dim)
        q_blk = q_blk.transpose(1, 2, 0, 3).reshape(num_kv_heads, rows, head_dim)
        q_pos = q_start + row_offset
        kv_end = q_start + num_q  # causal: keys at positions < kv_end
        num_chunks = (kv_end + chunk - 1) // chunk
        # windowed: the block's first row needs no key before q_start - window + 1, so neither do the
        # others; a chunk where some row sees no key yet is wiped by the next one's rescale (exp(-inf))
        first_chunk = 0 if sliding_window is None else jnp.maximum(q_start - sliding_window + 1, 0) // chunk

        def kv_step(c, carry):
            run_max, denom, acc = carry
            pages = jax.lax.dynamic_slice(page_table[seq], (c * pages_per_chunk,), (pages_per_chunk,))
            # Index the pool directly: slicing out the layer first would copy the whole layer. The
            # chunk goes head-major, [KVH, chunk, D], before the dots: with the kv-head batch axis in
            # the middle of the operand XLA:CPU's dots ran slower (D-16). A page holds each head's rows
            # contiguously ([KVH, ps, D]), so the gather moves page_size x D blocks and the transpose
            # swaps whole blocks (D-01: decode attention 1.3-1.5x faster than with [ps, KVH, D] pages)
            k, k_scale = _chunk(k_pool, layer, pages, q.dtype)
            v, v_scale = _chunk(v_pool, layer, pages, q.dtype)
            s = jnp.einsum("krd,ksd->krs", q_blk, k, preferred_element_type=jnp.float32) * sm_scale
            if k_scale is not None:  # a compressed pool: scale each key's scores, not its D values
                s = s * k_scale[:, None, :]
            if logit_softcap is not None:
                s = logit_softcap * jnp.tanh(s / logit_softcap)
            kv_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            visible = kv_pos[None, None, :] <= q_pos[None, :, None]
            if sliding_window is not None:
                visible &= kv_pos[None, None, :] > q_pos[None, :, None] - sliding_window
            s = jnp.where(visible, s, _MASK_VALUE)
            new_max = jnp.maximum(run_max, s.max(axis=-1))
            p = jnp.exp(s - new_max[..., None])
            rescale = jnp.exp(run_max - new_max)
            # a fixed-order sum: a reduce's order here changed with the block's rows (pallas/numerics.py)
            denom = denom * rescale + pairwise_sum(p, -1)[..., 0]
            if v_scale is not None:
                p = p * v_scale[:, None, :]
            pv = jnp.einsum("krs,ksd->krd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return new_max, denom, acc * rescale[..., None] + pv

        init = (
            jnp.full((num_kv_heads, rows), _MASK_VALUE, jnp.float32),
            jnp.zeros((num_kv_heads, rows), jnp.float32),
            jnp.zeros((num_kv_heads, rows, head_dim), jnp.float32),
        )
        _, denom, acc = jax.lax.fori_loop(first_chunk, num_chunks, kv_step, init)
        res = (acc / jnp.maximum(denom, 1e-30)[..., None]).reshape(num_kv_heads, group, block_q, head_dim)
        res = res.transpose(2, 0, 1, 3).reshape(block_q, num_heads, head_dim)
        # rows past the block's last query go to row T, which the scatter drops
        dest = jnp.where(jnp.arange(block_q) < num_q, token_idx, num_tokens)
        return out.at[dest].set(res.astype(out.dtype), mode="drop")

    # The builder packs real blocks first (`build_attention_metadata`): only they are visited, so a
    # bucket's padding blocks cost nothing (a verification's 16-token bucket has 16 of them).
    num_real_blocks = jnp.sum(meta.block_num_q > 0)
    out = jnp.zeros((num_tokens, num_heads, head_dim), q.dtype)
    return jax.lax.fori_loop(0, num_real_blocks, attend_block, out)


def _chunk(pool, layer, pages, dtype):
    """Pages `pages` of layer `layer` head-major, `[KVH, n * ps, D]`, and for a `QuantizedKV` pool their
    scales `[KVH, n * ps]` (None for a plain pool). A compressed chunk is cast to `dtype`, unscaled."""
    if not is_quantized(pool):
        x = pool[layer, pages]
        return x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1]), None
    x, scale = pool.values(pool.data[layer, pages]), pool.scale[layer, pages]
    return (x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1]).astype(dtype),
            scale.transpose(1, 0, 2).reshape(scale.shape[1], -1))


def dense_causal_attention(
    q: Float[Array, "T H D"], k: Float[Array, "T KVH D"], v: Float[Array, "T KVH D"], sm_scale: float,
    sliding_window: int | None = None, logit_softcap: float | None = None,
) -> Float[Array, "T H D"]:
    """Plain causal attention of one contiguous sequence (no pool): a brute-force reference for tests
    (window and soft-capping as in `ragged_paged_attention_xla`)."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    if logit_softcap is not None:
        scores = logit_softcap * jnp.tanh(scores / logit_softcap)
    mask = jnp.tril(jnp.ones((num_tokens, num_tokens), bool))
    if sliding_window is not None:
        mask &= ~jnp.tril(jnp.ones((num_tokens, num_tokens), bool), -sliding_window)
    probs = jax.nn.softmax(jnp.where(mask, scores, _MASK_VALUE), axis=-1)
    return jnp.einsum("hqk,khd->qhd", probs, v.astype(jnp.float32)).astype(q.dtype)
