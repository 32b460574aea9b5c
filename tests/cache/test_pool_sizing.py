"""The KV pool's default size: min(1.5 GiB, 10% of available RAM) on CPU, SGLang's fraction elsewhere."""

from __future__ import annotations

import logging

import pytest

from jaxserve.cache import kv_pool
from jaxserve.cache.kv_pool import pool_budget, size_pool

GIB = 1 << 30


@pytest.mark.parametrize("available_gib, expected_gib", [(64, 1.5), (20, 1.5), (12, 1.2), (4, 0.4)])
def test_cpu_default_is_1_5_gib_or_10_percent_of_ram(available_gib, expected_gib):
    b = pool_budget(mem_fraction_static=None, weights_bytes=GIB, platform="cpu", available_bytes=available_gib * GIB)
    assert b.budget_bytes == pytest.approx(expected_gib * GIB, abs=1)
    assert "1.5 GiB" in b.rule and "10%" in b.rule


def test_cpu_with_mem_fraction_static_keeps_the_fraction_rule():
    b = pool_budget(mem_fraction_static=0.3, weights_bytes=GIB, platform="cpu", available_bytes=64 * GIB)
    assert b.budget_bytes == pytest.approx(0.3 * 64 * GIB, abs=1)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_accelerators_keep_sglangs_fraction_minus_the_weights(platform):
    b = pool_budget(mem_fraction_static=None, weights_bytes=10 * GIB, platform=platform, available_bytes=80 * GIB)
    assert b.budget_bytes == pytest.approx(0.85 * 80 * GIB - 10 * GIB, abs=1)
    b = pool_budget(mem_fraction_static=0.5, weights_bytes=10 * GIB, platform=platform, available_bytes=80 * GIB)
    assert b.budget_bytes == pytest.approx(30 * GIB, abs=1)


def test_size_pool_uses_the_rule_and_logs_it(monkeypatch, caplog):
    monkeypatch.setattr(kv_pool, "available_memory_bytes", lambda: 100 * GIB)
    caplog.set_level(logging.INFO, logger="jaxserve.cache.kv_pool")
    # 2 layers x 4 kv heads x 64 dims x 2 (K, V) x 4 bytes = 4 KiB per token
    shape = size_pool(num_layers=2, num_kv_heads=4, head_dim=64, page_size=16, dtype="float32",
                      max_total_tokens=None, mem_fraction_static=None, weights_bytes=0, platform="cpu")
    assert shape.bytes_per_token == 4096
    assert shape.num_tokens == 3 * GIB // 2 // 4096  # 393216: already 3 significant bits
    assert shape.num_tokens * shape.bytes_per_token <= 3 * GIB // 2
    assert "KV pool: 393216 tokens" in caplog.text and "min(1.5 GiB, 10%" in caplog.text
    explicit = size_pool(num_layers=2, num_kv_heads=4, head_dim=64, page_size=16, dtype="float32",
                         max_total_tokens=4096, mem_fraction_static=None, weights_bytes=0, platform="cpu")
    assert explicit.num_tokens == 4096 and "--max-total-tokens" in caplog.text


# 2 layers x 8 kv heads x 64 dims x 2 (K, V) x 4 bytes = 8 KiB per token of the whole pool
TP_POOL = dict(num_layers=2, num_kv_heads=8, head_dim=64, page_size=16, dtype="float32", max_total_tokens=None)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_accelerator_pool_is_sized_per_device_share(platform):
    # each of 4 devices: 16 GiB free x 0.5 - 2 GiB of its weights = 6 GiB, and holds 1/4 of every page
    # (2 of the 8 kv heads): 8 KiB / 4 = 2 KiB per token, so 6 GiB / 2 KiB = 3 x 2^20 tokens
    kwargs = dict(TP_POOL, mem_fraction_static=0.5, weights_bytes=2 * GIB, platform=platform, available_bytes=16 * GIB)
    tp4 = size_pool(**kwargs, pool_shards=4)
    assert tp4.num_tokens == 3 * 2**20
    assert tp4.num_tokens * tp4.bytes_per_token // 4 <= 6 * GIB  # one device's share fits its budget
    tp1 = size_pool(**kwargs)
    assert tp1.num_tokens == 6 * GIB // 8192 == 3 * 2**18


def test_cpu_pool_keeps_its_whole_pool_default_at_any_tp(caplog):
    # host devices share one RAM: min(1.5 GiB, 10% of 64 GiB) for the whole pool, 1.5 GiB / 8 KiB tokens
    caplog.set_level(logging.INFO, logger="jaxserve.cache.kv_pool")
    kwargs = dict(TP_POOL, mem_fraction_static=None, weights_bytes=GIB, platform="cpu", available_bytes=64 * GIB)
    assert size_pool(**kwargs, pool_shards=4).num_tokens == size_pool(**kwargs).num_tokens == 3 * GIB // 2 // 8192
    assert "per device: the pool is split" not in caplog.text


@pytest.mark.parametrize("model_dtype, head_dim, ratio", [("float32", 64, 256 / 68), ("bfloat16", 128, 256 / 132)])
def test_a_compressed_pool_holds_more_tokens_in_the_same_budget(caplog, model_dtype, head_dim, ratio):
    """--kv-cache-dtype int8/fp8: one byte per value and a 4-byte scale per token and kv head, so the same
    budget buys 4 * 64 / 68 = 3.8x the float32 tokens at head_dim 64 and 256 / 132 = 1.9x the bfloat16 ones at
    128; the start-up line names the dtype and the scale."""
    caplog.set_level(logging.INFO, logger="jaxserve.cache.kv_pool")
    common = dict(num_layers=2, num_kv_heads=4, head_dim=head_dim, page_size=16, max_total_tokens=None,
                  mem_fraction_static=0.5, weights_bytes=0, platform="cpu", available_bytes=2 * GIB)
    plain = size_pool(dtype=model_dtype, **common)
    compressed = size_pool(dtype="int8", scale_bytes=4, **common)
    assert compressed.bytes_per_token == 2 * 2 * 4 * (head_dim + 4)
    assert compressed.bytes_per_token * ratio == pytest.approx(plain.bytes_per_token)
    # both sizes are rounded down to 3 significant bits
    assert compressed.num_tokens / plain.num_tokens == pytest.approx(ratio, rel=0.25)
    assert compressed.num_tokens * compressed.bytes_per_token <= GIB
    assert "int8 with a 4-byte scale per token and kv head" in caplog.text
    assert (compressed.host_dtype.name, compressed.host_head_dim) == ("uint8", head_dim + 4)
    assert (plain.host_dtype.name, plain.host_head_dim) == (model_dtype, head_dim)
