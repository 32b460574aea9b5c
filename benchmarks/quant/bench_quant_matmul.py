"""The quantized matmul against float32, per number of tokens T: the projections of a whole decoder's layers.

For each T, one jitted function runs every projection of `--layers` layers of `--model`'s shapes (distinct
weights per layer, so the weights stream from memory as in a real step, not from cache; each layer's inputs
depend on the last layer's outputs) three ways: the float32 dot,
`quant_matmul` (the CPU kernel's tiles through jax.ffi while T <= its format's KERNEL_MAX_TOKENS, the kernel's
`dequantize` and XLA's dot above), and the XLA path alone (`xla_matmul`: `formats.dequantize`, then the float32
dot), for each block format; `--kernel-dequantize` adds the kernel's `dequantize` and XLA's dot at every T. Prints the median of `--repeats` calls in ms and each as a ratio to float32 (below 1 is faster).

    python -m benchmarks.quant.bench_quant_matmul --tokens 1 4 8 16 32 64
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.attention.bench_attention import median_ms  # median of repeats after a warm-up, in ms
from jaxserve.quant import cpu_kernel, formats
from jaxserve.runner import xla_cpu  # noqa: F401  (on import: XLA:CPU's scheduler as the engine runs it, D-49)

# [out, in] of each layer's projections: wqkv, wo, gate+up, down
SHAPES = {
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "qwen2.5-0.5b": [(1152, 896), (896, 896), (9728, 896), (896, 4864)],
}
PACK = {formats.Q8_0: formats.pack_q8_0, formats.Q4_1: formats.pack_q4_1, formats.Q5_0: formats.pack_q5_0}


def _layers(matmul, params, xs):
    """Every layer's projections, each layer's inputs depending on the last layer's outputs as in a model
    (so XLA cannot run all layers' weight decoding first)."""
    carry = jnp.float32(0.0)
    for layer in params:
        carry = sum(jnp.sum(matmul(p, x + 1e-30 * carry)) for p, x in zip(layer, xs))
    return carry


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kernel-dequantize", action="store_true",
                        help="also time the kernel's dequantize, then XLA's float32 dot, at every T")
    args = parser.parse_args(argv)
    print(f"kernel: {cpu_kernel.kernel_status()}; KERNEL_MAX_TOKENS {cpu_kernel.KERNEL_MAX_TOKENS}")
    rng = np.random.default_rng(0)
    shapes = SHAPES[args.model]
    weights = [[rng.standard_normal(s, dtype=np.float32) * 0.05 for s in shapes] for _ in range(args.layers)]
    variants = {"float32": ([[jnp.asarray(w) for w in layer] for layer in weights], lambda w, x: w @ x)}
    for fmt, pack in PACK.items():
        blocks = [[{k: jnp.asarray(v) for k, v in pack(w).items()} for w in layer] for layer in weights]
        variants[fmt] = (blocks, lambda p, x, fmt=fmt: cpu_kernel.quant_matmul(fmt, p, x))
        variants[f"{fmt} XLA path"] = (blocks, lambda p, x, fmt=fmt: cpu_kernel.xla_matmul(fmt, p, x))
        if args.kernel_dequantize:
            variants[f"{fmt} kernel dequantize"] = (
                blocks, lambda p, x, fmt=fmt: cpu_kernel.dequantize(fmt, p, x.shape[0]) @ x)
    print(f"{args.model}, {args.layers} layers: ms per step's projections (ratio to float32)")
    for num_tokens in args.tokens:
        xs = [jnp.asarray(rng.standard_normal((s[1], num_tokens), dtype=np.float32)) for s in shapes]
        row = {}
        for name, (params, matmul) in variants.items():
            step = jax.jit(functools.partial(_layers, matmul))
            row[name] = median_ms(step, params, xs, repeats=args.repeats)
        cells = ", ".join(f"{k} {v:.1f} ({v / row['float32']:.2f}x)" for k, v in row.items())
        print(f"T={num_tokens}: {cells}", flush=True)


if __name__ == "__main__":
    main()
