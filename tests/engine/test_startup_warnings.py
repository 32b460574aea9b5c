"""Start-up warnings of the Engine: a KV pool smaller than the context, speculative flags that do nothing."""

from __future__ import annotations

import logging

from tests.engine.test_model_limits import make_engine


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("jaxserve.engine")]  # the engine, its config


def test_small_pool_and_idle_speculative_flags_warn(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine"):
        make_engine(tiny_model_dir, context_length=256, max_total_tokens=256)
    assert _warnings(caplog) == []
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine"):
        make_engine(tiny_model_dir, speculative_num_draft_tokens=5)  # pool 128 < context 512
    warnings = _warnings(caplog)
    assert any("128 tokens, fewer than the context length 512" in w for w in warnings), warnings
    assert any(w.startswith("--speculative-num-draft-tokens given without --speculative-algorithm") for w in warnings), warnings


def test_radix_cache_flags_with_the_radix_cache_off_warn(tiny_model_dir, caplog):
    """--enable-hierarchical-cache --enable-auto-merge with --disable-radix-cache started silently and did nothing."""
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine"):
        make_engine(tiny_model_dir, enable_hierarchical_cache=True, enable_auto_merge=True)
    assert not any("--disable-radix-cache" in w for w in _warnings(caplog))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine"):
        make_engine(tiny_model_dir, disable_radix_cache=True, enable_hierarchical_cache=True, enable_auto_merge=True)
    assert "--enable-hierarchical-cache, --enable-auto-merge given with --disable-radix-cache: ignored " \
        "(there are no radix-cache nodes to move or merge)" in _warnings(caplog), _warnings(caplog)


def test_speculation_with_no_batch_size_allowed_warns(tiny_model_dir, caplog):
    """--speculative-max-batch-size 0 started silently; speculation never ran and its stats said 0.00."""
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine"):
        make_engine(tiny_model_dir, speculative_algorithm="NGRAM", speculative_max_batch_size=0)
    assert "--speculative-max-batch-size 0: no decode step verifies drafts (speculation is off)" in _warnings(caplog)

