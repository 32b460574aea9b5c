"""Throwaway (issue 20, fourteenth pass): decode and verify steps of the default model with the XLA attention's two
dots in three forms, timed alternating in one process, outputs checked equal.

    python docs/bench/pass14_attention_dots.py xla,mulsum,rows1 200    # forms, cached tokens
"""
import sys, time, functools, statistics
sys.path.insert(0, "scripts")  # run from the repository root
import numpy as np, jax, jax.numpy as jnp
import bench_verify, bench_model
from jaxserve.engine.model_runner import BatchEntry
from jaxserve.model.loader import load_model
from jaxserve.pallas import reference as ref

SRC = open(ref.__file__).read()

def variant(kind):
    """ragged_paged_attention_xla with its dots replaced."""
    ns = {}
    code = SRC
    if kind == "mulsum":
        code = code.replace('jnp.einsum("krd,ksd->krs", q_blk, k, preferred_element_type=jnp.float32)',
                            '(q_blk[:, :, None, :].astype(jnp.float32) * k[:, None, :, :]).sum(-1)')
        code = code.replace('jnp.einsum("krs,ksd->krd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)',
                            '(p[:, :, :, None] * v[:, None, :, :].astype(jnp.float32)).sum(2)')
    elif kind == "rows1":  # one row per dot: [KVH*R, 1, D] x [KVH*R, S, D] (broadcast over rows): m == 1
        code = code.replace('jnp.einsum("krd,ksd->krs", q_blk, k, preferred_element_type=jnp.float32)',
                            'jnp.einsum("krd,krsd->krs", q_blk, jnp.broadcast_to(k[:, None], (k.shape[0], q_blk.shape[1]) + k.shape[1:]), preferred_element_type=jnp.float32)')
        code = code.replace('jnp.einsum("krs,ksd->krd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)',
                            'jnp.einsum("krs,krsd->krd", p.astype(v.dtype), jnp.broadcast_to(v[:, None], (v.shape[0], p.shape[1]) + v.shape[1:]), preferred_element_type=jnp.float32)')
    assert kind == "xla" or code != SRC
    exec(compile(code, "variant_" + kind, "exec"), ns)
    return ns["ragged_paged_attention_xla"]

kinds = sys.argv[1].split(",")
n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
config, params = load_model("default", "float32")
prompt = [int(x) for x in np.random.default_rng(0).integers(3, config.vocab_size, size=n)]
pages = {b: list(range(1 + b * (n // 16 + 3), 1 + (b + 1) * (n // 16 + 3))) for b in range(8)}
runners = {k: bench_verify.runner_with(config, params, variant(k), 16, n + 32) for k in kinds}
for r in runners.values():
    for b in range(8):
        r.forward([BatchEntry(prompt, 0, pages[b])])
cases = {
    "decode b1": lambda: [BatchEntry([prompt[-1]], n, pages[0])],
    "decode b8": lambda: [BatchEntry([prompt[-1]], n, pages[b]) for b in range(8)],
    "verify 4": lambda: [BatchEntry(prompt[-4:], n, pages[0], num_logits=4)],
    "verify 16": lambda: [BatchEntry(prompt[-16:], n, pages[0], num_logits=16)],
}
outs = {k: [np.asarray(r.forward(c())) for c in cases.values()] for k, r in runners.items()}
base = outs[kinds[0]]
for k, o in outs.items():
    for a, b in zip(o, base):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
fns = {(k, c): (lambda r=r, e=e(): r.forward(e).block_until_ready()) for k, r in runners.items() for c, e in cases.items()}
times = bench_model.timed_alternating(fns, 15, statistics.median)
print(f"context {n}, median of 15, ms")
for c in cases:
    print(f"{c:10s} " + "  ".join(f"{k}={times[(k, c)] * 1e3:7.2f}" for k in kinds))
