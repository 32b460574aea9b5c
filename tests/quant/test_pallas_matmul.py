"""The Pallas quantized matmul (jaxserve/quant/pallas_matmul.py) in interpret mode against the dequantized
reference (`formats.reference_matmul`, numpy-packed weights), and its lowering for "cuda"."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.quant import formats
from jaxserve.quant.pallas_matmul import quant_matmul_pallas
from tests.pallas.test_ragged_paged_attention import needs_embedded_triton_ir, triton_kernels

PACK = {formats.Q8_0: formats.pack_q8_0, formats.Q4_1: formats.pack_q4_1, formats.Q5_0: formats.pack_q5_0}


@pytest.mark.parametrize("fmt", formats.FORMATS)
@pytest.mark.parametrize("out_features, in_features, num_tokens", [
    (96, 64, 1),  # a decode: T padded to 16
    (40, 128, 5),  # O not a multiple of the row tile: padded with zero rows
    (64, 96, 33),  # a prefill chunk over two token tiles
])
def test_matches_the_dequantized_reference(fmt, out_features, in_features, num_tokens):
    rng = np.random.default_rng(out_features + num_tokens)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32)
    arrays = {name: jnp.asarray(a) for name, a in PACK[fmt](w).items()}
    x = jnp.asarray(rng.standard_normal((in_features, num_tokens)), jnp.float32)
    out = jax.jit(functools.partial(quant_matmul_pallas, fmt, interpret=True))(arrays, x)
    assert out.shape == (out_features, num_tokens) and out.dtype == jnp.float32
    # the reference in float64 numpy over the numpy-dequantized weights
    ref = formats.dequantize_numpy(fmt, PACK[fmt](w)).astype(np.float64) @ np.asarray(x, np.float64)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_fields_of_the_wrong_shape_are_refused():
    arrays = {name: jnp.asarray(a) for name, a in formats.pack_q8_0(np.ones((32, 64), np.float32)).items()}
    with pytest.raises(ValueError, match="q8_0 field 'qs'"):
        quant_matmul_pallas(formats.Q8_0, arrays, jnp.ones((96, 2), jnp.float32))
    with pytest.raises(ValueError, match="unknown weight format"):
        quant_matmul_pallas("q6_k", arrays, jnp.ones((64, 2), jnp.float32))


@needs_embedded_triton_ir
@pytest.mark.parametrize("fmt", formats.FORMATS)
@pytest.mark.parametrize("num_tokens", [1, 8, 256])
def test_lowers_for_cuda(fmt, num_tokens):
    """A SmolLM2 gate/up projection (1536 x 576) lowers to one verified Triton kernel: one dot per block for
    q8_0, two (low and high nibbles) for q4_1 and q5_0, each with M, N, K >= 16."""
    shapes = {name: jax.ShapeDtypeStruct(shape, dtype)
              for name, (shape, dtype) in formats.field_shapes(fmt, 1536, 576).items()}
    f = functools.partial(quant_matmul_pallas, fmt, interpret=False)
    lowered = jax.jit(f).trace(shapes, jax.ShapeDtypeStruct((576, num_tokens), jnp.float32)).lower(
        lowering_platforms=("cuda",))
    [(_, dots)] = triton_kernels(lowered)
    assert len(dots) == (1 if fmt == formats.Q8_0 else 2)
    for a, b in dots:
        assert min(*a, *b) >= 16, (a, b)
