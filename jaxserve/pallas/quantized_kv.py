"""The compressed KV pool (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2 | int8`): 8-bit K/V with one float32
scale per token and kv head.

A quantized pool is a `QuantizedKV` pytree in place of the plain `[L, N, KVH, ps, D]` array: `data` (the 8-bit
values, fp8 ones as their uint8 bits) and `scale` `[L, N, KVH, ps]`, so every function that carries the pools (the layer scan's
carry, donation, shard_map over kv heads, page copies by `jax.tree.map`) carries it unchanged. Three
places read inside it:

- the step writes each new token's K/V through `quantize_rows`: the row's absolute maximum over
  `head_dim` becomes the dtype's largest value (llama.cpp's `-ctk/-ctv q8_0` keeps one scale per 32
  values; one per row of `head_dim` costs 4 bytes per 64-128 values and reads as one number per key);
- attention (XLA and Pallas) reads the 8-bit values and folds the scales into its scores and
  probabilities (`s = (q . k) * k_scale`, `p * v_scale` before `p @ v`), so no dequantized copy of a
  page is made;
- the host and storage tiers keep a page as bytes (`pack_pages`: the 8-bit values then the scale's 4
  bytes on each row), so they store what the device stores.

Bytes per token and kv head: `head_dim + 4` against `4 * head_dim` in float32 (3.8x the tokens at
head_dim 64) and `2 * head_dim` in bfloat16 (1.9x at 64 and at 128). Decision D-48.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int32

# --kv-cache-dtype's quantized values -> the pool's storage dtype (SGLang's spellings, plus llama.cpp's q8_0 idea
# as int8)
KV_QUANT_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "int8": "int8"}
# the largest finite value of each storage dtype: a row's absolute maximum is scaled onto it
_DTYPE_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}
SCALE_BYTES = 4  # one float32 scale per token and kv head


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "scale"], meta_fields=["format"])
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """One compressed pool (K or V).

    Fields:
        data: [L, N, KVH, ps, D] the 8-bit values' bits: int8, or uint8 holding an fp8 value's bits (XLA:CPU
            scattered into and gathered from an fp8 array 400-1000x slower than from a uint8 one: D-48).
        scale: [L, N, KVH, ps] float32; a row's value is `values * scale`.
        format: the values' dtype name, a value of `KV_QUANT_DTYPES` (static).

    `shape` is the data's, so code that reads a pool's geometry (page size, kv heads) reads either kind of
    pool; `dtype` is the values' dtype.
    """

    data: jax.Array
    scale: jax.Array
    format: str = "int8"

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self):
        return jnp.dtype(self.format)

    @property
    def nbytes(self) -> int:
        """Bytes of the values and the scales."""
        return self.data.nbytes + self.scale.nbytes

    @staticmethod
    def of(values: Array, scale: Array) -> "QuantizedKV":
        """The pool holding `values` (in one of `KV_QUANT_DTYPES`'s dtypes) and `scale`."""
        fmt = jnp.dtype(values.dtype).name
        data = values if fmt == "int8" else jax.lax.bitcast_convert_type(values, jnp.uint8)
        return QuantizedKV(data, scale, fmt)

    def values(self, x: Array) -> Array:
        """`x`, some of `data`, as values of `format` (a bitcast; the data of an int8 pool as it is)."""
        return x if self.format == "int8" else jax.lax.bitcast_convert_type(x, self.dtype)

    def bits(self, values: Array) -> Array:
        """Values of `format` as `data` stores them (the inverse of `values`)."""
        return values if self.format == "int8" else jax.lax.bitcast_convert_type(values, jnp.uint8)


def is_quantized(pool) -> bool:
    return isinstance(pool, QuantizedKV)


def allocate_pools(shape: tuple[int, ...], dtype: str) -> tuple:
    """Zero-filled K and V pools `[L, N, KVH, ps, D]` of `dtype` on the default device: plain arrays for a
    float dtype, `QuantizedKV` for one of `KV_QUANT_DTYPES`'s storage dtypes."""
    if dtype not in _DTYPE_MAX:
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    bits = jnp.int8 if dtype == "int8" else jnp.uint8
    return tuple(QuantizedKV(jnp.zeros(shape, bits), jnp.zeros(shape[:-1], jnp.float32), dtype) for _ in range(2))


def quantize_rows(x: Float[Array, "... D"], dtype) -> tuple[Array, Float[Array, "..."]]:
    """Each row of `x` (the last axis) as `dtype` values and one float32 scale: `x ~= values * scale`.

    The row's absolute maximum maps to the dtype's largest value (`_DTYPE_MAX`); int8 rounds to nearest,
    fp8 rounds by the cast. A zero row gets scale 0 and zeros."""
    dtype = jnp.dtype(dtype)
    x32 = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x32), axis=-1) * jnp.float32(1.0 / _DTYPE_MAX[dtype.name])  # one rounding, as XLA folds
    scaled = x32 / jnp.where(scale > 0, scale, 1.0)[..., None]
    if dtype == jnp.int8:
        scaled = jnp.clip(jnp.round(scaled), -127, 127)
    return scaled.astype(dtype), scale


def dequantize_rows(values: Array, scale: Float[Array, "..."]) -> Float[Array, "... D"]:
    """`values * scale` in float32 (the inverse of `quantize_rows`; tests and references)."""
    return values.astype(jnp.float32) * scale[..., None]


def write_rows(pool, layer: Int32[Array, ""], page: Int32[Array, " T"], slot: Int32[Array, " T"],
               x: Float[Array, "T KVH D"]):
    """`pool` with the rows `x` written at (layer, page[t], :, slot[t]); out-of-range pages are dropped."""
    if not is_quantized(pool):
        return pool.at[layer, page, :, slot].set(x.astype(pool.dtype), mode="drop")
    values, scale = quantize_rows(x, pool.dtype)
    return QuantizedKV(pool.data.at[layer, page, :, slot].set(pool.bits(values), mode="drop"),
                       pool.scale.at[layer, page, :, slot].set(scale, mode="drop"), pool.format)


def pack_pages(pages):
    """Pages `[L, n, KVH, ps, D]` of a pool as the host tiers store them: a plain array as it is; a
    `QuantizedKV`'s as uint8 `[L, n, KVH, ps, D + 4]`, each row's 8-bit values then its scale's bytes."""
    if not is_quantized(pages):
        return pages
    data = jax.lax.bitcast_convert_type(pages.data, jnp.uint8)
    scale = jax.lax.bitcast_convert_type(pages.scale, jnp.uint8)  # [..., 4]
    return jnp.concatenate([data, scale], axis=-1)


def unpack_pages(packed, like):
    """The inverse of `pack_pages` for pages of the pool `like` (its dtypes)."""
    if not is_quantized(like):
        return packed.astype(like.dtype)
    head_dim = like.data.shape[-1]
    data = jax.lax.bitcast_convert_type(packed[..., :head_dim], like.data.dtype)
    scale = jax.lax.bitcast_convert_type(packed[..., head_dim:], jnp.float32)
    return QuantizedKV(data, scale, like.format)


def unpack_pages_numpy(packed: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """`pack_pages`'s bytes on the host as (values in `dtype`, float32 scales) (tests and tools)."""
    import ml_dtypes  # jax's own dependency, which gives numpy the fp8 dtypes

    head_dim = packed.shape[-1] - SCALE_BYTES
    np_dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
    values = np.ascontiguousarray(packed[..., :head_dim]).view(np_dtype)
    scale = np.ascontiguousarray(packed[..., head_dim:]).view(np.float32)[..., 0]
    return values, scale
