"""Token bitmasks: allocation on the host (numpy) and application to logits inside the jitted sampler.

Layout (llguidance's and xgrammar's): int32 [B, W] with W = ceil(vocab_size / 32); token t of row b is
allowed iff bit `t % 32` of word `bitmask[b, t // 32]` is set. A row of -1 (all bits set) allows every
token, so requests without a grammar share the batch bitmask at no cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from jaxtyping import Array, Bool, Float, Int32

BITS_PER_WORD = 32


def num_bitmask_words(vocab_size: int) -> int:
    """Words per bitmask row: ceil(vocab_size / 32)."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_bitmask(batch_size: int, vocab_size: int) -> Int32[np.ndarray, "B W"]:
    """A host bitmask [batch_size, ceil(vocab_size / 32)] int32 with every token allowed (-1)."""
    return np.full((batch_size, num_bitmask_words(vocab_size)), -1, dtype=np.int32)


def reset_bitmask(bitmask: Int32[np.ndarray, "B W"]) -> None:
    """Allow every token again in every row, in place (reuse one buffer across steps)."""
    bitmask.fill(-1)


def apply_bitmask_jax(logits: Float[Array, "B V"], bitmask: Int32[Array, "B W"]) -> Float[Array, "B V"]:
    """Set the logits of disallowed tokens to -inf. Pure jax.numpy: jittable, shape-static.

    Args:
        logits: [B, V] float (any float dtype; kept).
        bitmask: [B, ceil(V / 32)] int32, bit set = allowed.

    Returns:
        [B, V] logits, disallowed entries -inf.

    Raises:
        ValueError: (at trace time) shapes that do not match.

    Cost: one [B, W, 32] shift-and-and plus a select; elementwise, fused by XLA into the select.
    """
    batch, vocab = logits.shape
    if bitmask.shape != (batch, num_bitmask_words(vocab)):
        expected = (batch, num_bitmask_words(vocab))
        raise ValueError(f"bitmask shape {bitmask.shape} != {expected} for logits {logits.shape}")
    allowed = unpack_bitmask_jax(bitmask, vocab)
    return jnp.where(allowed, logits, jnp.array(-jnp.inf, dtype=logits.dtype))


def unpack_bitmask_jax(bitmask: Int32[Array, "B W"], vocab_size: int) -> Bool[Array, "B V"]:
    """The allowed-token mask [B, vocab_size] bool of a bitmask [B, ceil(vocab_size / 32)] (jittable)."""
    bitmask = jnp.asarray(bitmask, dtype=jnp.int32)
    shifts = jnp.arange(BITS_PER_WORD, dtype=jnp.int32)
    # Arithmetic shift of int32 is fine: only the lowest bit is kept after the shift.
    bits = (bitmask[:, :, None] >> shifts) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(jnp.bool_)


def unpack_bitmask(bitmask: Int32[np.ndarray, "B W"], vocab_size: int) -> Bool[np.ndarray, "B V"]:
    """numpy reference of `unpack_bitmask_jax`: [B, vocab_size] bool."""
    as_bytes = np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8)  # little-endian words
    bits = np.unpackbits(as_bytes, axis=-1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)


def apply_bitmask_numpy(
    logits: Float[np.ndarray, "B V"], bitmask: Int32[np.ndarray, "B W"]
) -> Float[np.ndarray, "B V"]:
    """numpy reference of `apply_bitmask_jax` (returns a new array)."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    return np.where(allowed, logits, np.array(-np.inf, dtype=logits.dtype))


def allowed_token_ids(bitmask_row: Int32[np.ndarray, " W"], vocab_size: int) -> Int32[np.ndarray, " N"]:
    """Sorted ids of the allowed tokens of one bitmask row (host side: tests, debugging)."""
    return np.flatnonzero(unpack_bitmask(bitmask_row[None, :], vocab_size)[0]).astype(np.int32)
