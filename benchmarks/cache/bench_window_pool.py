"""KV memory of one long context with the hybrid sliding-window pool against keeping every layer's pages.

One request of `--context` prompt tokens (random ids, fixed seed) and `--new-tokens` greedy tokens runs
through the engine twice in this process: with `--disable-hybrid-swa-memory` (the baseline: every layer
keeps all its pages) and with the hybrid pool (D-46) at `--swa-full-tokens-ratio`. After every step the
tool reads the pages the allocator has handed out and turns them into bytes: full-space pages x full
layers + window pages x window layers (baseline: pages x all layers). Reported per layout: the pool's
device bytes for the same `--max-total-tokens`, the peak KV bytes held during prefill and while
decoding (window parts the tree keeps as cache included), the window pages the request needed at most
(its window locks: the goal is the window and one page while decoding), and the median decode step time
(the hybrid pool's per-layer page-table pick must cost nothing measurable). A ratio whose window space is
smaller than the context shows the context served from it.

    python -m benchmarks.cache.bench_window_pool --model gemma3 --context 4096 --swa-full-tokens-ratio 0.15
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from benchmarks.model.bench_sampler import cpu_flags, model_path


def run_layout(path: str, hybrid: bool, args) -> dict:
    from jaxserve.engine.engine import Engine

    engine = Engine(model_path=path, max_total_tokens=args.max_total_tokens, chunked_prefill_size=args.chunk,
                    context_length=args.context + args.new_tokens, max_running_requests=1, page_size=args.page_size,
                    disable_hybrid_swa_memory=not hybrid, disable_radix_cache=False,
                    swa_full_tokens_ratio=args.swa_full_tokens_ratio)
    cfg, shape, alloc = engine.runner.model_config, engine.runner.pool_shape, engine.cache.allocator  # shape: the full page space
    layer_page_bytes = shape.bytes_per_token // shape.num_layers * shape.page_size
    windows = cfg.layer_sliding_windows()
    num_window = sum(w is not None for w in windows)

    def kv_bytes() -> int:
        if engine.runner.window_layout is None:
            return alloc.num_used * cfg.num_layers * layer_page_bytes
        return (alloc.num_used * (cfg.num_layers - num_window) + alloc.window.num_used * num_window) * layer_page_bytes

    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(3, min(cfg.vocab_size, 50_000), args.context)]
    engine.add_request(prompt, {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True})
    peak_prefill, decode_bytes, decode_window_pages, step_times, output = 0, [], [], [], []
    window_locks = alloc.window_locks if engine.runner.window_layout is not None else None
    prefilling = True
    while engine.scheduler.has_work():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        produced = any(o.new_token_ids for o in outs)
        if prefilling:
            peak_prefill = max(peak_prefill, kv_bytes())
            prefilling = not produced
        else:
            step_times.append(dt)
            decode_bytes.append(kv_bytes())
            if window_locks is not None:
                decode_window_pages.append(int(np.count_nonzero(window_locks)))
        for o in outs:
            output = o.output_ids
    engine.cache.check_integrity([])
    result = {
        "layout": "hybrid" if hybrid else "every layer's pages",
        "pool_bytes": engine.runner.k_pool.nbytes + engine.runner.v_pool.nbytes,
        "peak_prefill_kv_bytes": peak_prefill,
        "decode_kv_bytes": max(decode_bytes) if decode_bytes else 0,
        "window_pages_needed_decoding": max(decode_window_pages) if decode_window_pages else None,
        "window_space_tokens": (None if engine.runner.window_layout is None
                                else (engine.runner.window_layout.num_window_pages - 1) * args.page_size),
        "decode_step_ms": 1e3 * float(np.median(step_times[1:] or step_times)),
        "output_ids": output,
    }
    engine.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3", help="a GGUF/HF path, or gemma3 (google/gemma-3-270m from its PyPI package)")
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=8192, help="the pool's full-space tokens, both layouts")
    ap.add_argument("--swa-full-tokens-ratio", type=float, default=0.8, help="the hybrid pool's window space per full token")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    path = model_path(args.model)
    results = [run_layout(path, hybrid, args) for hybrid in (False, True)]
    base, hybrid = results
    assert hybrid["output_ids"] == base["output_ids"], "the hybrid pool changed the greedy output"
    load = os.getloadavg()
    print(f"{args.model}, {args.context}-token context + {args.new_tokens} new tokens, chunks of {args.chunk}, "
          f"page {args.page_size}, window space {hybrid['window_space_tokens']} tokens "
          f"(--swa-full-tokens-ratio {args.swa_full_tokens_ratio}); CPU flags: {cpu_flags()}; load {load[0]:.2f}")
    print(f"{'layout':22} {'pool MiB':>9} {'prefill peak KV MiB':>20} {'decode KV MiB':>14} {'decode step ms':>15}")
    for r in results:
        print(f"{r['layout']:22} {r['pool_bytes'] / 2**20:9.1f} {r['peak_prefill_kv_bytes'] / 2**20:20.1f} "
              f"{r['decode_kv_bytes'] / 2**20:14.1f} {r['decode_step_ms']:15.1f}")
    print(f"hybrid / baseline: pool {hybrid['pool_bytes'] / base['pool_bytes']:.2f}x, prefill peak "
          f"{hybrid['peak_prefill_kv_bytes'] / base['peak_prefill_kv_bytes']:.2f}x, decode KV "
          f"{hybrid['decode_kv_bytes'] / base['decode_kv_bytes']:.2f}x, decode step "
          f"{hybrid['decode_step_ms'] / base['decode_step_ms']:.2f}x; window pages the request needed while "
          f"decoding: {hybrid['window_pages_needed_decoding']}; same greedy ids")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu_flags": cpu_flags(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
