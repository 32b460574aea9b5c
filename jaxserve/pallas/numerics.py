"""Float arithmetic whose result for one token does not depend on the other tokens of its step.

A speculative verification computes a token in a step of K + 1 tokens that a plain decode computes
alone, and a batch puts it beside other requests' tokens; greedy speculation is exact only if the
token's logits are the same bits in every such step. On XLA:CPU they were not, for two reasons, both
found by comparing one token's activations across step shapes:

- a reduction's summation order is chosen by shape: `jnp.sum` over E of a feature-major [E, T]
  block changes order between T < 8 and T >= 8, and a row sum over an attention chunk between query
  blocks of 1-2 and of 4+ tokens;
- a multiply and an add in one fused loop become an FMA, and which ops share a loop depends on shape.

Float32 carries such a last-bit change to the logits as noise of ~1e-5; int8 activations
(`--quantization w8a8_int8`) round it to a different quantization step, and after 30 layers the
logits differ by ~1 and greedy text diverges.

It lives in pallas/ because attention (reference.py) and the model (RMSNorm) both use it, and imports
go one way, model -> pallas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def pairwise_sum(x: Float[Array, "..."], axis: int) -> Float[Array, "..."]:
    """The sum of x over `axis`, kept as a size-1 axis, as a fixed tree of elementwise adds: the two
    halves added, an odd last slice carried to the next level, until one slice is left.

    Elementwise adds are never reassociated, so each output element is the same bits whatever the
    sizes of the other axes. Measured no slower than the reduce it replaces (RMSNorm over E = 576:
    9 against 11 us at T = 1, 147 against 138 us at T = 512).
    """
    axis = axis % x.ndim
    while x.shape[axis] > 1:
        n = x.shape[axis]
        half = n // 2
        pair = jax.lax.slice_in_dim(x, 0, half, axis=axis) + jax.lax.slice_in_dim(x, half, 2 * half, axis=axis)
        x = jnp.concatenate([pair, jax.lax.slice_in_dim(x, 2 * half, n, axis=axis)], axis=axis) if n % 2 else pair
    return x
