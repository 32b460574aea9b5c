"""Shape buckets of the model runner: every batch lands in the smallest precompiled bucket that fits."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.cache.kv_pool import PoolShape
from jaxserve.runner.buckets import EXTEND_BLOCK_Q, extend_token_buckets, layers_per_call
from jaxserve.runner.model_runner import ModelRunner

PAGE_SIZE = 16
POOL_SHAPE = PoolShape(1, 2, PAGE_SIZE, 1, 8, "float32").shape


def make_runner(max_seqs: int, max_extend: int, context: int) -> ModelRunner:
    pool = jnp.zeros(POOL_SHAPE, jnp.float32)  # bucket arithmetic never reads it
    return ModelRunner(None, None, pool, pool, attn_fn=None, max_running_requests=max_seqs,
                       max_extend_tokens=max_extend, context_length=context)


def test_extend_token_buckets_pad_by_at_most_half_then_a_third():
    buckets = extend_token_buckets(EXTEND_BLOCK_Q, 8192)
    assert buckets == sorted(set(buckets)) and buckets[0] == EXTEND_BLOCK_Q and buckets[-1] == 8192
    for n in range(1, 8193):
        t = next(b for b in buckets if b >= n)
        assert t < 2 * n or t == EXTEND_BLOCK_Q
        if n > 128:
            assert t < 1.5 * n, (n, t)


@settings(max_examples=200, deadline=None)
@given(
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=8),
    pages=st.integers(1, 8192 // PAGE_SIZE),
    context=st.sampled_from([1024, 8192]),
)
def test_bucket_for_is_the_smallest_precompiled_bucket_that_fits(lens, pages, context):
    runner = make_runner(max_seqs=8, max_extend=512, context=context)
    if pages > runner.max_pages or sum(lens) > runner.max_extend_tokens:
        with pytest.raises(ValueError):
            runner.bucket_for(lens, pages)
        return
    key = runner.bucket_for(lens, pages)
    buckets = runner.all_buckets()
    assert key in buckets
    assert key.num_tokens >= sum(lens) and key.num_seqs >= len(lens) and key.pages_per_seq >= pages
    same_kind = [b for b in buckets if b.block_q == key.block_q]
    fitting = [b for b in same_kind if b.num_tokens >= sum(lens) and b.num_seqs >= len(lens) and b.pages_per_seq >= pages]
    assert key == min(fitting, key=lambda b: (b.num_tokens, b.pages_per_seq))
    assert (key.block_q == 1) == all(n == 1 for n in lens)


def test_page_buckets_start_at_4096_tokens():
    short = make_runner(max_seqs=64, max_extend=512, context=2048)
    assert {b.pages_per_seq for b in short.all_buckets()} == {2048 // PAGE_SIZE}
    long = make_runner(max_seqs=64, max_extend=512, context=32768)
    assert sorted({b.pages_per_seq for b in long.all_buckets()}) == [256, 512, 1024, 2048]


@given(num_layers=st.integers(1, 128), most=st.integers(1, 8))
def test_layers_per_call_is_the_largest_divisor_within_the_limit(num_layers, most):
    g = layers_per_call(num_layers, most)
    assert 1 <= g <= most and num_layers % g == 0
    assert all(num_layers % d for d in range(g + 1, most + 1))  # no larger divisor fits


def test_layers_per_call_of_common_depths():
    assert [layers_per_call(n) for n in (30, 32, 24, 28, 22, 2)] == [5, 4, 4, 4, 2, 2]


def test_small_extend_buckets_have_blocks_of_their_size():
    """Speculative verification's 2-8 token buckets: query blocks as wide as the bucket, not 16 rows."""
    pool = jnp.zeros(POOL_SHAPE, jnp.float32)
    runner = ModelRunner(None, None, pool, pool, attn_fn=None, max_running_requests=8, max_extend_tokens=512,
                         context_length=1024, min_extend_tokens=2)
    assert [runner.bucket_for(lens, 4).block_q for lens in ([2], [3], [1, 4], [6, 1, 1], [9], [300])] == [2, 4, 8, 8, 16, 16]
    assert {(b.num_tokens, b.block_q) for b in runner.all_buckets() if b.block_q > 1 and b.num_tokens <= 16} == {
        (2, 2), (4, 4), (8, 8), (16, 16)}
