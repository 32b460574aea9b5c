"""Issue 20, sixteenth pass: the int8 decode step's time, run from two checkouts in turn (before and after
the fifteenth pass) since its int8_matmul change cannot be switched off by a patch.

    PYTHONPATH=<checkout> python docs/bench/pass16_int8_step.py [--repeats 31]
"""
import argparse
import statistics
import time

import jax.numpy as jnp
import numpy as np

import jaxserve
from jaxserve.cache.kv_pool import PoolShape
from jaxserve.engine.model_runner import BatchEntry, ModelRunner
from jaxserve.model import quant
from jaxserve.model.loader import load_model
from jaxserve.pallas.reference import ragged_paged_attention_xla

PS = 16
ap = argparse.ArgumentParser()
ap.add_argument("--repeats", type=int, default=31)
ap.add_argument("--context", type=int, default=512)
ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
args = ap.parse_args()
config, params = quant.quantize_params(*load_model("default", "float32"), "w8a8_int8")
n, max_b = args.context, max(args.batch_sizes)
pps = n // PS + 2
prompt = [int(x) for x in np.random.default_rng(0).integers(3, config.vocab_size, size=n)]
shape = PoolShape(config.num_layers, max_b * pps + 1, PS, config.num_kv_heads, config.head_dim, "float32").shape
r = ModelRunner(config, params, jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
                attn_fn=ragged_paged_attention_xla, max_running_requests=max_b, max_extend_tokens=n,
                context_length=n + 2 * PS)
for i in range(max_b):
    r.forward([BatchEntry(prompt, 0, list(range(1 + i * pps, 1 + (i + 1) * pps)))])
row = [jaxserve.__file__]
for b in args.batch_sizes:
    entries = [BatchEntry([prompt[-1]], n, list(range(1 + i * pps, 1 + (i + 1) * pps))) for i in range(b)]
    r.forward(entries).block_until_ready()
    ts = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        r.forward(entries).block_until_ready()
        ts.append(time.perf_counter() - t0)
    row.append(f"batch {b}: {statistics.median(ts) * 1e3:.2f} ms")
print(" | ".join(row), flush=True)
