"""Decode attention on CPU against the KV pool's layout: token-major, page-major with heads inside, head-major.

Three layouts of the same pool, each read by the same flash loop (chunks of pages, online softmax):
- token-major `[L, N, page_size, KVH, D]` (the engine's layout before issue 20's tenth pass): a chunk's
  gather moves one token's K for every head at a time (KVH x D), then transposes to `[KVH, chunk, D]`;
- page-major with heads inside `[L, N, KVH, page_size, D]` (the engine's layout now,
  `ragged_paged_attention_xla`): the gather moves whole `[page_size, D]` blocks of one head;
- head-major `[L, KVH, N, page_size, D]`: each head's pages gathered as they lie, no transpose.
Timed over all 30 layers of the default model's shapes in one jit, in a pool of --pool-tokens tokens
with each sequence's pages scattered at random (as a busy pool's free list leaves them); outputs are
checked equal. Timed runs of the variants alternate; median of --repeats.

    python scripts/bench_kv_layout.py [--batch-sizes 1 8] [--contexts 256 512 1024] [--pool-tokens 16384] \
        [--chunk-pages 4] [--repeats 11]

Each layout runs with the engine's chunks of 16 pages; page- and head-major also with --chunk-pages.
Only the decode attention is timed: the K/V write, the projections and the sampler are not in it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pallas.metadata import AttentionMetadata, build_attention_metadata
from jaxserve.pallas.reference import ragged_paged_attention_xla

PAGE_SIZE, KV_HEADS, GROUP, HEAD_DIM, LAYERS = 16, 3, 3, 64, 30  # SmolLM2-135M
CHUNK_PAGES = 16  # the engine's KV_BLOCK_TOKENS (256) / PAGE_SIZE
SM_SCALE = HEAD_DIM**-0.5
_MASK = -1e30


def decode_attention(gather_chunk):
    """Decode attention (one query per block) whose chunks come from `gather_chunk(pool, layer, pages)
    -> [KVH, chunk, D]`: the engine's flash loop (chunks of pages, online softmax, stop at the block's
    last key) with the pool's layout left to the gather. Returns `(q [T, H, D], k_pool, v_pool, layer,
    meta, sm_scale, chunk_pages) -> [T, H, D]`."""

    def attention(q, k_pool, v_pool, layer, meta: AttentionMetadata, sm_scale: float, chunk_pages: int = CHUNK_PAGES):
        pages_per_seq = meta.page_table.shape[1]
        per_chunk = min(chunk_pages, pages_per_seq)
        chunk = per_chunk * PAGE_SIZE
        table = jnp.pad(meta.page_table, ((0, 0), (0, -pages_per_seq % per_chunk + per_chunk)))

        def attend_block(b, out):
            seq, token = meta.block_seq_id[b], meta.block_token_idx[b, 0]
            kv_end = meta.block_q_start[b] + 1
            q_blk = q[token].reshape(KV_HEADS, GROUP, HEAD_DIM)

            def kv_step(c, carry):
                run_max, denom, acc = carry
                pages = jax.lax.dynamic_slice(table[seq], (c * per_chunk,), (per_chunk,))
                k, v = gather_chunk(k_pool, layer, pages), gather_chunk(v_pool, layer, pages)
                s = jnp.einsum("kgd,ksd->kgs", q_blk, k, preferred_element_type=jnp.float32) * sm_scale
                s = jnp.where((c * chunk + jnp.arange(chunk))[None, None, :] < kv_end, s, _MASK)
                new_max = jnp.maximum(run_max, s.max(axis=-1))
                p = jnp.exp(s - new_max[..., None])
                rescale = jnp.exp(run_max - new_max)
                pv = jnp.einsum("kgs,ksd->kgd", p, v, preferred_element_type=jnp.float32)
                return new_max, denom * rescale + p.sum(axis=-1), acc * rescale[..., None] + pv

            init = (jnp.full((KV_HEADS, GROUP), _MASK, jnp.float32), jnp.zeros((KV_HEADS, GROUP), jnp.float32),
                    jnp.zeros((KV_HEADS, GROUP, HEAD_DIM), jnp.float32))
            _, denom, acc = jax.lax.fori_loop(0, (kv_end + chunk - 1) // chunk, kv_step, init)
            res = (acc / denom[..., None]).reshape(KV_HEADS * GROUP, HEAD_DIM)
            return out.at[token].set(res.astype(out.dtype))

        return jax.lax.fori_loop(0, jnp.sum(meta.block_num_q > 0), attend_block, jnp.zeros_like(q))

    return attention


# token-major [L, N, ps, KVH, D] (the engine's earlier layout): token rows, then a transpose
token_major_decode_attention = decode_attention(
    lambda pool, layer, pages: pool[layer, pages].reshape(-1, KV_HEADS, HEAD_DIM).transpose(1, 0, 2))
# head-major [L, KVH, N, ps, D]: each head's pages as they lie, no transpose
head_major_decode_attention = decode_attention(
    lambda pool, layer, pages: pool[layer][:, pages].reshape(KV_HEADS, -1, HEAD_DIM))


def all_layers(attention):
    """One jit over LAYERS layers of `attention`; each layer's query depends on the last one's output,
    so XLA cannot share work between layers."""

    def run(q, k_pool, v_pool, meta):
        out = jnp.zeros_like(q)
        for layer in range(LAYERS):
            out = out + attention(q + 1e-3 * out, k_pool, v_pool, jnp.int32(layer), meta, SM_SCALE)
        return out

    return jax.jit(run)


def run_case(batch: int, context: int, pool_tokens: int, repeats: int, rng: np.random.Generator,
             chunk_pages: int) -> dict[str, float]:
    num_pages = pool_tokens // PAGE_SIZE
    pages_each = context // PAGE_SIZE + 1
    if batch * pages_each >= num_pages:
        raise SystemExit(f"--pool-tokens {pool_tokens} cannot hold {batch} sequences of {context} tokens")
    shape = (LAYERS, num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k_tok = jnp.asarray(rng.standard_normal(shape, np.float32))
    v_tok = jnp.asarray(rng.standard_normal(shape, np.float32))
    k_page, v_page = (jnp.transpose(p, (0, 1, 3, 2, 4)) for p in (k_tok, v_tok))  # [L, N, KVH, ps, D]
    k_head, v_head = (jnp.transpose(p, (0, 3, 1, 2, 4)) for p in (k_tok, v_tok))  # [L, KVH, N, ps, D]
    pages = rng.choice(np.arange(1, num_pages), size=batch * pages_each, replace=False)
    tables = [list(pages[i * pages_each:(i + 1) * pages_each]) for i in range(batch)]
    pages_per_seq = 1 << (pages_each - 1).bit_length()
    meta = build_attention_metadata([1] * batch, [context] * batch, tables, num_tokens=batch, num_seqs=batch,
                                    pages_per_seq=pages_per_seq, block_q=1).to_device()
    q = jnp.asarray(rng.standard_normal((batch, KV_HEADS * GROUP, HEAD_DIM), np.float32))
    kv_block = chunk_pages * PAGE_SIZE
    variants = {
        "token": (all_layers(token_major_decode_attention), k_tok, v_tok),
        "page": (all_layers(ragged_paged_attention_xla), k_page, v_page),
        "page_small": (all_layers(functools.partial(ragged_paged_attention_xla, kv_block=kv_block)), k_page, v_page),
        "head": (all_layers(head_major_decode_attention), k_head, v_head),
        "head_small": (all_layers(functools.partial(head_major_decode_attention, chunk_pages=chunk_pages)), k_head, v_head),
    }
    want = np.asarray(variants["token"][0](q, k_tok, v_tok, meta))
    for fn, k, v in variants.values():
        np.testing.assert_allclose(np.asarray(fn(q, k, v, meta)), want, rtol=1e-5, atol=1e-5)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (fn, k, v) in variants.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(q, k, v, meta))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--pool-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-pages", type=int, default=4, help="the smaller chunk page- and head-major are also timed with")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"jax {jax.__version__} on {jax.default_backend()}; decode attention, {LAYERS} layers in one jit, "
          f"pool of {args.pool_tokens} tokens, pages at random; median of {args.repeats}\n")
    n, small = CHUNK_PAGES, args.chunk_pages
    print(f"| decode batch | tokens of KV each | token-major, {n}-page chunks: the earlier engine (ms) | page-major, {n}: "
          f"the engine now | page-major, {small} | head-major, {n} | head-major, {small} | engine now / earlier |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in args.batch_sizes:
        for context in args.contexts:
            t = run_case(batch, context, args.pool_tokens, args.repeats, rng, args.chunk_pages)
            cells = " | ".join(f"{t[name]:.2f}" for name in ("token", "page", "page_small", "head", "head_small"))
            print(f"| {batch} | {context} | {cells} | {t['token'] / t['page']:.2f}x faster |", flush=True)


if __name__ == "__main__":
    main()
