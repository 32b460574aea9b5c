"""The decoder layer's projections on XLA:CPU in two layouts, same weights, same invocation.

    token-major    x [T, E] @ W [in, out]   (the layout jaxserve used before: [in, out] weights)
    feature-major  W [out, in] @ x [E, T]   (what `llama.decoder_layer` runs: the checkpoint's layout,
                                             the residual stream carried as [E, T])

Both run SmolLM2-135M's shapes with fused projections (QKV [576 -> 960], O [576 -> 576], gate+up
[576 -> 3072], down [1536 -> 576]) over 30 layers held in separate buffers, one jitted call per layer,
for T tokens (the decode batch size, or a prefill chunk). Random float32 weights; attention and norms
left out. Reported: median ms for the 30 layers and the weight bytes streamed per second.

    python scripts/bench_projection.py [--tokens 1 2 4 8 16 32 64 512] [--repeats 9]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench_model import timed  # scripts/ is on sys.path when this runs as a script

LAYERS, E, QKV, I = 30, 576, 960, 1536


def token_major(p, x):  # x [T, E]; weights [in, out]
    qkv = x @ p["qkv"]
    x = x + qkv[:, :E] @ p["o"] + qkv[:, E:].sum()
    gate_up = x @ p["gate_up"]
    return x + (jax.nn.silu(gate_up[:, :I]) * gate_up[:, I:]) @ p["down"]


def feature_major(p, x):  # x [E, T]; weights [out, in]
    qkv = p["qkv"] @ x
    x = x + p["o"] @ qkv[:E] + qkv[E:].sum()
    gate_up = p["gate_up"] @ x
    return x + p["down"] @ (jax.nn.silu(gate_up[:I]) * gate_up[I:])


def median_ms(layer_fn, layers, x, repeats: int) -> float:
    def run():
        y = x
        for p in layers:
            y = layer_fn(p, y)
        return y.block_until_ready()

    return timed(run, repeats) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 512])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    shapes = {"qkv": (E, QKV), "o": (E, E), "gate_up": (E, 2 * I), "down": (I, E)}  # [in, out]
    in_out = [{k: rng.standard_normal(s, np.float32) * 0.02 for k, s in shapes.items()} for _ in range(LAYERS)]
    out_in = [{k: np.ascontiguousarray(w.T) for k, w in layer.items()} for layer in in_out]
    in_out, out_in = jax.device_put(in_out), jax.device_put(out_in)
    weight_bytes = sum(w.nbytes for w in jax.tree.leaves(in_out))
    tm, fm = jax.jit(token_major), jax.jit(feature_major)

    print(f"\njax {jax.__version__} on {jax.default_backend()}; {LAYERS} layers, {weight_bytes / 1e6:.0f} MB of weights\n")
    print("| T | token-major x @ W (ms) | feature-major W @ x (ms) | speed-up | feature-major GB/s |")
    print("|---|---|---|---|---|")
    for t in args.tokens:
        x = jnp.asarray(rng.standard_normal((t, E), np.float32))
        a = median_ms(tm, in_out, x, args.repeats)
        b = median_ms(fm, out_in, x.T, args.repeats)
        np.testing.assert_allclose(np.asarray(tm(in_out[0], x)), np.asarray(fm(out_in[0], x.T)).T, rtol=1e-3, atol=1e-3)
        print(f"| {t} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {weight_bytes / b / 1e6:.1f} |")


if __name__ == "__main__":
    main()
