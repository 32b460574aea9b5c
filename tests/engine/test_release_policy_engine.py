"""The KV release policy end to end on the tiny random Llama: it changes where KV lives, never outputs.

Greedy outputs are compared between the plain LRU cache, aggressive soft release (threshold 0 s, so
every unlocked node leaves the device between waves and the next wave recalls it), and coalescing at
page_size 16; cached_tokens at page_size 16 with coalescing equal those at page_size 1. Every batch is
checked to write only private pages (frozen prefixes are read-only).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.cache.freezing import frozen_write_violations
from jaxserve.engine.engine import Engine

GREEDY = {"max_new_tokens": 8, "temperature": 0}
AGGRESSIVE = dict(release_conservative_batch_size=0, release_aggressive_batch_size=0)


def make_engine(model_dir, **kwargs) -> Engine:
    base = dict(
        model_path=model_dir, max_total_tokens=2048, max_running_requests=8, chunked_prefill_size=64,
        context_length=128, page_size=16, disable_precompile=True,
        prefill_decode_itl_ratio=0,  # no time-based prefill budget: the schedule (and so retractions, recalls) must not depend on load
    )
    base.update(kwargs)
    engine = Engine(**base)
    forward = engine.runner.forward

    def checked_forward(entries, *args, **kw):
        writes = [(e.page_table, e.prefix_len, len(e.token_ids)) for e in entries]
        assert frozen_write_violations(engine.cache.tree, writes) == [], "a batch writes into a cached page"
        return forward(entries, *args, **kw)

    engine.runner.forward = checked_forward
    return engine


def waves(seed: int = 0) -> list[list[list[int]]]:
    """Two waves of prompts sharing a 40-token system prompt; the second repeats and extends the first."""
    rng = np.random.default_rng(seed)
    system = list(map(int, rng.integers(3, 40000, 40)))
    first = [system + list(map(int, rng.integers(3, 40000, int(rng.integers(1, 30))))) for _ in range(6)]
    second = [p + list(map(int, rng.integers(3, 40000, 3))) for p in first[:3]] + first[3:] + [system[:23]]
    return [first, second]


def run_waves(engine: Engine, prompt_waves) -> tuple[list[list[int]], list[int]]:
    outputs, cached = [], []
    for prompts in prompt_waves:
        for out in engine.generate(prompts, GREEDY):
            outputs.append(out["output_ids"])
            cached.append(out["meta_info"]["cached_tokens"])
        engine.step()  # an idle iteration: the policy's tick runs between the waves
    engine.cache.check_integrity([])
    return outputs, cached


@pytest.fixture(scope="module")
def plain_engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def baseline(plain_engine):
    outputs, cached = run_waves(plain_engine, waves())
    plain_engine.flush_cache()
    return outputs, cached


def test_soft_release_and_recall_keep_outputs(tiny_model_dir, baseline):
    engine = make_engine(
        tiny_model_dir, enable_hierarchical_cache=True, radix_cache_soft_free_threshold=0.0,
        radix_cache_evict_threshold=0.0, **AGGRESSIVE,
    )
    outputs, cached = run_waves(engine, waves())
    assert outputs == baseline[0]
    assert cached == baseline[1]  # a recall is a cache hit
    stats = engine.radix_cache_stats()
    assert stats.num_recalls > 0 and stats.host_hit_tokens > 0 and stats.recalled_bytes > 0
    assert len(stats.recall_latency_s) == stats.num_recalls
    assert engine.stats.release_mode == "aggressive"
    engine.flush_cache()
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_usable and engine.cache.policy.host.num_used == 0


def test_pressure_soft_release_keeps_outputs(tiny_model_dir, baseline):
    # a pool of 10 pages: eviction under pressure moves cold prefixes to the host tier
    engine = make_engine(tiny_model_dir, max_total_tokens=160, enable_hierarchical_cache=True, max_running_requests=2)
    outputs, _ = run_waves(engine, waves())
    assert outputs == baseline[0]
    stats = engine.radix_cache_stats()
    assert stats.soft_freed_bytes > 0 and stats.num_recalls > 0


def test_coalescing_keeps_outputs_and_matches_page_size_1(tiny_model_dir, baseline):
    # every short tail kept (the defaults keep only tails of <= 8 tokens below a mostly shared path)
    engine = make_engine(tiny_model_dir, enable_auto_merge=True, merge_max_suffix_tokens=15, merge_min_shared_ratio=0.0, **AGGRESSIVE)
    outputs, cached = run_waves(engine, waves())
    assert outputs == baseline[0]
    stats = engine.radix_cache_stats()
    assert stats.cow_hit_tokens > 0 and stats.merge_count >= 0
    ps1 = make_engine(tiny_model_dir, page_size=1)
    outputs1, cached1 = run_waves(ps1, waves())
    assert outputs1 == baseline[0]
    assert cached == cached1
    assert sum(cached) > sum(baseline[1])  # plain page_size 16 drops the partly matched pages


def test_adaptive_mode_in_engine_stats(plain_engine):
    import dataclasses

    policy = plain_engine.cache.policy
    policy.config = dataclasses.replace(policy.config, conservative_batch_size=2, aggressive_batch_size=4)
    plain_engine.add_request([5, 6, 7], {"max_new_tokens": 30, "temperature": 0})
    plain_engine.step()
    plain_engine.step()
    assert plain_engine.stats.release_mode == "conservative"
    for i in range(4):
        plain_engine.add_request([8 + i, 9, 10], {"max_new_tokens": 30, "temperature": 0})
    for _ in range(4):
        plain_engine.step()
    assert plain_engine.scheduler.num_running >= 4 and plain_engine.stats.release_mode == "aggressive"
    while plain_engine.has_unfinished():
        plain_engine.step()


@pytest.mark.slow
def test_default_model_outputs_identical_with_the_policy_on():
    prompt_waves = [[p[:60] for p in wave] for wave in waves(seed=3)]
    common = dict(max_total_tokens=1024, max_running_requests=4, chunked_prefill_size=64, context_length=128,
                  page_size=16, disable_precompile=True)
    results = []
    for extra in (
        {},
        dict(enable_hierarchical_cache=True, radix_cache_soft_free_threshold=0.0, radix_cache_evict_threshold=0.0, **AGGRESSIVE),
        dict(enable_auto_merge=True, **AGGRESSIVE),
    ):
        engine = make_engine("default", **common, **extra)
        results.append(run_waves(engine, prompt_waves))
        stats = engine.radix_cache_stats()
        if extra.get("enable_hierarchical_cache"):
            assert stats.num_recalls > 0
        if extra.get("enable_auto_merge"):
            assert stats.cow_hit_tokens > 0
        del engine
    assert results[1][0] == results[0][0] and results[2][0] == results[0][0]
    assert results[1][1] == results[0][1]


def test_a_compressed_pool_moves_its_bytes_through_the_host_tier(tiny_model_dir):
    """--kv-cache-dtype int8 with aggressive soft release: every recall restores the 8-bit values and their
    scales, so outputs and cached_tokens equal the same compressed pool's without a host tier, and the host
    tier holds the compressed pages' bytes (values and scale, `PoolShape.row_bytes`), not float32 ones."""
    plain = make_engine(tiny_model_dir, kv_cache_dtype="int8")
    expected = run_waves(plain, waves())
    plain.close()
    engine = make_engine(
        tiny_model_dir, kv_cache_dtype="int8", enable_hierarchical_cache=True, radix_cache_soft_free_threshold=0.0,
        radix_cache_evict_threshold=0.0, **AGGRESSIVE,
    )
    assert run_waves(engine, waves()) == expected
    stats = engine.radix_cache_stats()
    assert stats.num_recalls > 0 and stats.host_hit_tokens > 0
    shape, host = engine.runner.pool_shape, engine.cache.policy.host
    assert (shape.dtype, shape.scale_bytes) == ("int8", 4)
    assert host.k.dtype == np.uint8 and host.k.shape[-1] == shape.head_dim + 4
    assert host.bytes_per_page == shape.bytes_per_token * shape.page_size
    engine.close()
