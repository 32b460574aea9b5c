"""Micro-benchmark of the radix prefix cache: match_prefix + insert per request.

Workload: `--num-requests` requests, each a random one of `--num-prefixes` shared prefixes
(`--prefix-len` tokens) followed by a unique suffix (`--suffix-len` tokens). Per request the cache is
used as the engine uses it: match the prompt, allocate pages for the unmatched part, insert the whole
prompt, free the duplicate pages. Every `--evict-every` requests the tree is evicted back under
`--capacity-tokens`. Only match + insert are in the reported ops/s; eviction is timed separately.

    python -m benchmarks.cache.bench_radix
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from jaxserve.cache.radix_tree import RadixCache


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=100_000)
    parser.add_argument("--num-prefixes", type=int, default=1_000)
    parser.add_argument("--prefix-len", type=int, default=256, help="tokens")
    parser.add_argument("--suffix-len", type=int, default=64, help="tokens")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--capacity-tokens", type=int, default=1 << 19, help="tree size kept after evict")
    parser.add_argument("--evict-every", type=int, default=1_000, help="requests between evictions")
    parser.add_argument("--vocab-size", type=int, default=32_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.prefix_len % args.page_size or args.suffix_len % args.page_size:
        parser.error("--prefix-len and --suffix-len must be multiples of --page-size")

    rng = np.random.default_rng(args.seed)
    prefixes = rng.integers(0, args.vocab_size, (args.num_prefixes, args.prefix_len)).tolist()
    cache = RadixCache(args.page_size)
    # Room for the bounded tree plus everything inserted between two evictions.
    num_tokens_between_evicts = args.evict_every * (args.prefix_len + args.suffix_len)
    num_pages_total = (args.capacity_tokens + num_tokens_between_evicts) // args.page_size
    free_pages = list(range(num_pages_total, 0, -1))  # page 0 is the pool's dummy page

    match_s = insert_s = evict_s = 0.0
    num_cached_tokens = num_prompt_tokens = num_evicted_tokens = 0
    chunk = args.evict_every
    for start in range(0, args.num_requests, chunk):
        num_chunk = min(chunk, args.num_requests - start)
        prefix_ids = rng.integers(0, args.num_prefixes, num_chunk).tolist()
        suffixes = rng.integers(0, args.vocab_size, (num_chunk, args.suffix_len)).tolist()
        for prefix_id, suffix in zip(prefix_ids, suffixes):
            key = prefixes[prefix_id] + suffix

            t0 = time.perf_counter()
            match = cache.match_prefix(key)
            t1 = time.perf_counter()
            num_new_pages = (len(key) - match.num_tokens) // args.page_size
            split = len(free_pages) - num_new_pages
            new_pages = free_pages[split:]
            del free_pages[split:]
            pages = np.concatenate([match.pages, np.asarray(new_pages, dtype=np.int32)])
            t2 = time.perf_counter()
            result = cache.insert(key, pages)
            t3 = time.perf_counter()
            free_pages.extend(result.duplicate_pages.tolist())

            match_s += t1 - t0
            insert_s += t3 - t2
            num_cached_tokens += match.num_tokens
            num_prompt_tokens += len(key)

        t0 = time.perf_counter()
        if cache.total_size() > args.capacity_tokens:
            freed = cache.evict(cache.total_size() - args.capacity_tokens)
            free_pages.extend(freed.tolist())
            num_evicted_tokens += len(freed) * args.page_size
        evict_s += time.perf_counter() - t0

    cache.check_integrity()
    num_ops = args.num_requests
    print(
        f"workload: {num_ops} requests, {args.num_prefixes} prefixes x {args.prefix_len} tokens + "
        f"{args.suffix_len}-token unique suffix, page_size {args.page_size}, "
        f"capacity {args.capacity_tokens} tokens (evict every {args.evict_every} requests)"
    )
    print(
        f"match+insert: {num_ops / (match_s + insert_s):,.0f} ops/s, "
        f"{(match_s + insert_s) / num_ops * 1e6:.2f} us per match+insert "
        f"(match {match_s / num_ops * 1e6:.2f} us, insert {insert_s / num_ops * 1e6:.2f} us)"
    )
    num_evicted_pages = max(num_evicted_tokens // args.page_size, 1)
    print(
        f"evict: {evict_s * 1e3:.1f} ms total for {num_evicted_tokens} tokens "
        f"({evict_s / num_evicted_pages * 1e6:.2f} us per page)"
    )
    print(
        f"cache hit rate: {num_cached_tokens / num_prompt_tokens:.3f} of prompt tokens; "
        f"tree holds {cache.total_size()} tokens"
    )
    print(f"host load average (1 min): {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
