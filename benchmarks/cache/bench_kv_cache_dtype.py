"""A compressed KV pool (`--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2`) against the float pool (`auto`): tokens per
budget and decode step time.

Each dtype gets its own engine in this process on `--model` with the CPU's default pool budget (min(1.5 GiB,
10% of the available RAM), the same for every dtype within a run): reported are the pool's tokens and bytes,
then `--batch` requests of `--context` random prompt tokens decode `--new-tokens` greedy tokens together and
the median decode step is timed (attention reads every request's context each step, so this is where 8-bit
pages cost or save). `--rounds` runs every dtype that many times, taking turns, and reports the median of
each one's medians (an engine's first steps and a VM's drift weigh on one run). Log-likelihood is
`benchmarks/quant/eval_loglik.py --kv-cache-dtypes ...`.

    python -m benchmarks.cache.bench_kv_cache_dtype --context 2048 --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from benchmarks.model.bench_sampler import cpu_flags, model_path


def run_dtype(path: str, kv_cache_dtype: str, args) -> dict:
    from jaxserve.engine.engine import Engine

    engine = Engine(model_path=path, kv_cache_dtype=kv_cache_dtype, chunked_prefill_size=args.chunk,
                    context_length=args.context + args.new_tokens, max_running_requests=args.batch,
                    disable_radix_cache=True, prefill_decode_itl_ratio=0)  # admit every prompt at once
    shape = engine.runner.pool_shape
    rng = np.random.default_rng(0)
    vocab = engine.runner.model_config.vocab_size
    for _ in range(args.batch):
        prompt = [int(x) for x in rng.integers(3, min(vocab, 40_000), args.context)]
        engine.add_request(prompt, {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True})
    step_times, decoding = [], 0
    while engine.scheduler.has_work():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if sum(1 for o in outs if o.new_token_ids) == args.batch:
            decoding += 1
            if decoding > 1:  # the first all-decode step may still hold a prefill's tail
                step_times.append(dt)
    result = {
        "kv_cache_dtype": kv_cache_dtype,
        "pool_tokens": shape.num_tokens,
        "pool_bytes": engine.runner.k_pool.nbytes + engine.runner.v_pool.nbytes,
        "bytes_per_token": shape.bytes_per_token,
        "decode_step_ms": 1e3 * float(np.median(step_times)),
        "decode_steps_timed": len(step_times),
    }
    engine.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a GGUF/HF path, default (SmolLM2-135M) or gemma3")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    ap.add_argument("--batch", type=int, default=8, help="requests decoding together")
    ap.add_argument("--new-tokens", type=int, default=32, help="per request; the steps where all decode are timed")
    ap.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size")
    ap.add_argument("--rounds", type=int, default=2, help="turns each dtype takes")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    path = model_path(args.model)
    runs = [[run_dtype(path, dtype, args) for dtype in args.dtypes] for _ in range(args.rounds)]
    results = []
    for i, dtype in enumerate(args.dtypes):
        steps = [run[i]["decode_step_ms"] for run in runs]
        results.append({**runs[0][i], "decode_step_ms": float(np.median(steps)), "decode_step_ms_per_round": steps})
    base = results[0]
    load = os.getloadavg()
    print(f"{args.model}: {args.batch} requests x {args.context}-token context, {args.new_tokens} new tokens, "
          f"{args.rounds} rounds; "
          f"CPU flags: {cpu_flags()}; load {load[0]:.2f}")
    print(f"{'--kv-cache-dtype':17} {'pool tokens':>11} {'bytes/token':>11} {'pool MiB':>9} {'decode step ms':>15} "
          f"{'tokens x':>8} {'step x':>7}")
    for r in results:
        print(f"{r['kv_cache_dtype']:17} {r['pool_tokens']:11d} {r['bytes_per_token']:11d} "
              f"{r['pool_bytes'] / 2**20:9.1f} {r['decode_step_ms']:15.2f} "
              f"{r['pool_tokens'] / base['pool_tokens']:8.2f} {r['decode_step_ms'] / base['decode_step_ms']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu_flags": cpu_flags(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
