import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.constrained.bitmask import (
    allocate_bitmask,
    allowed_token_ids,
    apply_bitmask_jax,
    apply_bitmask_numpy,
    num_bitmask_words,
    unpack_bitmask,
)


def _bit_loop_reference(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    out = np.zeros((bitmask.shape[0], vocab_size), dtype=bool)
    for b in range(bitmask.shape[0]):
        for t in range(vocab_size):
            out[b, t] = (int(bitmask[b, t // 32]) >> (t % 32)) & 1
    return out


def _random_bitmask(rng, batch, vocab):
    words = rng.integers(-(2**31), 2**31, size=(batch, num_bitmask_words(vocab)), dtype=np.int64)
    bitmask = words.astype(np.int32)
    bitmask[0] = -1  # a row without a grammar
    if batch > 1:
        bitmask[1] = 0
        bitmask[1, 0] = 1 << 2  # only token 2 (EOS-like)
    return bitmask


def test_allocate_bitmask():
    bitmask = allocate_bitmask(3, 49152 + 5)
    assert bitmask.dtype == np.int32 and bitmask.shape == (3, 1537)
    assert (bitmask == -1).all()
    assert unpack_bitmask(bitmask, 49157).all()


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 1000])
def test_unpack_matches_bit_loop(vocab):
    bitmask = _random_bitmask(np.random.default_rng(vocab), 3, vocab)
    assert (unpack_bitmask(bitmask, vocab) == _bit_loop_reference(bitmask, vocab)).all()


@pytest.mark.parametrize("vocab", [32, 100, 1000, 49152, 49155])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_apply_bitmask_jax_matches_numpy_under_jit(vocab, dtype):
    rng = np.random.default_rng(vocab)
    batch = 4
    bitmask = _random_bitmask(rng, batch, vocab)
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)
    out = jax.jit(apply_bitmask_jax)(jnp.asarray(logits, dtype=dtype), jnp.asarray(bitmask))
    assert out.shape == (batch, vocab) and out.dtype == dtype
    expected = apply_bitmask_numpy(np.asarray(jnp.asarray(logits, dtype=dtype).astype(jnp.float32)), bitmask)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), expected)
    assert np.isneginf(np.asarray(out[1], dtype=np.float32)[np.arange(vocab) != 2]).all()


def test_apply_bitmask_jax_rejects_wrong_width():
    with pytest.raises(ValueError, match="bitmask shape"):
        apply_bitmask_jax(jnp.zeros((2, 100)), jnp.zeros((2, 3), dtype=jnp.int32))


def test_allowed_token_ids():
    row = np.zeros(2, dtype=np.int32)
    row[0] = np.int32(1 << 5) | np.int32(-(2**31))  # tokens 5 and 31
    row[1] = 1  # token 32
    assert allowed_token_ids(row, 40).tolist() == [5, 31, 32]
    assert allowed_token_ids(row, 32).tolist() == [5, 31]
