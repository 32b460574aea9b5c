"""Speculative verification against a decode step, on the default model.

One invocation, one process, runs alternating: the batch-1 decode step (1 token after --prompt-len
cached ones) and verification steps of 1 + K tokens (the last token + a K-token draft, logits at all
1 + K rows: what a speculative step runs) for each K of --draft-tokens. Each attention variant of
--attention is its own model runner over the same weights; their timed runs alternate, so drift in
the machine's speed hits them alike:

    xla           `jaxserve.pallas.reference.ragged_paged_attention_xla`, what the engine runs: the loop
                  over query blocks stops after the batch's real ones.
    padded-map    the same online softmax mapped over every query block of the bucket, padding blocks
                  included (the XLA path before the loop stopped early; kept here as the baseline).

The break-even accept length of K is verify(K) / decode: speculation pays when the mean tokens
emitted per verification (`spec_accept_length`) exceeds it. A prefill step of the prompt's first
--prefill-len tokens (no cached prefix; it rewrites the same K/V) is timed beside them, so a change
that makes verification cheaper shows what it does to prefill in the same invocation.

    python -m benchmarks.speculative.bench_verify [--draft-tokens 2 4 8 12 15] [--attention xla padded-map]
                                   [--prefill-len 128] [--repeats 10] [--stat min|median] [--output-file F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.model import bench_model
from jaxserve.cache.kv_pool import PoolShape
from jaxserve.core.batch import BatchEntry
from jaxserve.model.loader import load_model
from jaxserve.pallas.reference import _MASK_VALUE, KV_BLOCK_TOKENS, ragged_paged_attention_xla
from jaxserve.runner.model_runner import ModelRunner


def padded_map_attention(q, k_pool, v_pool, layer, meta, sm_scale, kv_block=KV_BLOCK_TOKENS):
    """Baseline: `ragged_paged_attention_xla`'s math under a `lax.map` over all NB query blocks, each
    padding block paying its setup, and outputs gathered through `token_out_idx`."""
    _, num_heads, head_dim = q.shape
    _, _, num_kv_heads, page_size, _ = k_pool.shape
    group = num_heads // num_kv_heads
    num_blocks, block_q = meta.block_token_idx.shape
    pages_per_seq = meta.page_table.shape[1]
    pages_per_chunk = max(1, min(kv_block // page_size, pages_per_seq))
    chunk = pages_per_chunk * page_size
    page_table = jnp.pad(meta.page_table, ((0, 0), (0, -pages_per_seq % pages_per_chunk)))
    qb = q[meta.block_token_idx].reshape(num_blocks, block_q, num_kv_heads, group, head_dim)
    qb = qb.transpose(0, 2, 3, 1, 4).reshape(num_blocks, num_kv_heads, group * block_q, head_dim)
    row_offset = jnp.tile(jnp.arange(block_q, dtype=jnp.int32), group)
    rows = group * block_q

    def attend_block(args):
        q_blk, seq, q_start, num_q = args
        q_pos = q_start + row_offset
        num_chunks = (jnp.where(num_q > 0, q_start + num_q, 0) + chunk - 1) // chunk

        def kv_step(c, carry):
            run_max, denom, acc = carry
            pages = jax.lax.dynamic_slice(page_table[seq], (c * pages_per_chunk,), (pages_per_chunk,))
            k = k_pool[layer, pages].transpose(0, 2, 1, 3).reshape(chunk, num_kv_heads, head_dim)
            v = v_pool[layer, pages].transpose(0, 2, 1, 3).reshape(chunk, num_kv_heads, head_dim)
            s = jnp.einsum("krd,skd->krs", q_blk, k, preferred_element_type=jnp.float32) * sm_scale
            kv_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            s = jnp.where(kv_pos[None, None, :] <= q_pos[None, :, None], s, _MASK_VALUE)
            new_max = jnp.maximum(run_max, s.max(axis=-1))
            p = jnp.exp(s - new_max[..., None])
            rescale = jnp.exp(run_max - new_max)
            pv = jnp.einsum("krs,skd->krd", p, v, preferred_element_type=jnp.float32)
            return new_max, denom * rescale + p.sum(axis=-1), acc * rescale[..., None] + pv

        init = (jnp.full((num_kv_heads, rows), _MASK_VALUE, jnp.float32), jnp.zeros((num_kv_heads, rows), jnp.float32),
                jnp.zeros((num_kv_heads, rows, head_dim), jnp.float32))
        _, denom, acc = jax.lax.fori_loop(0, num_chunks, kv_step, init)
        return acc / jnp.maximum(denom, 1e-30)[..., None]

    out = jax.lax.map(attend_block, (qb, meta.block_seq_id, meta.block_q_start, meta.block_num_q))
    out = out.reshape(num_blocks, num_kv_heads, group, block_q, head_dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(num_blocks * block_q, num_heads, head_dim)[meta.token_out_idx].astype(q.dtype)


ATTENTION = {"xla": ragged_paged_attention_xla, "padded-map": padded_map_attention}


def runner_with(config, params, attn_fn, max_seqs: int, context: int) -> ModelRunner:
    """`bench_model.jax_runner`'s host-loop runner with another attention function; the extend buckets
    start at 2 tokens, as with `--speculative-algorithm`."""
    ps = bench_model.PAGE_SIZE
    shape = PoolShape(config.num_layers, max_seqs * (context // ps + 1) + 1, ps, config.num_kv_heads, config.head_dim,
                      "float32").shape
    return ModelRunner(config, params, jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
                       attn_fn=attn_fn, max_running_requests=max_seqs, max_extend_tokens=context,
                       context_length=context + ps, layer_loop="host", min_extend_tokens=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 4, 8, 12, 15])
    ap.add_argument("--attention", nargs="+", default=list(ATTENTION), choices=list(ATTENTION))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--prefill-len", type=int, default=128, help="tokens of the timed prefill step (0: none)")
    ap.add_argument("--max-seqs", type=int, default=64, help="sequence bucket limit (the server's CPU default)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    ap.add_argument("--output-file", default=None, help="write the table as JSON rows")
    args = ap.parse_args()

    config, params = load_model("default", "float32")
    n = args.prompt_len
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, config.vocab_size, size=n)]
    pages = list(range(1, n // bench_model.PAGE_SIZE + 3))
    runners = {name: runner_with(config, params, ATTENTION[name], args.max_seqs, n + 2 * bench_model.PAGE_SIZE)
               for name in args.attention}
    for r in runners.values():
        r.forward([BatchEntry(prompt, 0, pages)])
    stat = min if args.stat == "min" else statistics.median

    def step(runner, tokens, num_logits, prefix_len):
        entries = [BatchEntry(tokens, prefix_len, pages, num_logits=num_logits)]
        return lambda: runner.forward(entries).block_until_ready()

    # (name, new tokens, logits rows, cached tokens before them)
    cases = [("decode", [prompt[-1]], 1, n)] + [(f"verify K={k}", prompt[-1 - k:], k + 1, n) for k in args.draft_tokens]
    if args.prefill_len:
        cases.append((f"prefill {args.prefill_len}", prompt[: args.prefill_len], 1, 0))
    first = next(iter(runners.values()))
    outs = {name: np.asarray(r.forward([BatchEntry(prompt[-13:], n, pages, num_logits=13)])) for name, r in runners.items()}
    for name, o in outs.items():  # every variant computes the same logits
        np.testing.assert_allclose(o[:13], outs[next(iter(outs))][:13], rtol=2e-4, atol=2e-4)
    fns = {(att, name): step(r, toks, nl, pre) for att, r in runners.items() for name, toks, nl, pre in cases}
    times = bench_model.timed_alternating(fns, args.repeats, stat)
    print(f"\njax {jax.__version__} on {jax.default_backend()}; batch 1, {n} tokens cached; {args.stat} of {args.repeats}; "
          f"sequence bucket limit {first.max_seqs}\n")
    print("| step | " + " | ".join(f"{a} (ms)" for a in runners) + " | "
          + " | ".join(f"{a} / its decode" for a in runners) + " |")
    print("|---" * (1 + 2 * len(runners)) + "|")
    rows = []
    for name, *_ in cases:
        ms = [times[(a, name)] * 1e3 for a in runners]
        rel = [times[(a, name)] / times[(a, "decode")] for a in runners]
        print(f"| {name} | " + " | ".join(f"{m:.1f}" for m in ms) + " | " + " | ".join(f"{x:.2f}" for x in rel) + " |")
        rows.append({"step": name, **{f"{a}_ms": m for a, m in zip(runners, ms)}})
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
