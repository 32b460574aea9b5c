"""The served loop's idle step (jaxserve/engine/engine_loop.py, "Going idle"), on the tiny checkpoint:
when the last request finishes, the release policy's pass and the prefill budget's end of a busy
period run at once, without waiting for the next request, and the load snapshot that /metrics reads
is fresh. Before, the served reference of tests/parallel/test_multihost.py showed 0 or one page of
soft-released bytes in /metrics (a snapshot up to a second older than its last step, never refreshed
while idle) and the stall credit of one busy period was still there at the next.
"""

from __future__ import annotations

import threading

from jaxserve.engine.engine import Engine
from jaxserve.engine.engine_loop import EngineLoop

# every unlocked prefix is cold at once and any used page is over the threshold (tests/parallel/tp_worker.py)
AGGRESSIVE = dict(
    release_conservative_batch_size=0, release_aggressive_batch_size=0, enable_hierarchical_cache=True,
    radix_cache_soft_free_threshold=0.0, radix_cache_evict_threshold=0.0,
)


def test_going_idle_runs_the_release_pass_and_ends_the_busy_period(tiny_model_dir):
    engine = Engine(model_path=tiny_model_dir, max_total_tokens=1024, context_length=128, page_size=8,
                    chunked_prefill_size=32, disable_precompile=True, prefill_decode_itl_ratio=2.5,
                    prefill_decode_stall_fraction=0.01, **AGGRESSIVE)
    loop = EngineLoop(engine).start()
    try:
        done = threading.Event()
        loop.submit(list(range(3, 43)), {"max_new_tokens": 8, "temperature": 0},
                    on_output=lambda out: out.finished and done.set())
        assert done.wait(120)
        # a command runs after the loop iteration that delivered the last output has finished
        credit, free, usable = loop.call(lambda e: (e.scheduler.prefill_budget.stall_credit, e.cache.allocator.num_free,
                                                    e.cache.allocator.num_usable)).result(30)
        stats = loop.load().radix_cache
        assert engine.stats.num_steps >= 8  # the request decoded beside a measured budget
        assert credit == 0.0  # the request's grant (1% of its 7 ITLs) was dropped at idle
        assert free == usable  # the 40 cached prompt tokens (5 pages) left the device with no new request
        assert stats.soft_freed_bytes == 5 * engine.cache.policy.host.bytes_per_page
        assert stats.soft_freed_nodes >= 1 and stats.cached_tokens_host == 40
        assert stats.cached_tokens_device == 0
    finally:
        loop.shutdown()


def test_the_load_snapshot_is_fresh_once_idle():
    """While busy the radix-cache stats in `load()` are refreshed at most once a second; the snapshot
    published when the engine goes idle is taken then (here the stats are the engine's step count)."""
    from tests.server.fakes import FakeEngine

    class CountingEngine(FakeEngine):
        def radix_cache_stats(self):
            return self.num_steps

    engine = CountingEngine(step_time=0.001)
    loop = EngineLoop(engine).start()
    try:
        done = threading.Event()
        loop.submit("hi", {"max_new_tokens": 20}, on_output=lambda out: out.finished and done.set())
        assert done.wait(30)
        num_steps = loop.call(lambda e: e.num_steps).result(30)
        assert num_steps == 21  # 20 steps that each gave a token, and the idle step
        assert loop.load().radix_cache == num_steps
    finally:
        loop.shutdown()
