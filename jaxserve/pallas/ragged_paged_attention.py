"""Ragged paged attention as one Pallas kernel (Triton lowering on GPU, interpret mode on CPU).

Same contract as `ragged_paged_attention_xla` (jaxserve/pallas/reference.py): a batch of query blocks
(`AttentionMetadata`), each holding consecutive positions of one sequence, attends causally to that
sequence's pages of layer `layer` of the stacked pool. Extends and decodes mix freely in one call.

Kernel layout (the design of vLLM's and SGLang's ragged paged attention, written for Pallas/Triton):

- Grid `(NB, KVH)`: one program per (query block, kv head). The block's sequence id, first position
  and row count are read as scalars from ordinary int32 inputs inside the kernel: scalar prefetch does
  not exist in Pallas on GPU, and the index maps cannot see array values without it.
- The query rows of all `G` query heads that share the kv head are folded into the matmul's M
  dimension: `R = Bq' * G'` rows (`Bq'`, `G'` rounded up to powers of two, `R >= 16` because Triton's
  `dot` needs M, N, K >= 16).
- The inner loop walks the sequence's page-table row `PPB` pages at a time and gathers those pages of
  the whole stacked pool in-kernel (`k_ref[layer, pages, h]`, an indexed load of `PPB` contiguous `[page_size, D]` blocks), so no per-layer
  slice or per-sequence copy of the pool is ever made. It only visits the pages the block needs:
  `ceil((q_start + num_q) / (PPB * page_size))` steps, bounded by the page-table width.
- Sliding windows (Mistral, Gemma 2/3): a traced window per call masks keys at or before
  `p - window` and the loop starts at the first page block the block's first row needs.
- Online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; FlashAttention,
  Dao et al. 2022) in float32; `P @ V` runs in the pool dtype with a float32 accumulator, as the XLA
  path does.
- A compressed pool (`QuantizedKV`, `--kv-cache-dtype`) is read in its 8 bits and cast to q's dtype in
  the kernel; each key's scale multiplies its scores and its probabilities, as in the XLA path.

KV write: this module does not write K/V. The step's new K/V go into the pool through the separate
`write_kv` scatter first (one XLA scatter over `T` rows, cheap next to attention), which keeps both
backends on the same pool-update code and lets the pool stay donated through the layer scan. A fused
write would need the kernel to alias the pool as an output (on Triton a write of the whole pool
operand per call); it has not been measured better, so it is not done.

Limits: `page_size` and `head_dim` must be powers of two (>= 16 for `head_dim`): Triton loads need
power-of-two tensor sizes and the pool cannot be padded without copying it. The query side (Bq, G,
rows) is padded here. Float32 inputs use IEEE-precision dots (not TF32) so both backends agree.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int32

from jaxserve.pallas.metadata import AttentionMetadata
from jaxserve.pallas.quantized_kv import is_quantized
from jaxserve.pallas.reference import NO_WINDOW

_MASK_VALUE = -1e30
_MIN_DOT_DIM = 16
_BLOCK_KV_TOKENS = 64
_NUM_WARPS = 4
_NUM_STAGES = 2


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _attention_kernel(
    scale_ref,  # [1] float32 softmax scale
    layer_ref,  # [1]
    window_ref,  # [1] sliding window in tokens (NO_WINDOW: none)
    seq_id_ref,  # [NB]
    q_start_ref,  # [NB]
    num_q_ref,  # [NB]
    page_table_ref,  # [S, P'] (P' a multiple of pages_per_block)
    q_ref,  # [R, D] (this block and kv head)
    k_pool_ref,  # [L, N, KVH, ps, D] (whole pool)
    v_pool_ref,  # [L, N, KVH, ps, D]
    *refs,  # a compressed pool: k_scale_ref, v_scale_ref [L, N, KVH, ps]; then o_ref [R, D]
    group_pad: int,
    pages_per_block: int,
    num_page_blocks: int,
    max_kv_len: int,
    precision,
    logit_softcap: float | None,
):
    from jax.experimental import pallas as pl

    *scale_refs, o_ref = refs
    block = pl.program_id(0)
    kv_head = pl.program_id(1)
    seq = seq_id_ref[block]
    q_start = q_start_ref[block]
    num_q = num_q_ref[block]
    layer = layer_ref[0]
    sm_scale = scale_ref[0]
    window = window_ref[0]

    rows, head_dim = q_ref.shape
    page_size = k_pool_ref.shape[3]
    block_kv = pages_per_block * page_size

    q = q_ref[...]
    # Row r holds query position q_start + r // G'; positions past the page-table width do not exist
    # in the XLA path either, so they are clamped out of the causal bound.
    q_pos = q_start + jnp.arange(rows, dtype=jnp.int32) // group_pad
    q_pos = jnp.minimum(q_pos, max_kv_len - 1)

    def body(i, carry):
        acc, m_prev, l_prev = carry
        pages = page_table_ref[seq, pl.ds(i * pages_per_block, pages_per_block)]  # [PPB]
        k = k_pool_ref[layer, pages, kv_head].reshape(block_kv, head_dim)  # PPB contiguous [ps, D] blocks
        v = v_pool_ref[layer, pages, kv_head].reshape(block_kv, head_dim)
        if scale_refs:  # 8-bit K/V: dots in q's dtype, each key's scale folded into its scores and probabilities
            k, v = k.astype(q.dtype), v.astype(q.dtype)
            k_scale = scale_refs[0][layer, pages, kv_head].reshape(block_kv)
            v_scale = scale_refs[1][layer, pages, kv_head].reshape(block_kv)
        s = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        s = s * sm_scale
        if scale_refs:
            s = s * k_scale[None, :]
        if logit_softcap is not None:
            s = logit_softcap * jnp.tanh(s / logit_softcap)
        kv_pos = i * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        visible = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] > q_pos[:, None] - window)
        s = jnp.where(visible, s, _MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, None])
        l_next = alpha * l_prev + p.sum(axis=1)
        if scale_refs:
            p = p * v_scale[None, :]
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        return alpha[:, None] * acc + pv, m_next, l_next

    kv_end = q_start + num_q
    num_steps = jnp.minimum((kv_end + block_kv - 1) // block_kv, num_page_blocks)
    # windowed: no row needs a key before the first row's window (a step where a row sees no key yet is
    # wiped by the next step's rescale)
    first_step = jnp.minimum(jnp.maximum(q_start - window + 1, 0) // block_kv, num_steps)
    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), _MASK_VALUE, jnp.float32)
    row_sum = jnp.zeros((rows,), jnp.float32)
    acc, m, row_sum = jax.lax.fori_loop(first_step, num_steps, body, (acc, m, row_sum))
    # Padding blocks (num_q == 0) run no step: write zeros rather than 0 / 0.
    row_sum = jnp.where(row_sum == 0.0, 1.0, row_sum)
    o_ref[...] = (acc / row_sum[:, None]).astype(o_ref.dtype)


def _check_shapes(q, k_pool, v_pool, meta: AttentionMetadata) -> None:
    num_tokens, num_heads, head_dim = q.shape
    if k_pool.shape != v_pool.shape or is_quantized(k_pool) != is_quantized(v_pool):
        raise ValueError(f"k_pool {k_pool.shape} and v_pool {v_pool.shape} differ")
    _, _, num_kv_heads, page_size, pool_head_dim = k_pool.shape
    if pool_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != pool head_dim {pool_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if not _is_pow2(page_size):
        raise ValueError(f"pallas attention needs a power-of-two page_size, got {page_size}")
    if not _is_pow2(head_dim) or head_dim < _MIN_DOT_DIM:
        raise ValueError(f"pallas attention needs a power-of-two head_dim >= {_MIN_DOT_DIM}, got {head_dim}")
    if meta.token_out_idx.shape != (num_tokens,):
        raise ValueError(f"meta.token_out_idx {meta.token_out_idx.shape} does not match {num_tokens} tokens")


def ragged_paged_attention(
    q: Float[Array, "T H D"],
    k_pool: Float[Array, "L N KVH ps D"],
    v_pool: Float[Array, "L N KVH ps D"],
    layer: Int32[Array, ""],
    meta: AttentionMetadata,
    sm_scale: float,
    *,
    sliding_window: Int32[Array, ""] | int | None = None,
    logit_softcap: float | None = None,
    interpret: bool | None = None,
) -> Float[Array, "T H D"]:
    """Causal attention of each packed query token over its sequence's KV in layer `layer` of the pool.

    The Pallas twin of `ragged_paged_attention_xla`, with the same arguments and results: q `[T, H, D]`
    packed tokens (`H = KVH * G`), pools `[L, N, KVH, page_size, D]` (page 0 a dummy page), `layer` an
    int32 scalar, `meta` the batch layout (`NB` blocks of `Bq` rows). The K/V of this step's tokens must
    already be written (`write_kv`). Returns `[T, H, D]` in q's dtype; rows of padding tokens hold
    garbage (finite: padding blocks yield zeros). Softmax in float32.

    Args:
        sm_scale: softmax scale (usually `head_dim ** -0.5`); a Python float or a traced scalar.
        sliding_window: keys at positions p - window < kv <= p only (tokens; a traced int32 scalar or
            an int; None: plain causal), as `ragged_paged_attention_xla`.
        logit_softcap: static; scores become `cap * tanh(score / cap)` after scaling (Gemma 2).
        interpret: run the kernel in Pallas interpret mode; None means interpret on CPU and the
            compiled Triton kernel elsewhere. Interpret mode is slow (tests only).

    Raises:
        ValueError: mismatched shapes, `H` not a multiple of `KVH`, or a page_size / head_dim that is
            not a power of two (Triton needs power-of-two loads; use the XLA backend for those).

    Page ids are not range-checked: out-of-range ids clamp in interpret mode and fault on GPU.
    Sources: the layout of vLLM's / SGLang's ragged paged attention; online softmax as in
    FlashAttention (Dao et al. 2022).
    """
    _check_shapes(q, k_pool, v_pool, meta)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    page_size = k_pool.shape[3]
    return _ragged_paged_attention(
        q,
        k_pool,
        v_pool,
        jnp.asarray(layer, jnp.int32).reshape(1),
        meta,
        jnp.asarray(sm_scale, jnp.float32).reshape(1),
        jnp.asarray(NO_WINDOW if sliding_window is None else sliding_window, jnp.int32).reshape(1),
        pages_per_block=max(1, _BLOCK_KV_TOKENS // page_size),
        interpret=bool(interpret),
        logit_softcap=logit_softcap,
    )


def _ragged_paged_attention(
    q, k_pool, v_pool, layer, meta: AttentionMetadata, sm_scale, window, *, pages_per_block, interpret, logit_softcap
):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    num_tokens, num_heads, head_dim = q.shape
    _, _, num_kv_heads, page_size, _ = k_pool.shape
    # a compressed pool (`QuantizedKV`) passes its 8-bit values and its scales as four plain inputs
    k_data, v_data = (k_pool.values(k_pool.data), v_pool.values(v_pool.data)) if is_quantized(k_pool) else (k_pool, v_pool)
    scales = (k_pool.scale, v_pool.scale) if is_quantized(k_pool) else ()
    group = num_heads // num_kv_heads
    num_blocks, block_q = meta.block_token_idx.shape
    num_seqs, pages_per_seq = meta.page_table.shape

    # Never gather more pages per step than the page-table row holds (small buckets), but keep the
    # kv tile at >= 16 tokens for Triton's dot.
    pages_per_block = min(pages_per_block, _next_pow2(pages_per_seq))
    pages_per_block = max(pages_per_block, -(-_MIN_DOT_DIM // page_size))
    num_page_blocks = -(-pages_per_seq // pages_per_block)
    page_table = meta.page_table
    if num_page_blocks * pages_per_block != pages_per_seq:
        page_table = jnp.pad(page_table, ((0, 0), (0, num_page_blocks * pages_per_block - pages_per_seq)))

    block_q_pad = _next_pow2(block_q)
    group_pad = _next_pow2(group)
    rows = max(_MIN_DOT_DIM, block_q_pad * group_pad)

    qb = q[meta.block_token_idx].reshape(num_blocks, block_q, num_kv_heads, group, head_dim)
    qb = jnp.pad(qb, ((0, 0), (0, block_q_pad - block_q), (0, 0), (0, group_pad - group), (0, 0)))
    qb = qb.transpose(0, 2, 1, 3, 4).reshape(num_blocks, num_kv_heads, block_q_pad * group_pad, head_dim)
    qb = jnp.pad(qb, ((0, 0), (0, 0), (0, rows - block_q_pad * group_pad), (0, 0)))

    # The accumulator tile is rows x head_dim float32 in registers: give big tiles more warps.
    num_warps = _NUM_WARPS if rows * head_dim <= 64 * 128 else 2 * _NUM_WARPS
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _attention_kernel,
        group_pad=group_pad,
        pages_per_block=pages_per_block,
        num_page_blocks=num_page_blocks,
        max_kv_len=pages_per_seq * page_size,
        precision=precision,
        logit_softcap=logit_softcap,
    )
    full = lambda shape: pl.BlockSpec(shape, lambda b, h: (0,) * len(shape))  # noqa: E731
    per_program = pl.BlockSpec((None, None, rows, head_dim), lambda b, h: (b, h, 0, 0))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(qb.shape, q.dtype),
        grid=(num_blocks, num_kv_heads),
        in_specs=[
            full(sm_scale.shape),
            full(layer.shape),
            full(window.shape),
            full(meta.block_seq_id.shape),
            full(meta.block_q_start.shape),
            full(meta.block_num_q.shape),
            full(page_table.shape),
            per_program,
            full(k_pool.shape),
            full(v_pool.shape),
            *[full(x.shape) for x in scales],
        ],
        out_specs=per_program,
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=_NUM_STAGES),
        interpret=interpret,
        name="ragged_paged_attention",
    )(sm_scale, layer, window, meta.block_seq_id, meta.block_q_start, meta.block_num_q, page_table, qb, k_data, v_data,
      *scales)

    out = out[:, :, : block_q_pad * group_pad].reshape(num_blocks, num_kv_heads, block_q_pad, group_pad, head_dim)
    out = out[:, :, :block_q, :group].transpose(0, 2, 1, 3, 4).reshape(num_blocks * block_q, num_heads, head_dim)
    return out[meta.token_out_idx]
