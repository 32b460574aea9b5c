"""Host cost of the cross-request n-gram store (`jaxserve/speculative/ngram_store.py`).

Fills an `NgramStore` of --capacity tokens past full (requests of --request-len random token ids
over a 49,152-token vocabulary, SmolLM2's), then times `match` (a hit: a query ending in a stored
window, and a miss) and `feed` of one more request. Prints microseconds per call (median of
--repeats batches of 100 calls).

    python -m benchmarks.speculative.bench_ngram_store --capacity 10000000
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxserve.speculative.ngram_store import NgramStore


def per_call_us(fn, repeats: int, calls: int = 100) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacity", type=int, default=10_000_000)
    p.add_argument("--request-len", type=int, default=600, help="tokens per fed request (prompt + output)")
    p.add_argument("--num-draft", type=int, default=15)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)

    rng = np.random.default_rng(0)
    store = NgramStore(args.capacity)
    t0 = time.perf_counter()
    fed = 0
    while fed < args.capacity * 1.1:
        store.feed(rng.integers(0, 49152, args.request_len))
        fed += args.request_len + 1
    fill_s = time.perf_counter() - t0
    last = rng.integers(0, 49152, args.request_len)
    store.feed(last)
    hit = list(rng.integers(0, 49152, 300)) + list(last[100:120])
    miss = list(rng.integers(0, 49152, 320))
    assert store.match(hit, args.num_draft).draft == list(last[120:120 + args.num_draft])
    print(f"capacity {args.capacity} tokens, {store.num_tokens} held, filled in {fill_s:.1f} s "
          f"({len(store._tables[2])} slots per table)")
    print(f"match, hit:  {per_call_us(lambda: store.match(hit, args.num_draft), args.repeats):.1f} us")
    print(f"match, miss: {per_call_us(lambda: store.match(miss, args.num_draft), args.repeats):.1f} us")
    new = rng.integers(0, 49152, args.request_len)
    print(f"feed of {args.request_len} tokens: {per_call_us(lambda: store.feed(new), args.repeats):.1f} us")


if __name__ == "__main__":
    main()
