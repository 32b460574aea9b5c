"""PrefillBudget: the prefill tokens beside running decodes follow the measured step costs."""

from __future__ import annotations

from jaxserve.engine.prefill_budget import PrefillBudget


def test_budget_from_measured_costs():
    b = PrefillBudget(itl_ratio=3.0, min_tokens=8, max_tokens=512)
    assert b.budget(0) == 512  # nothing to stall
    assert b.budget(4) == 8  # nothing measured yet: the minimum
    b.observe(num_decodes=0, num_prefill_tokens=100, seconds=1.0)  # 10 ms per prompt token
    b.observe(num_decodes=4, num_prefill_tokens=0, seconds=0.05)  # a 4-decode step: 50 ms
    # (3 - 1) x 50 ms / 10 ms = 10 tokens
    assert b.budget(4) == 10
    assert b.budget(3) == 10  # same decode bucket (4)
    assert b.budget(2) == 8  # bucket 2 not measured, no smaller one: the minimum
    b.observe(num_decodes=16, num_prefill_tokens=0, seconds=0.5)
    assert b.budget(16) == 100  # a longer decode step absorbs a larger chunk
    assert b.budget(9) == 100  # same bucket (16)
    assert b.budget(5) == 10  # bucket 8 not measured: the nearest smaller measured bucket (4)


def test_budget_clamped_and_off():
    b = PrefillBudget(itl_ratio=2.0, min_tokens=16, max_tokens=64)
    b.observe(0, 10, 0.001)
    b.observe(8, 0, 1.0)
    assert b.budget(8) == 64
    off = PrefillBudget(itl_ratio=0.0, min_tokens=16, max_tokens=64)
    off.observe(8, 0, 1.0)
    assert off.budget(8) == 64


def test_mixed_step_marginal_cost():
    b = PrefillBudget(itl_ratio=2.0, min_tokens=1, max_tokens=1000)
    b.observe(4, 0, 0.1)
    b.observe(4, 50, 0.6)  # (0.6 - 0.1) / 50 = 10 ms per token
    assert b.budget(4) == 10
