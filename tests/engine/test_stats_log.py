"""SGLang's Prefill batch log line (engine/stats_log.py), from a real engine's steps."""

from __future__ import annotations

import logging
import re
import time
from types import SimpleNamespace

import pytest

from jaxserve.engine.engine import Engine
from jaxserve.engine.stats_log import PrefillStats, prefill_stats

LINE = re.compile(r"^Prefill batch\. #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+), token usage: "
                  r"(\d+\.\d\d), #running-req: (\d+), #queue-req: (\d+)$")


def test_prefill_stats_count_only_the_entries_that_are_not_decoding():
    decoding, new, chunk = SimpleNamespace(kv_len=30), SimpleNamespace(kv_len=16), SimpleNamespace(kv_len=64)
    stats = prefill_stats([decoding, new, chunk], [1, 20, 32], running=[decoding])
    assert stats == PrefillStats(num_new_seqs=2, num_new_tokens=52, num_cached_tokens=80)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(model_path=tiny_model_dir, max_total_tokens=2048, context_length=256, disable_precompile=True)


def _prefill_lines(caplog) -> list[tuple[int, ...]]:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Prefill batch")]
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    return [tuple(int(g) if "." not in g else float(g) for g in m.groups()) for m in parsed]


def test_one_prefill_line_per_prefill_step_with_sglangs_fields(engine, caplog):
    engine.flush_cache()
    prompt = list(range(5, 45))  # 40 tokens
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.engine"):
        engine.generate([prompt], {"max_new_tokens": 3, "ignore_eos": True})
    lines = _prefill_lines(caplog)
    assert len(lines) == 1, lines  # three decode steps log none
    new_seq, new_token, cached, usage, running, queue = lines[0]
    assert (new_seq, new_token, cached, running, queue) == (1, 40, 0, 0, 0)
    assert 0 <= usage <= 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.engine"):
        engine.generate([prompt], {"max_new_tokens": 1})
    (new_seq, new_token, cached, _, _, _), = _prefill_lines(caplog)
    assert new_seq == 1 and cached > 0 and new_token + cached == 40  # the prefix cache hit is counted


def test_gen_throughput_after_idle_leaves_the_idle_time_out(tiny_model_dir, caplog):
    """The first Decode batch line after an idle pause averaged over the pause (0.25 tok/s): its window
    now opens at the interval's first decode step, so it lies inside the generate call that ran it."""
    eng = Engine(model_path=tiny_model_dir, max_total_tokens=2048, context_length=256, disable_precompile=True,
                 decode_log_interval=4)
    params = {"max_new_tokens": 5, "ignore_eos": True}  # the prefill's token, then 4 decode steps: one line
    eng.generate([[5, 6, 7]], params)
    time.sleep(1.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.engine"):
        start = time.perf_counter()
        eng.generate([[8, 9, 10]], params)
        wall = time.perf_counter() - start
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch")]
    assert len(lines) == 1, lines
    # the window holds the tokens of the interval's steps before the one that logs (3 here), in under `wall`
    assert eng.snapshot().gen_throughput * wall >= 3 - 1e-6, (eng.snapshot().gen_throughput, wall, lines)
