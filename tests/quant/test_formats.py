"""Block formats (jaxserve/quant/formats.py) against the `gguf` package's own quantizer and dequantizer,
the independent reference for every GGUF type a checkpoint brings."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.quant import formats

Q = gguf.GGMLQuantizationType


def _values(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2.0, (rows, 1))).astype(np.float32)


def _k_quant_blocks(kind: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random raw k-quant super-blocks [rows, bytes] with finite float16 scales (random bytes elsewhere)."""
    block_elems, type_size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block_elems, type_size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 0.05, (rows, cols // block_elems, 2)).astype(np.float16).view(np.uint8)
    if kind == Q.Q4_K:  # d and dmin lead the block
        raw[..., 0:4] = scales.reshape(rows, -1, 4)
    else:  # Q6_K: d ends the block
        raw[..., -2:] = scales[..., :2].reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind, expected", [(Q.Q8_0, formats.Q8_0), (Q.Q4_0, formats.Q4_1), (Q.Q4_1, formats.Q4_1),
                                            (Q.Q5_0, formats.Q5_0)])
def test_exact_types_keep_ggmls_values(kind, expected):
    """Q8_0, Q4_0, Q4_1 and Q5_0 are kept bit-exactly: the dequantized weights (numpy and jnp) equal gguf's
    dequantization."""
    w = _values(5, 96)
    raw = gguf.quants.quantize(w, kind)
    fmt, arrays = formats.from_gguf(raw, kind, w.shape)
    assert fmt == expected
    np.testing.assert_array_equal(formats.dequantize_numpy(fmt, arrays), gguf.quants.dequantize(raw, kind))
    ours = formats.dequantize(fmt, {k: jnp.asarray(v) for k, v in arrays.items()})
    np.testing.assert_array_equal(np.asarray(ours), gguf.quants.dequantize(raw, kind))


def test_q5_0_packs_as_ggml_quantizes():
    """`pack_q5_0` (a float weight at load, or another format re-packed) gives gguf's own Q5_0 values."""
    w = _values(6, 128, seed=4)
    fmt, theirs = formats.from_gguf(gguf.quants.quantize(w, Q.Q5_0), Q.Q5_0, w.shape)
    ours = formats.pack_q5_0(w)
    np.testing.assert_array_equal(ours["qs"], theirs["qs"])
    np.testing.assert_array_equal(ours["scale"].view(np.uint16), theirs["scale"].view(np.uint16))


def test_common_format_keeps_a_weight_exact_where_it_can():
    assert formats.common_format([formats.Q5_0, formats.Q5_0]) == formats.Q5_0
    assert formats.common_format([formats.Q4_1]) == formats.Q4_1
    assert formats.common_format([formats.Q5_0, formats.Q4_1]) == formats.Q8_0
    assert formats.common_format([formats.Q5_0, formats.Q8_0]) == formats.Q8_0


def test_q4_k_becomes_q4_1_within_float16_rounding():
    """Q4_K's sub-block scale d * sc and min dmin * m, rounded to float16: each weight within 2^-10 of
    its block's range of gguf's value."""
    raw = _k_quant_blocks(Q.Q4_K, 3, 512)
    fmt, arrays = formats.from_gguf(raw, Q.Q4_K, (3, 512))
    assert fmt == formats.Q4_1
    ours, theirs = formats.dequantize_numpy(fmt, arrays), gguf.quants.dequantize(raw, Q.Q4_K)
    assert theirs.shape == ours.shape == (3, 512)
    span = np.abs(theirs).reshape(3, -1, 32).max(axis=-1, keepdims=True)
    err = np.abs(ours - theirs).reshape(3, -1, 32)
    assert (err <= span * 2.0**-10 + 1e-7).all(), err.max()
    assert np.abs(ours - theirs).max() > 0  # the float16 rounding is there: the test sees the conversion


@pytest.mark.parametrize("kind", [Q.Q6_K, Q.Q5_1, Q.F16, Q.BF16])
def test_other_types_become_q8_0_within_half_a_step(kind):
    """Types kept as q8_0: each weight within half a q8_0 step (max |w| / 254 of its block, the float16
    scale's rounding included) of gguf's dequantization."""
    if kind == Q.Q6_K:
        raw = _k_quant_blocks(Q.Q6_K, 3, 256)
    else:
        raw = gguf.quants.quantize(_values(3, 256), kind)
    fmt, arrays = formats.from_gguf(raw, kind, (3, 256))
    assert fmt == formats.Q8_0
    theirs = gguf.quants.dequantize(raw, kind).reshape(3, -1, 32)
    err = np.abs(formats.dequantize_numpy(fmt, arrays).reshape(3, -1, 32) - theirs)
    step = np.abs(theirs).max(axis=-1, keepdims=True) / 127
    assert (err <= step * (0.5 + 2.0**-9)).all()


@pytest.mark.parametrize("fmt, pack, levels", [(formats.Q8_0, formats.pack_q8_0, 254), (formats.Q4_1, formats.pack_q4_1, 15)])
def test_pack_error_is_half_a_step(fmt, pack, levels):
    """Quantizing a float weight at load: each weight within half a step (block range / levels)."""
    w = _values(7, 128, seed=3)
    arrays = pack(w)
    assert set(arrays) == set(formats.FIELDS[fmt])
    for name, (shape, dtype) in formats.field_shapes(fmt, 7, 128).items():
        assert arrays[name].shape == shape and arrays[name].dtype == dtype
    blocks = w.reshape(7, -1, 32)
    span = (2 * np.abs(blocks).max(-1, keepdims=True)) if fmt == formats.Q8_0 else np.ptp(blocks, -1, keepdims=True)
    err = np.abs(formats.dequantize_numpy(fmt, arrays).reshape(7, -1, 32) - blocks)
    assert (err <= span / levels * (0.5 + 2.0**-9) + 1e-6).all()


def test_q4_1_nibble_order_is_ggmls():
    """Byte j of a block holds element j low and element j + 16 high, as ggml's Q4_1 does."""
    w = np.tile(np.arange(32, dtype=np.float32) % 16, (1, 1))  # nibble values 0..15, 0..15
    raw = gguf.quants.quantize(w, Q.Q4_1)
    assert (formats.pack_q4_1(w)["qs"] == raw[:, 4:]).all()
    assert formats.pack_q4_1(w)["qs"][0, 0] == 0x00 and formats.pack_q4_1(w)["qs"][0, 1] == 0x11


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_jnp_dequantize_equals_numpys(fmt):
    arrays = {formats.Q8_0: formats.pack_q8_0, formats.Q4_1: formats.pack_q4_1, formats.Q5_0: formats.pack_q5_0}[fmt](
        _values(4, 64))
    ours = formats.dequantize(fmt, {k: jnp.asarray(v) for k, v in arrays.items()})
    np.testing.assert_array_equal(np.asarray(ours), formats.dequantize_numpy(fmt, arrays))
    assert formats.nbytes(arrays) == sum(v.nbytes for v in arrays.values())


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="blocks of 32; this one has 40"):
        formats.field_shapes(formats.Q8_0, 2, 40)
    with pytest.raises(ValueError, match="unknown weight format 'q3'"):
        formats.field_shapes("q3", 2, 64)
    with pytest.raises(ValueError, match="multiple of 256"):
        formats.from_gguf(np.zeros((1, 144 // 2), np.uint8), Q.Q4_K, (1, 128))
