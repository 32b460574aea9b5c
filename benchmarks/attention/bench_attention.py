"""The XLA attention path on CPU: time per layer for prefill, extend and decode shapes, against two
baselines run in the same invocation.

    python -m benchmarks.attention.bench_attention [--repeats 7]

Columns:
    flash loop   `ragged_paged_attention_xla`: per query block, a loop over blocks of its own keys that
                 stops at the causal end (what the engine runs).
    block gather the formulation it replaced: every query block gathers its sequence's whole KV bucket
                 from the pool, then one masked softmax over it.
    dense        causal attention over contiguous K/V with no pool (prefills only): the cost of the math
                 alone, a lower bound for a full-square implementation.

Shapes are SmolLM2-135M's (9 query heads, 3 kv heads, head dim 64), page size 16, float32, one layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pallas.metadata import AttentionMetadata, build_attention_metadata
from jaxserve.pallas.reference import dense_causal_attention, ragged_paged_attention_xla

PAGE_SIZE, KV_HEADS, GROUP, HEAD_DIM = 16, 3, 3, 64
SM_SCALE = HEAD_DIM**-0.5


def block_gather_attention(q, k_pool, v_pool, layer, meta: AttentionMetadata, sm_scale):
    """Baseline: each query block materializes its sequence's whole KV bucket, then a masked softmax."""
    num_blocks, block_q = meta.block_token_idx.shape
    kv_len = meta.page_table.shape[1] * PAGE_SIZE
    qb = q[meta.block_token_idx].reshape(num_blocks, block_q, KV_HEADS, GROUP, HEAD_DIM)
    pages = meta.page_table[meta.block_seq_id]
    # pages [NB, P, KVH, ps, D] -> tokens [NB, P * ps, KVH, D]
    k = k_pool[layer, pages].transpose(0, 1, 3, 2, 4).reshape(num_blocks, kv_len, KV_HEADS, HEAD_DIM)
    v = v_pool[layer, pages].transpose(0, 1, 3, 2, 4).reshape(num_blocks, kv_len, KV_HEADS, HEAD_DIM)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qb, k) * sm_scale
    q_pos = meta.block_q_start[:, None] + jnp.arange(block_q)[None, :]
    mask = jnp.arange(kv_len)[None, None, :] <= q_pos[:, :, None]
    p = jax.nn.softmax(jnp.where(mask[:, None, None], s, -1e30), axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v).reshape(num_blocks * block_q, KV_HEADS * GROUP, HEAD_DIM)
    return out[meta.token_out_idx]


def median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run_case(name, extend_lens, prefix_lens, num_tokens, num_seqs, block_q, repeats, rng):
    kv_lens = [e + p for e, p in zip(extend_lens, prefix_lens)]
    pages_per_seq = 1 << (max(kv_lens) // PAGE_SIZE).bit_length()
    num_pages = pages_per_seq * len(kv_lens) + 1
    shape = (1, num_pages, KV_HEADS, PAGE_SIZE, HEAD_DIM)
    k_pool = jnp.asarray(rng.standard_normal(shape, np.float32))
    v_pool = jnp.asarray(rng.standard_normal(shape, np.float32))
    q = jnp.asarray(rng.standard_normal((num_tokens, KV_HEADS * GROUP, HEAD_DIM), np.float32))
    tables = [list(range(1 + i * pages_per_seq, 1 + i * pages_per_seq + -(-n // PAGE_SIZE))) for i, n in enumerate(kv_lens)]
    meta = build_attention_metadata(
        extend_lens, prefix_lens, tables, num_tokens=num_tokens, num_seqs=num_seqs,
        pages_per_seq=pages_per_seq, block_q=block_q,
    ).to_device()
    real = sum(extend_lens)
    flash = jax.jit(lambda *a: ragged_paged_attention_xla(*a, SM_SCALE))
    gather = jax.jit(lambda *a: block_gather_attention(*a, SM_SCALE))
    ours = flash(q, k_pool, v_pool, 0, meta)[:real]
    base = gather(q, k_pool, v_pool, 0, meta)[:real]
    np.testing.assert_allclose(np.asarray(ours), np.asarray(base), rtol=1e-4, atol=1e-4)
    t_flash = median_ms(flash, q, k_pool, v_pool, 0, meta, repeats=repeats)
    t_gather = median_ms(gather, q, k_pool, v_pool, 0, meta, repeats=repeats)
    t_dense = None
    if len(extend_lens) == 1 and prefix_lens[0] == 0:
        n = extend_lens[0]
        k = k_pool[0].transpose(0, 2, 1, 3).reshape(-1, KV_HEADS, HEAD_DIM)[PAGE_SIZE : PAGE_SIZE + n]
        v = v_pool[0].transpose(0, 2, 1, 3).reshape(-1, KV_HEADS, HEAD_DIM)[PAGE_SIZE : PAGE_SIZE + n]
        dense = jax.jit(lambda q, k, v: dense_causal_attention(q, k, v, SM_SCALE))
        t_dense = median_ms(dense, q[:n], k, v, repeats=repeats)
    return name, t_flash, t_gather, t_dense


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cases = [
        # name, extend lens, prefix lens, bucket T, bucket S, Bq (the engine's buckets: S = min(T, 32))
        ("prefill 256 tokens", [256], [0], 256, 32, 16),
        ("prefill 1024 tokens", [1024], [0], 1024, 32, 16),
        ("extend 64 after a 1024-token prefix", [64], [1024], 64, 32, 16),
        ("4 extends of 16 after 1024-token prefixes", [16] * 4, [1024] * 4, 64, 32, 16),
        ("decode, batch 1, 1000 tokens of KV", [1], [999], 1, 1, 1),
        ("decode, batch 32, 200 tokens of KV", [1] * 32, [199] * 32, 32, 32, 1),
        ("decode, batch 32, 1000 tokens of KV", [1] * 32, [999] * 32, 32, 32, 1),
    ]
    rows = [run_case(*c, args.repeats, rng) for c in cases]
    print(f"\njax {jax.__version__} on {jax.default_backend()}; ms per layer, median of {args.repeats}\n")
    print("| shape | flash loop (ms) | block gather (ms) | speed-up | dense, no pool (ms) |")
    print("|---|---|---|---|---|")
    for name, t_flash, t_gather, t_dense in rows:
        dense = f"{t_dense:.2f}" if t_dense is not None else "-"
        print(f"| {name} | {t_flash:.2f} | {t_gather:.2f} | {t_gather / t_flash:.2f}x | {dense} |")


if __name__ == "__main__":
    main()
