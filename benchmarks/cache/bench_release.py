"""KV release policy benchmarks, each against the plain LRU radix cache in the same run.

    working-set  a working set twice the device pool (within device + host): cache hit rate, TTFT and
                 throughput with soft release + recall (--enable-hierarchical-cache) vs plain eviction;
                 recall latency seen by the policy; decode step time with the policy on vs off.
    short-tail   80% of requests share a system prompt (32 tokens, and 40 to show a partly matched
                 page), 20% random; output 64; page_size 16: cached tokens, recomputed tokens and
                 block utilization with and without coalescing (--enable-auto-merge).
    recall       host <-> device page copy latency per MB through the model runner's jitted,
                 donated page updates (the default model's page layout).

    python -m benchmarks.cache.bench_release [--model default|tiny|PATH] [--only working-set short-tail recall]

`--model tiny` builds a 2-layer random Llama (needs torch + transformers) for a quick run; short-tail
always uses it (its numbers are cache accounting, independent of the model). Times are wall-clock on
this machine: on a shared CPU, compare the two columns of one run, not runs with each other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import numpy as np

from jaxserve.engine.engine import Engine

TINY_LLAMA = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.2,
)


def tiny_model_dir() -> str:
    import torch
    import transformers

    from jaxserve.model.tokenizer import load_tokenizer

    path = tempfile.mkdtemp(prefix="tiny_llama_")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY_LLAMA)
    config.architectures = ["LlamaForCausalLM"]
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    load_tokenizer("default").save_pretrained(path)
    return path


def run_closed_loop(engine: Engine, prompts, params, concurrency: int, stats_every_step: bool = False):
    """Keep `concurrency` requests in flight until all `prompts` finish.

    Returns (metas, wall seconds, decode step times in seconds, per-step radix cache stats).
    """
    pending = list(zip(prompts, params))
    in_flight, metas, decode_times, step_stats = 0, [], [], []
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            prompt, p = pending.pop(0)
            engine.add_request(prompt, p)
            in_flight += 1
        decodes_before = engine.stats.num_decode_steps
        ts = time.perf_counter()
        outs = engine.step()
        if engine.stats.num_decode_steps > decodes_before:
            decode_times.append(time.perf_counter() - ts)
        if stats_every_step:
            step_stats.append(engine.radix_cache_stats())
        for out in outs:
            if out.finished:
                metas.append(out.meta)
                in_flight -= 1
    return metas, time.perf_counter() - t0, decode_times, step_stats


def random_tokens(rng, n: int) -> list[int]:
    return list(map(int, rng.integers(100, 40000, n)))


# working set


def bench_working_set(model: str, args) -> dict:
    rng = np.random.default_rng(0)
    pool = args.pool_tokens
    num_docs = 2 * pool // args.doc_len
    docs = [random_tokens(rng, args.doc_len) for _ in range(num_docs)]
    prompts = [doc + random_tokens(rng, 8) for _ in range(args.rounds) for doc in docs]  # round robin
    params = [{"max_new_tokens": args.ws_output_len, "temperature": 0, "ignore_eos": True}] * len(prompts)
    decode_prompts = [random_tokens(rng, 64) for _ in range(4 * args.concurrency)]
    decode_params = [{"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}] * len(decode_prompts)
    common = dict(
        model_path=model, max_total_tokens=pool, page_size=16, context_length=1024, chunked_prefill_size=512,
        max_running_requests=args.concurrency, disable_precompile=True,
    )
    configs = {
        "plain LRU": {},
        "soft release + recall": dict(enable_hierarchical_cache=True, hicache_ratio=2.0),
    }
    rows = {}
    for name, extra in configs.items():
        engine = Engine(**common, **extra)
        run_closed_loop(engine, prompts, params, args.concurrency)  # the same pass once, to compile
        engine.flush_cache()
        policy = engine.cache.policy
        engine.cache.policy = engine.cache.policy = policy.__class__(
            policy.config, engine.cache.tree, engine.cache.allocator, engine.runner.pool_shape
        )  # fresh counters
        engine.cache.policy.attach_io(engine.runner)
        compiles = engine.runner.num_compiles_after_warmup
        metas, wall, _, _ = run_closed_loop(engine, prompts, params, args.concurrency)
        compiles = engine.runner.num_compiles_after_warmup - compiles
        prompt_tokens = sum(m.prompt_tokens for m in metas)
        cached = sum(m.cached_tokens for m in metas)
        stats = engine.radix_cache_stats()
        lat = stats.recall_latency_s
        mb = stats.recalled_bytes / 1e6
        # decode step time, with aggressive proactive soft release (threshold 0) in the policy-on run
        if extra:
            engine.cache.policy.config = _aggressive(engine.cache.policy.config)
        for _ in range(2):  # the first pass compiles
            engine.flush_cache()
            _, _, decode_times, _ = run_closed_loop(engine, decode_prompts, decode_params, args.concurrency)
        rows[name] = dict(
            requests=len(metas),
            hit_rate=cached / prompt_tokens,
            host_hit_rate=stats.host_hit_tokens / prompt_tokens,
            ttft_mean_ms=1e3 * statistics.mean(m.ttft for m in metas),
            ttft_p50_ms=1e3 * statistics.median(m.ttft for m in metas),
            output_tok_s=sum(m.completion_tokens for m in metas) / wall,
            total_tok_s=(prompt_tokens + sum(m.completion_tokens for m in metas)) / wall,
            wall_s=wall,
            compiles_while_measured=compiles,
            evictions=stats.eviction_count,
            soft_freed_mb=stats.soft_freed_bytes / 1e6,
            recalled_mb=mb,
            recalls=stats.num_recalls,
            recall_issue_ms_median=1e3 * statistics.median(lat) if lat else None,
            recall_issue_ms_per_mb=1e3 * sum(lat) / mb if mb else None,
            decode_step_ms_median=1e3 * statistics.median(decode_times),
            decode_step_ms_mean=1e3 * statistics.mean(decode_times),
            decode_steps=len(decode_times),
        )
        del engine
    return dict(pool_tokens=pool, num_docs=num_docs, doc_len=args.doc_len, rounds=args.rounds,
                concurrency=args.concurrency, output_len=args.ws_output_len, rows=rows)


def _aggressive(config):
    import dataclasses

    return dataclasses.replace(
        config, soft_free_threshold_s=0.0, sample_period_s=0.0, evict_threshold=0.0,
        conservative_batch_size=0, aggressive_batch_size=0,
    )


# short tail


def bench_short_tail(model: str, args) -> dict:
    results = {}
    for system_len in (32, 40):
        rng = np.random.default_rng(1)
        system = random_tokens(rng, system_len)
        prompts = []
        for _ in range(args.short_tail_requests):
            if rng.random() < 0.8:
                prompts.append(system + random_tokens(rng, int(rng.integers(4, 25))))
            else:
                prompts.append(random_tokens(rng, int(rng.integers(20, 57))))
        params = [{"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}] * len(prompts)
        rows = {}
        for name, extra in {"plain": {}, "coalescing": dict(enable_auto_merge=True)}.items():
            engine = Engine(
                model_path=model, max_total_tokens=16384, page_size=16, context_length=256, chunked_prefill_size=256,
                max_running_requests=16, disable_precompile=True, **extra,
            )
            metas, wall, _, step_stats = run_closed_loop(engine, prompts, params, 16, stats_every_step=True)
            prompt_tokens = sum(m.prompt_tokens for m in metas)
            cached = sum(m.cached_tokens for m in metas)
            final = engine.radix_cache_stats()
            rows[name] = dict(
                cached_tokens=cached,
                recomputed_tokens=prompt_tokens - cached,
                prompt_tokens=prompt_tokens,
                cow_tokens=final.cow_hit_tokens,
                block_utilization_mean=statistics.mean(s.block_utilization for s in step_stats if s.num_blocks_used),
                blocks_used_max=max(s.num_blocks_used for s in step_stats),
                merges=final.merge_count,
                nodes_end=final.nodes_total,
            )
        results[f"system prompt {system_len} tokens"] = rows
    return dict(requests=args.short_tail_requests, rows=results)


# recall latency


def bench_recall(model: str, args) -> dict:
    engine = Engine(model_path=model, max_total_tokens=8192, page_size=16, disable_precompile=True)
    runner = engine.runner
    rows = []
    page_bytes = engine.runner.pool_shape.bytes_per_token * 16
    rng = np.random.default_rng(2)
    for num_pages in (1, 4, 16, 64):
        pages = np.arange(1, num_pages + 1, dtype=np.int32)
        shape = (runner.k_pool.shape[0], num_pages, *runner.k_pool.shape[2:])
        k = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        writes, reads = [], []
        for i in range(6):
            t0 = time.perf_counter()
            runner.write_pages(pages, k, v)
            jax.block_until_ready((runner.k_pool, runner.v_pool))
            t1 = time.perf_counter()
            got_k, _ = runner.read_pages(pages).result()
            t2 = time.perf_counter()
            if i:  # the first run compiles
                writes.append(t1 - t0)
                reads.append(t2 - t1)
        assert np.array_equal(got_k[:, :num_pages], k)
        mb = num_pages * page_bytes / 1e6
        rows.append(dict(
            pages=num_pages, mb=mb,
            host_to_device_ms=1e3 * statistics.median(writes),
            host_to_device_ms_per_mb=1e3 * statistics.median(writes) / mb,
            device_to_host_ms=1e3 * statistics.median(reads),
            device_to_host_ms_per_mb=1e3 * statistics.median(reads) / mb,
        ))
    return dict(page_bytes=page_bytes, device=str(jax.devices()[0]), rows=rows)


def print_table(title: str, rows: dict | list) -> None:
    print(f"\n### {title}\n")
    if isinstance(rows, dict):
        names = list(rows)
        keys = list(rows[names[0]])
        print("| metric | " + " | ".join(names) + " |")
        print("| --- " * (len(names) + 1) + "|")
        for key in keys:
            print(f"| {key} | " + " | ".join(_fmt(rows[n][key]) for n in names) + " |")
    else:
        keys = list(rows[0])
        print("| " + " | ".join(keys) + " |")
        print("| --- " * len(keys) + "|")
        for row in rows:
            print("| " + " | ".join(_fmt(row[k]) for k in keys) + " |")


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 100 else f"{x:.1f}"
    return "-" if x is None else str(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="default | tiny | a model path")
    ap.add_argument("--only", nargs="+", default=["working-set", "short-tail", "recall"])
    ap.add_argument("--pool-tokens", type=int, default=2048, help="device pool for working-set (tokens)")
    ap.add_argument("--doc-len", type=int, default=248, help="shared document length in working-set (tokens)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the documents in working-set")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--ws-output-len", type=int, default=8)
    ap.add_argument("--short-tail-requests", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    model = tiny_model_dir() if args.model == "tiny" else args.model
    tiny = tiny_model_dir() if "short-tail" in args.only and args.model != "tiny" else model
    results = {}
    if "working-set" in args.only:
        results["working_set"] = r = bench_working_set(model, args)
        print_table(
            f"Working set 2x the device pool ({r['num_docs']} documents of {r['doc_len']}+8 tokens, pool "
            f"{r['pool_tokens']} tokens, host tier 2x, {r['rounds']} round-robin passes, concurrency "
            f"{r['concurrency']}, output {r['output_len']}; model {args.model})", r["rows"],
        )
    if "short-tail" in args.only:
        results["short_tail"] = r = bench_short_tail(tiny, args)
        for title, rows in r["rows"].items():
            print_table(f"Short-tail traffic, {title}, page_size 16, {r['requests']} requests (tiny model)", rows)
    if "recall" in args.only:
        results["recall"] = r = bench_recall(model, args)
        print_table(f"Host <-> device page copies ({r['page_bytes']} bytes per page, {r['device']}; model {args.model})", r["rows"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
