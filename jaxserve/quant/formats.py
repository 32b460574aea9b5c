"""Block-quantized weight formats: what a projection stores when its weights stay compressed, how a GGUF
tensor or a float matrix becomes one, and the pure-jnp reference that every kernel is tested against.

A weight W [O, I] (rows flattened: a [2, I, E] gate/up weight is [2 I, E]) is cut into blocks of
`BLOCK` = 32 consecutive inputs of one row, each with its own float16 scale:

    q8_0: W[o, 32 b + j] = scale[o, b] * qs[o, 32 b + j]              qs int8 [O, I]          (ggml's Q8_0)
    q4_1: W[o, 32 b + j] = scale[o, b] * nibble_j + min[o, b]         qs uint8 [O, I / 2]     (ggml's Q4_1)
    q5_0: W[o, 32 b + j] = scale[o, b] * (nibble_j + 16 bit_j - 16)   qs uint8 [O, 20 I / 32] (ggml's Q5_0)

with scale, min float16 [O, I / 32], and the nibbles of block b in bytes 16 b .. 16 b + 15 (q4_1): byte
16 b + j holds element j in its low four bits and element j + 16 in its high four, ggml's order. A q5_0 block
is 20 bytes of qs, ggml's block without its scale: the fifth bits of its 32 elements as a little-endian
uint32 (bit j: element j), then its 16 bytes of nibbles in q4_1's order. The arrays are kept one per field
(not ggml's interleaved blocks), the layout both the CPU kernel (quant_matmul.cc) and the Pallas kernel
(pallas_matmul.py) read.

From GGUF (`from_gguf`), by the tensor's ggml type:
- Q8_0, Q4_0, Q4_1, Q5_0: exact (Q4_0's value d (q - 8) is q4_1 with min = -8 d, exact in float16);
- Q4_K: q4_1 with each 32-element sub-block's scale d * sc and min -dmin * m rounded to float16 (a
  relative change under 2^-11 of a step, against the 4-bit step itself);
- Q5_1, Q6_K, Q8_K, F16, BF16, F32: dequantized by the `gguf` package, then q8_0 (`pack_q8_0`): more
  bits than the source's grid needs only where the source has more than 5 bits; the error is at most half
  a q8_0 step (max |w| / 254 of the block).
The precision choices and their measured cost: docs/decisions.md, D-47.
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

BLOCK = 32
Q8_0 = "q8_0"
Q4_1 = "q4_1"
Q5_0 = "q5_0"
FORMATS = (Q8_0, Q4_1, Q5_0)
# the arrays of each format, in the order the kernels take them; a projection `name` stores them as the
# params `name` (qs), `name_scale` and `name_min`
FIELDS: dict[str, tuple[str, ...]] = {Q8_0: ("qs", "scale"), Q4_1: ("qs", "scale", "min"), Q5_0: ("qs", "scale")}
Q5_0_BLOCK_BYTES = 20  # a q5_0 block's qs: 4 bytes of fifth bits, 16 of nibbles
_EXACT_4BIT = {gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_K}

QuantArrays = dict[str, np.ndarray]  # a format's fields by name: "qs", "scale", and "min" for q4_1


def field_shapes(fmt: str, out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The shape and dtype of each of format `fmt`'s arrays for a W [out_features, in_features].

    Raises:
        ValueError: `in_features` not a multiple of `BLOCK`, or an unknown format.
    """
    if in_features % BLOCK:
        raise ValueError(f"a {fmt} weight needs inputs in blocks of {BLOCK}; this one has {in_features}")
    nb = in_features // BLOCK
    if fmt == Q8_0:
        return {"qs": ((out_features, in_features), np.dtype(np.int8)), "scale": ((out_features, nb), np.dtype(np.float16))}
    if fmt == Q4_1:
        return {
            "qs": ((out_features, in_features // 2), np.dtype(np.uint8)),
            "scale": ((out_features, nb), np.dtype(np.float16)),
            "min": ((out_features, nb), np.dtype(np.float16)),
        }
    if fmt == Q5_0:
        return {"qs": ((out_features, nb * Q5_0_BLOCK_BYTES), np.dtype(np.uint8)),
                "scale": ((out_features, nb), np.dtype(np.float16))}
    raise ValueError(f"unknown weight format {fmt!r}: one of {', '.join(FORMATS)}")


def format_of_gguf_type(ggml_type: int) -> str:
    """The format a GGUF tensor of `ggml_type` is kept in: q4_1 for the 4-bit types, q5_0 for Q5_0, else q8_0."""
    kind = gguf.GGMLQuantizationType(ggml_type)
    return Q4_1 if kind in _EXACT_4BIT else Q5_0 if kind == gguf.GGMLQuantizationType.Q5_0 else Q8_0


def common_format(formats_of_parts: list[str]) -> str:
    """The one format that holds every part of a weight exactly where one exists: q4_1 when all parts are
    q4_1, q5_0 when all are q5_0, else q8_0 (the others re-packed within half a q8_0 step)."""
    kinds = set(formats_of_parts)
    return kinds.pop() if len(kinds) == 1 else Q8_0


def pack_q8_0(w: np.ndarray) -> QuantArrays:
    """q8_0 blocks of a float W [..., I] (rows flattened), as ggml quantizes Q8_0: scale = max |w| / 127
    per block, rounded to float16, and qs = round(w / scale) (0 for an all-zero block)."""
    w = np.asarray(w, np.float32)
    w = w.reshape(-1, w.shape[-1])
    field_shapes(Q8_0, *w.shape)
    blocks = w.reshape(w.shape[0], -1, BLOCK)
    scale = (np.abs(blocks).max(axis=-1) / 127.0).astype(np.float16)
    safe = np.where(scale == 0, 1.0, scale.astype(np.float32))[..., None]
    qs = np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8)
    return {"qs": qs.reshape(w.shape), "scale": scale}


def pack_q4_1(w: np.ndarray) -> QuantArrays:
    """q4_1 blocks of a float W [..., I] (rows flattened), as ggml quantizes Q4_1: per block
    min = min(w), scale = (max(w) - min) / 15, both rounded to float16 first, nibble = round((w - min) /
    scale) in [0, 15]."""
    w = np.asarray(w, np.float32)
    w = w.reshape(-1, w.shape[-1])
    field_shapes(Q4_1, *w.shape)
    blocks = w.reshape(w.shape[0], -1, BLOCK)
    lo = blocks.min(axis=-1).astype(np.float16)
    scale = ((blocks.max(axis=-1) - lo.astype(np.float32)) / 15.0).astype(np.float16)
    safe = np.where(scale == 0, 1.0, scale.astype(np.float32))[..., None]
    nibbles = np.clip(np.rint((blocks - lo.astype(np.float32)[..., None]) / safe), 0, 15).astype(np.uint8)
    return {"qs": _pack_nibbles(nibbles).reshape(w.shape[0], -1), "scale": scale, "min": lo}


def pack_q5_0(w: np.ndarray) -> QuantArrays:
    """q5_0 blocks of a float W [..., I] (rows flattened), as ggml quantizes Q5_0: the block's value of largest
    magnitude maps to -16, d = that value / -16, q = trunc(w / d + 16.5) in [0, 31], and the scale is d
    rounded to float16."""
    w = np.asarray(w, np.float32)
    w = w.reshape(-1, w.shape[-1])
    field_shapes(Q5_0, *w.shape)
    blocks = w.reshape(w.shape[0], -1, BLOCK)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    d = extreme / np.float32(-16)
    inverse = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, np.float32(1), d))[..., None]
    q = np.clip(np.trunc(blocks * inverse + np.float32(16.5)), 0, 31).astype(np.uint32)
    scale = d.astype(np.float16)
    high = ((q >> 4) << np.arange(BLOCK, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)  # [O, nb]
    qs = np.concatenate([high[..., None].view(np.uint8), _pack_nibbles((q & 0x0F).astype(np.uint8))], axis=-1)
    return {"qs": qs.reshape(w.shape[0], -1), "scale": scale}


def _pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """[..., 32] values in [0, 15] -> [..., 16] bytes, element j low and j + 16 high (ggml's order)."""
    return nibbles[..., : BLOCK // 2] | (nibbles[..., BLOCK // 2 :] << 4)


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """The inverse of `_pack_nibbles`: [..., 16] bytes -> [..., 32] values."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def from_gguf(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> tuple[str, QuantArrays]:
    """(format, arrays) of one GGUF tensor: its raw blocks `data` (uint8, `gguf.GGUFReader`'s
    `tensor.data`) of `ggml_type`, logical `shape` [..., I] in numpy order (rows flattened).

    Raises:
        ValueError: a row length that is not a multiple of 32, or a type `gguf` cannot dequantize.
    """
    kind = gguf.GGMLQuantizationType(ggml_type)
    rows, in_features = int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1])
    fmt = format_of_gguf_type(ggml_type)
    field_shapes(fmt, rows, in_features)
    nb = in_features // BLOCK
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    if kind == gguf.GGMLQuantizationType.Q8_0:
        blocks = raw.reshape(rows, nb, 2 + BLOCK)
        scale = blocks[..., :2].copy().view(np.float16)[..., 0]
        qs = blocks[..., 2:].copy().view(np.int8).reshape(rows, in_features)
        return Q8_0, {"qs": qs, "scale": scale}
    if kind in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        has_min = kind == gguf.GGMLQuantizationType.Q4_1
        blocks = raw.reshape(rows, nb, (4 if has_min else 2) + BLOCK // 2)
        scale = blocks[..., :2].copy().view(np.float16)[..., 0]
        lo = blocks[..., 2:4].copy().view(np.float16)[..., 0] if has_min else (scale * np.float16(-8)).astype(np.float16)
        qs = blocks[..., (4 if has_min else 2) :].reshape(rows, in_features // 2).copy()
        return Q4_1, {"qs": qs, "scale": scale, "min": lo}
    if kind == gguf.GGMLQuantizationType.Q4_K:
        return Q4_1, _from_q4_k(raw, rows, in_features)
    if kind == gguf.GGMLQuantizationType.Q5_0:  # ggml's block: float16 d, then the 20 bytes of our qs
        blocks = raw.reshape(rows, nb, 2 + Q5_0_BLOCK_BYTES)
        scale = blocks[..., :2].copy().view(np.float16)[..., 0]
        return Q5_0, {"qs": blocks[..., 2:].reshape(rows, -1).copy(), "scale": scale}
    w = gguf.quants.dequantize(raw.reshape(rows, -1) if kind not in _FLOAT_TYPES else data, kind)
    return Q8_0, pack_q8_0(np.asarray(w, np.float32).reshape(rows, in_features))


_FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
_QK_K = 256  # elements per k-quant super-block


def _from_q4_k(raw: np.ndarray, rows: int, in_features: int) -> QuantArrays:
    """Q4_K super-blocks (256 elements: float16 d and dmin, 12 bytes of 6-bit sub-block scales and mins,
    128 bytes of nibbles where each 64 elements' 32 bytes hold sub-block 2c in the low nibbles and 2c + 1
    in the high) -> q4_1 per 32-element sub-block: scale d sc, min -dmin m, the nibbles re-packed."""
    if in_features % _QK_K:
        raise ValueError(f"a Q4_K row has a multiple of {_QK_K} elements; this one has {in_features}")
    blocks = raw.reshape(-1, 2 + 2 + 12 + _QK_K // 2)  # [rows * super-blocks, 144]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])  # [n, 8] each
    scale = (d * sc.astype(np.float32)).astype(np.float16)
    lo = (-(dmin * m.astype(np.float32))).astype(np.float16)
    packed = blocks[:, 16:].reshape(-1, 4, BLOCK)  # 4 chunks of 64 elements, 32 bytes each
    values = np.stack([packed & 0x0F, packed >> 4], axis=2).reshape(-1, 8, BLOCK)  # [n, sub-block, 32]
    qs = _pack_nibbles(values).reshape(rows, in_features // 2)
    return {"qs": qs, "scale": scale.reshape(rows, -1), "min": lo.reshape(rows, -1)}


def dequantize(fmt: str, arrays: dict[str, Array]) -> Float[Array, "O I"]:
    """W [O, I] in float32 from format `fmt`'s arrays (jnp; the reference and the XLA fallback)."""
    scale = arrays["scale"].astype(jnp.float32)[..., None]  # [O, nb, 1]
    rows = arrays["qs"].shape[0]
    if fmt == Q8_0:
        qs = arrays["qs"].reshape(rows, -1, BLOCK).astype(jnp.float32)
        return (qs * scale).reshape(rows, -1)
    if fmt == Q5_0:
        blocks = arrays["qs"].reshape(rows, -1, Q5_0_BLOCK_BYTES)
        # bit i of byte k is element 8 k + i's fifth bit (little-endian); byte-wide ops until the float
        fifth = ((blocks[..., :4, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1).reshape(rows, -1, BLOCK)
        packed = blocks[..., 4:]
        q5 = jnp.concatenate([packed & 0x0F, packed >> 4], axis=-1) | (fifth << 4)
        return ((q5.astype(jnp.float32) - 16.0) * scale).reshape(rows, -1)
    packed = arrays["qs"].reshape(rows, -1, BLOCK // 2)
    nibbles = jnp.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(jnp.float32)
    return (nibbles * scale + arrays["min"].astype(jnp.float32)[..., None]).reshape(rows, -1)


def dequantize_numpy(fmt: str, arrays: QuantArrays) -> np.ndarray:
    """`dequantize` in numpy: W [O, I] float32."""
    scale = arrays["scale"].astype(np.float32)[..., None]
    rows = arrays["qs"].shape[0]
    if fmt == Q8_0:
        return (arrays["qs"].reshape(rows, -1, BLOCK).astype(np.float32) * scale).reshape(rows, -1)
    if fmt == Q5_0:
        blocks = arrays["qs"].reshape(rows, -1, Q5_0_BLOCK_BYTES)
        high = np.ascontiguousarray(blocks[..., :4]).view(np.uint32)  # [O, nb, 1], little-endian
        bits = (high >> np.arange(BLOCK, dtype=np.uint32)) & 1
        values = _unpack_nibbles(blocks[..., 4:]).astype(np.int32) + 16 * bits.astype(np.int32) - 16
        return (values.astype(np.float32) * scale).reshape(rows, -1)
    nibbles = _unpack_nibbles(arrays["qs"].reshape(rows, -1, BLOCK // 2)).astype(np.float32)
    return (nibbles * scale + arrays["min"].astype(np.float32)[..., None]).reshape(rows, -1)


def reference_matmul(fmt: str, arrays: dict[str, Array], x: Float[Array, "I T"]) -> Float[Array, "O T"]:
    """W @ x in float32 at full precision over the dequantized W: what every kernel must equal up to
    summation order."""
    return jnp.dot(dequantize(fmt, arrays), x.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def nbytes(arrays: dict[str, Array | np.ndarray]) -> int:
    """Bytes held by one weight's arrays."""
    return sum(int(a.size) * np.dtype(a.dtype).itemsize for a in arrays.values())
