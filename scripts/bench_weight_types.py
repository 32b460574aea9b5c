"""Batch-1 matrix-vector products over narrower weight types on XLA:CPU, against float32.

Fewer weight bytes only speed up a memory-bound decode if the kernel reads them in place. This runs the
default model's fused projection shapes (30 layers in separate buffers, one jit, random weights) as
`W @ x` for one token with W in float32, bfloat16, float16 and int8 (`preferred_element_type`), and as a
multiply-reduce over uint8 weights with one float32 scale per block of 32 inputs (how Q4_1/Q8_0
checkpoints store blocks), all in the same invocation; median of --repeats.

    python scripts/bench_weight_types.py [--repeats 20]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench_model import timed  # scripts/ is on sys.path when this runs as a script

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # wqkv, wo, w_gate_up, w_down as [out, in]
LAYERS, BLOCK = 30, 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    mats = [rng.standard_normal(shape, dtype=np.float32) for shape in SHAPES for _ in range(LAYERS)]
    xs = {i: jnp.asarray(rng.standard_normal((i,), dtype=np.float32)) for _, i in SHAPES}

    def dot_variant(dtype):
        ws = [jnp.asarray(m, dtype) for m in mats]
        fn = jax.jit(lambda ws, xs: [jnp.dot(w, xs[w.shape[1]].astype(dtype), preferred_element_type=jnp.float32)
                                     for w in ws])
        return fn, (ws, xs), sum(w.nbytes for w in ws)

    def blocked_uint8():
        qs = [jnp.asarray(rng.integers(0, 16, m.shape, dtype=np.uint8)) for m in mats]
        scales = [jnp.asarray(rng.standard_normal((m.shape[0], m.shape[1] // BLOCK), dtype=np.float32)) for m in mats]

        def matvec(q, d, x):
            out, inp = q.shape
            blocks = q.reshape(out, inp // BLOCK, BLOCK).astype(jnp.float32) * x.reshape(inp // BLOCK, BLOCK)
            return (blocks.sum(-1) * d).sum(-1)

        fn = jax.jit(lambda qs, ds, xs: [matvec(q, d, xs[q.shape[1]]) for q, d in zip(qs, ds)])
        return fn, (qs, scales, xs), sum(q.nbytes + d.nbytes for q, d in zip(qs, scales))

    variants = {
        "float32": dot_variant(jnp.float32),
        "bfloat16": dot_variant(jnp.bfloat16),
        "float16": dot_variant(jnp.float16),
        "int8": dot_variant(jnp.int8),
        "uint8, scale per 32": blocked_uint8(),
    }
    times = {name: timed(lambda f=f, a=a: jax.block_until_ready(f(*a)), args.repeats) for name, (f, a, _) in variants.items()}
    base = times["float32"]
    print(f"\njax {jax.__version__} on {jax.default_backend()}; {LAYERS} layers, one token, median of {args.repeats}\n")
    print("| weights | MB read | ms | GB/s | time vs float32 |")
    print("|---|---|---|---|---|")
    for name, (_, _, nbytes) in variants.items():
        t = times[name]
        print(f"| {name} | {nbytes / 1e6:.0f} | {t * 1e3:.1f} | {nbytes / t / 1e9:.1f} | {t / base:.2f}x |")


if __name__ == "__main__":
    main()
