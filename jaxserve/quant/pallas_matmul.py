"""W @ x for a block-quantized W (formats.py: q8_0, q4_1, q5_0) as one Pallas kernel: Triton on GPU, interpret mode on
CPU (tests).

The GPU twin of the CPU kernel (quant_matmul.cc): the weights stay in their blocks in device memory and each
program decodes its tile of them in registers, so a decode step reads the compressed bytes once instead of a
float copy.

Kernel layout:
- Grid `(O / BO, T / BT)`: one program per tile of `BO` output rows and `BT` tokens (T padded to `BT` >= 16,
  Triton's smallest dot).
- The program walks the input axis one 32-input block at a time: it loads the block's values of its `BO` rows
  (int8 for q8_0; 16 bytes of nibbles for q4_1) and their float16 scale (and min), scales them in float32,
  and accumulates `W_block [BO, 32] @ x_block [32, BT]` in float32. A q4_1 block is two dots of 16 inputs,
  its low nibbles (inputs 0-15) and its high ones (16-31), in ggml's order, plus `min * sum(x_block)`; a
  q5_0 block the same two dots with each nibble's fifth bit added (its 4 bytes of bits read one by one).
- The dots run in float32 at IEEE precision (not TF32), so results equal `formats.reference_matmul` up to
  summation order, as the CPU kernel's do.

One block per loop step keeps every load a power of two for any input size (a multiple of 32); wider steps
and bfloat16 dots are for the day a GPU is lent to measure them (`scripts/gpu_check.py` times this kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxserve.quant import formats

_MIN_DOT = 16  # Triton's dots need M, N, K >= 16
_BLOCK_OUT = 64
_NUM_WARPS = 4


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _kernel(x_ref, qs_ref, scale_ref, *rest, fmt: str, block_out: int, block_tokens: int, num_blocks: int):
    from jax.experimental import pallas as pl

    min_ref, o_ref = rest if fmt == formats.Q4_1 else (None, rest[0])
    rows = pl.ds(pl.program_id(0) * block_out, block_out)
    tokens = pl.ds(pl.program_id(1) * block_tokens, block_tokens)
    half = formats.BLOCK // 2
    precision = jax.lax.Precision.HIGHEST

    def dot(w, x):
        return jax.lax.dot_general(w, x, (((1,), (0,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    def body(b, acc):
        scale = scale_ref[rows, b].astype(jnp.float32)  # [BO]
        if fmt == formats.Q8_0:
            w = qs_ref[rows, pl.ds(b * formats.BLOCK, formats.BLOCK)].astype(jnp.float32) * scale[:, None]
            return acc + dot(w, x_ref[pl.ds(b * formats.BLOCK, formats.BLOCK), tokens])
        x_low = x_ref[pl.ds(b * formats.BLOCK, half), tokens]
        x_high = x_ref[pl.ds(b * formats.BLOCK + half, half), tokens]
        if fmt == formats.Q5_0:  # 4 bytes of fifth bits, then 16 of nibbles
            start = b * formats.Q5_0_BLOCK_BYTES
            fifth = sum(qs_ref[rows, start + i].astype(jnp.uint32) << (8 * i) for i in range(4))  # [BO]
            packed = qs_ref[rows, pl.ds(start + 4, half)].astype(jnp.int32)
            shifts = jnp.arange(half, dtype=jnp.uint32)

            def values(nibbles, first):  # nibble + 16 * fifth bit - 16, in float32
                bits = ((fifth[:, None] >> (shifts[None, :] + first)) & 1).astype(jnp.int32)
                return (nibbles + 16 * bits - 16).astype(jnp.float32) * scale[:, None]

            return acc + dot(values(packed & 0x0F, 0), x_low) + dot(values(packed >> 4, half), x_high)
        packed = qs_ref[rows, pl.ds(b * half, half)]  # [BO, 16] bytes: inputs j (low) and j + 16 (high)
        low = (packed & 0x0F).astype(jnp.float32) * scale[:, None]
        high = (packed >> 4).astype(jnp.float32) * scale[:, None]
        block_min = min_ref[rows, b].astype(jnp.float32)
        x_sum = jnp.sum(x_low, axis=0) + jnp.sum(x_high, axis=0)  # [BT]
        return acc + dot(low, x_low) + dot(high, x_high) + block_min[:, None] * x_sum[None, :]

    acc = jnp.zeros((block_out, block_tokens), jnp.float32)
    o_ref[...] = jax.lax.fori_loop(0, num_blocks, body, acc)


def quant_matmul_pallas(
    fmt: str, arrays: dict[str, Array], x: Float[Array, "I T"], *, interpret: bool | None = None
) -> Float[Array, "O T"]:
    """W @ x in float32 for W [O, I] in format `fmt` (`arrays`: its fields, formats.FIELDS) and x [I, T].

    `interpret`: None runs the compiled Triton kernel on GPU and interpret mode elsewhere (slow: tests only).
    Equals `formats.reference_matmul` up to float32 summation order.

    Raises:
        ValueError: an unknown format, or arrays whose shapes do not fit it.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    out_features, in_features = arrays["qs"].shape[0], x.shape[0]
    expected = formats.field_shapes(fmt, out_features, in_features)  # raises on an unknown format
    for name, (shape, dtype) in expected.items():
        if tuple(arrays[name].shape) != shape or arrays[name].dtype != dtype:
            raise ValueError(f"{fmt} field {name!r}: {arrays[name].shape} {arrays[name].dtype}, expected {shape} {dtype}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    num_tokens = x.shape[1]
    block_tokens = max(_MIN_DOT, min(64, _next_pow2(num_tokens)))
    padded_tokens = -(-num_tokens // block_tokens) * block_tokens
    block_out = min(_BLOCK_OUT, max(_MIN_DOT, _next_pow2(out_features)))
    padded_out = -(-out_features // block_out) * block_out
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, padded_tokens - num_tokens)))
    fields = [arrays[name] for name in formats.FIELDS[fmt]]
    if padded_out != out_features:  # padding rows decode to zeros (scale 0, min 0)
        fields = [jnp.pad(a, ((0, padded_out - out_features), (0, 0))) for a in fields]
    full = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731
    kernel = functools.partial(_kernel, fmt=fmt, block_out=block_out, block_tokens=block_tokens,
                               num_blocks=in_features // formats.BLOCK)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((padded_out, padded_tokens), jnp.float32),
        grid=(padded_out // block_out, padded_tokens // block_tokens),
        in_specs=[full(xp), *(full(a) for a in fields)],
        out_specs=pl.BlockSpec((block_out, block_tokens), lambda i, j: (i, j)),
        compiler_params=pl_triton.CompilerParams(num_warps=_NUM_WARPS, num_stages=2),
        interpret=interpret,
        name=f"quant_matmul_{fmt}",
    )(xp, *fields)
    return out[:out_features, :num_tokens]
