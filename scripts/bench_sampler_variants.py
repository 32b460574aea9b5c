"""What the sampler's first-use variants cost: compile seconds per variant and batch size (what a
first request using the feature waits), the process RSS they add once compiled, and the per-call
run time of each variant against the warmed temperature-1 program (same process, same inputs).

    python scripts/bench_sampler_variants.py [--num-seqs 1,2,4,8,16,32,64] [--vocab 49152] [--calls 50]

Prints one JSON line per (variant, S) and a summary; compiles one at a time (start-up compiles them on
a thread pool of os.cpu_count() workers, so its wall time is about the sum divided by the cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner import sampler as sampler_lib
from jaxserve.engine.request import SamplingParams


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e9


def variants(s: int, vocab: int):
    """name -> (SamplingBatch, flags) of one real row in a bucket of S rows."""
    b = sampler_lib.build_sampling_batch
    width = sampler_lib.bitmask_width(vocab)
    mask = np.full((s, width), -1, np.int32)
    return {
        "temperature (warmed)": b([SamplingParams(temperature=1.0)], [0], [0], None, None, s, vocab),
        "greedy (warmed)": b([SamplingParams(temperature=0.0)], [0], [0], None, None, s, vocab),
        "top_k": b([SamplingParams(temperature=1.0, top_k=20)], [0], [0], None, None, s, vocab),
        "top_p": b([SamplingParams(temperature=1.0, top_p=0.9)], [0], [0], None, None, s, vocab),
        "top_k+top_p": b([SamplingParams(temperature=1.0, top_k=20, top_p=0.9)], [0], [0], None, None, s, vocab),
        "min_p": b([SamplingParams(temperature=1.0, min_p=0.05)], [0], [0], None, None, s, vocab),
        "greedy+bitmask": b([SamplingParams(temperature=0.0)], [0], [0], None, mask, s, vocab),
        "temperature+bitmask": b([SamplingParams(temperature=1.0)], [0], [0], None, mask, s, vocab),
        "greedy+logprobs": b([SamplingParams(temperature=0.0)], [0], [0], None, None, s, vocab, return_logprob=True),
        "greedy+top_logprobs 5": b([SamplingParams(temperature=0.0)], [0], [0], None, None, s, vocab,
                                   return_logprob=True, num_top_logprobs=5),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", default="1,2,4,8,16,32,64")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    jitted = jax.jit(sampler_lib.sample, static_argnums=(2,))
    rng = np.random.default_rng(0)
    rows = []
    rss0 = rss_gb()
    for s in [int(x) for x in args.num_seqs.split(",")]:
        logits = jnp.asarray(rng.standard_normal((s, args.vocab), np.float32) * 4)
        for name, (batch, flags) in variants(s, args.vocab).items():
            t0 = time.perf_counter()
            exe = jitted.lower(logits, batch, flags).compile()
            compile_s = time.perf_counter() - t0
            jax.block_until_ready(exe(logits, batch))
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                jax.block_until_ready(exe(logits, batch))
                times.append(time.perf_counter() - t0)
            row = {"variant": name, "num_seqs": s, "compile_s": round(compile_s, 3),
                   "run_ms": round(1e3 * statistics.median(times), 3), "rss_gb": round(rss_gb(), 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = {r["num_seqs"]: r["run_ms"] for r in rows if r["variant"] == "temperature (warmed)"}
    summary = {}
    for r in rows:
        d = summary.setdefault(r["variant"], {"compile_s_sum": 0.0, "compile_s_max": 0.0, "run_ratio": []})
        d["compile_s_sum"] = round(d["compile_s_sum"] + r["compile_s"], 2)
        d["compile_s_max"] = max(d["compile_s_max"], r["compile_s"])
        d["run_ratio"].append(round(r["run_ms"] / base[r["num_seqs"]], 2))
    print(json.dumps({"summary": summary, "rss_gb_start": round(rss0, 3), "rss_gb_end": round(rss_gb(), 3),
                      "cpus": jax.device_count(), "backend": jax.default_backend()}, indent=1))


if __name__ == "__main__":
    main()
