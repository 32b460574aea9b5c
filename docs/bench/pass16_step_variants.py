"""Issue 20, sixteenth pass: the decode step's time with and without the shape-invariant arithmetic.

Variants, each its own ModelRunner traced under its own patch (one process, timed runs alternating):
  vector       main: pairwise sums (fifteenth pass), a one-token dot as XLA:CPU's matrix-vector kernel
  plain        plain reduces in RMSNorm and attention (main before the fifteenth pass, float32)
  two-columns  main with docs/bench/pass16_two_columns.diff applied (`git apply`): a one-token float
               dot run as two equal columns, so float32 decode is the same bits as batched/verified;
               measured only where that diff is applied
Default model, KV of --context tokens per sequence, median of --repeats steps.

    python docs/bench/pass16_step_variants.py [--quantization w8a8_int8] [--repeats 41]
"""
import argparse
import contextlib
import statistics
import time

import jax.numpy as jnp
import numpy as np

from jaxserve.cache.kv_pool import PoolShape
from jaxserve.engine.model_runner import BatchEntry, ModelRunner
from jaxserve.model import llama, quant
from jaxserve.model.loader import load_model
from jaxserve.pallas import numerics, reference
from jaxserve.pallas.reference import ragged_paged_attention_xla

PS = 16
ap = argparse.ArgumentParser()
ap.add_argument("--quantization", default=None)
ap.add_argument("--repeats", type=int, default=41)
ap.add_argument("--context", type=int, default=512)
ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 8])
args = ap.parse_args()


@contextlib.contextmanager
def patched(variant):
    saved = (getattr(llama, "two_columns_at_least", None), numerics.pairwise_sum, reference.pairwise_sum)
    if variant in ("vector", "plain") and saved[0]:
        llama.two_columns_at_least = lambda product, x, axis=-1: product(x)
    if variant == "plain":
        plain = lambda x, axis: jnp.sum(x, axis=axis, keepdims=True)
        numerics.pairwise_sum = reference.pairwise_sum = plain
    try:
        yield
    finally:
        numerics.pairwise_sum, reference.pairwise_sum = saved[1:]
        if saved[0]:
            llama.two_columns_at_least = saved[0]


config, params = load_model("default", "float32")
config, params = quant.quantize_params(config, params, args.quantization)
variants = ["vector", "plain"] + (["two-columns"] if hasattr(llama, "two_columns_at_least") else [])
n, max_b = args.context, max(args.batch_sizes)
pps = n // PS + 2
rng = np.random.default_rng(0)
prompt = [int(x) for x in rng.integers(3, config.vocab_size, size=n)]
shape = PoolShape(config.num_layers, max_b * pps + 1, PS, config.num_kv_heads, config.head_dim, "float32").shape


def pages(i):
    return list(range(1 + i * pps, 1 + (i + 1) * pps))


runners = {}
for v in variants:
    r = ModelRunner(config, params, jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
                    attn_fn=ragged_paged_attention_xla, max_running_requests=max_b, max_extend_tokens=n,
                    context_length=n + 2 * PS)
    with patched(v):  # trace every shape timed below under the variant's patch
        for i in range(max_b):
            r.forward([BatchEntry(prompt, 0, pages(i))])
        for b in args.batch_sizes:
            r.forward([BatchEntry([prompt[-1]], n, pages(i)) for i in range(b)]).block_until_ready()
    runners[v] = r

print(f"quantization={args.quantization} context={n} repeats={args.repeats}")
print("| step | " + " | ".join(f"{v} (ms)" for v in variants) + " | " + " | ".join(f"{v} / vector" for v in variants[1:]) + " |")
print("|---" * (1 + 2 * len(variants) - 1) + "|")
for b in args.batch_sizes:
    entries = [BatchEntry([prompt[-1]], n, pages(i)) for i in range(b)]
    times = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v, r in runners.items():
            t0 = time.perf_counter()
            r.forward(entries).block_until_ready()
            times[v].append(time.perf_counter() - t0)
    med = {v: statistics.median(ts) * 1e3 for v, ts in times.items()}
    print(f"| decode, batch {b} | " + " | ".join(f"{med[v]:.2f}" for v in variants) + " | "
          + " | ".join(f"{med[v] / med['vector']:.3f}" for v in variants[1:]) + " |", flush=True)
