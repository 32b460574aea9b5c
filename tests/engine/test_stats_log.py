"""SGLang's Prefill batch and Decode batch log lines (engine/stats_log.py), from a real engine's steps; with
the hybrid sliding-window pool (D-46), each pool's usage in SGLang's hybrid SWA wording, against the
allocator's counts when the line is logged."""

from __future__ import annotations

import logging
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.engine.engine import Engine
from jaxserve.engine.stats_log import PrefillStats, prefill_stats

LINE = re.compile(r"^Prefill batch\. #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+), token usage: "
                  r"(\d+\.\d\d), #running-req: (\d+), #queue-req: (\d+)$")
DECODE = re.compile(r"^Decode batch\. #running-req: \d+, #queue-req: \d+, token usage: \d+\.\d\d, "
                    r"gen throughput \(token/s\): \d+\.\d\d, cache hit rate: \d\.\d{3}$")
HUNDREDTH = 0.0051  # a value printed with 2 decimals, a half-way one rounded either way
HYBRID_PREFILL = re.compile(r"^Prefill batch\. #new-seq: \d+, #new-token: \d+, #cached-token: \d+, "
                            r"full token usage: (\d+\.\d\d), swa token usage: (\d+\.\d\d), #running-req: \d+, "
                            r"#queue-req: \d+$")
HYBRID_DECODE = re.compile(r"^Decode batch\. #running-req: \d+, #queue-req: \d+, #full token: (\d+), full token "
                           r"usage: (\d+\.\d\d), #swa token: (\d+), swa token usage: (\d+\.\d\d), gen throughput "
                           r"\(token/s\): \d+\.\d\d, cache hit rate: \d\.\d{3}$")


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
    assert DECODE.match(lines[0]), lines  # one pool: one `token usage`, no swa fields
    # the window holds the tokens of the interval's steps before the one that logs (3 here), in under `wall`
    assert eng.snapshot().gen_throughput * wall >= 3 - 1e-6, (eng.snapshot().gen_throughput, wall, lines)


class _PoolCounts(logging.Handler):
    """Keeps each stats line with the allocator's counts at the moment it is logged: full-space tokens in
    use less the evictable prefix cache, and tokens of the window pages that a running window reads."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.engine, self.lines = engine, []

    def emit(self, record):
        alloc, page = self.engine.cache.allocator, self.engine.runner.pool_shape.page_size
        full = alloc.num_used * page - self.engine.cache.tree.evictable_size()
        self.lines.append((record.getMessage(), full, int(np.count_nonzero(alloc.window_locks)) * page))


def test_hybrid_pool_lines_give_each_pools_usage_in_sglangs_words(sliding_window_model_dir, caplog):
    page = 8
    eng = Engine(model_path=sliding_window_model_dir, max_total_tokens=1024, context_length=512, page_size=page,
                 chunked_prefill_size=32, max_running_requests=4, disable_precompile=True, decode_log_interval=4)
    alloc = eng.cache.allocator
    full_total, swa_total = eng.runner.pool_shape.num_tokens, alloc.window.num_usable * page
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(3, 49152, n)] for n in (70, 40)]
    counts = _PoolCounts(eng)
    logger = logging.getLogger("jaxserve.engine.engine")
    logger.addHandler(counts)
    try:
        with caplog.at_level(logging.INFO, logger="jaxserve.engine.engine"):
            eng.generate(prompts, {"max_new_tokens": 12, "ignore_eos": True})
    finally:
        logger.removeHandler(counts)
    prefill = [(HYBRID_PREFILL.match(m), full, swa) for m, full, swa in counts.lines if m.startswith("Prefill")]
    decode = [(HYBRID_DECODE.match(m), full, swa) for m, full, swa in counts.lines if m.startswith("Decode")]
    assert prefill and decode and all(m for m, _, _ in prefill + decode), counts.lines
    for m, full, swa in prefill:
        assert float(m[1]) == pytest.approx(full / full_total, abs=HUNDREDTH)
        assert float(m[2]) == pytest.approx(swa / swa_total, abs=HUNDREDTH)
    for m, full, swa in decode:
        assert (int(m[1]), int(m[3])) == (full, swa)
        assert float(m[2]) == pytest.approx(full / full_total, abs=HUNDREDTH)
        assert float(m[4]) == pytest.approx(swa / swa_total, abs=HUNDREDTH)
    # two running windows hold a few pages each while the full layers hold both sequences
    assert all(0 < swa < full for _, full, swa in decode), decode
    # finished: the tree keeps each sequence's last window, evictable like the rest of the prefix cache
    snap = eng.snapshot()
    assert alloc.window.num_used > 0
    assert (snap.kv_swa_used_tokens, snap.kv_swa_total_tokens, snap.token_usage) == (0, swa_total, 0.0)
