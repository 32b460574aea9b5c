"""EngineLoad: the snapshot of the engine that `EngineLoop` publishes after every iteration, for the
server's /get_server_info, /get_load, /metrics and admission (read from any thread, never torn)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.cache.release_policy import RadixCacheStats
from jaxserve.core.request import Req
from jaxserve.engine.engine import Engine
from jaxserve.engine.outputs import EngineSnapshot, EngineStats


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine, published by the loop thread after every iteration (tokens, requests).

    The KV pool is idle when `kv_used_tokens == kv_cached_tokens` and `kv_locked_tokens == 0`: every
    used page then belongs to the prefix cache and no request holds one.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_pending_reqs: int = 0  # submitted and not finished, as seen by the loop (includes the inbox)
    kv_total_tokens: int = 0
    kv_swa_total_tokens: int | None = None  # the hybrid window pool's window-layer tokens (None without one)
    kv_used_tokens: int = 0
    kv_cached_tokens: int = 0
    kv_locked_tokens: int = 0
    num_waiting_tokens: int = 0  # the waiting queue's tokens (prompt + output so far each, SGLang's seqlen)
    num_chunked_rest_tokens: int = 0  # tokens the partly prefilled (chunked) request has still to prefill
    num_step_failures: int = 0
    last_step_time: float | None = None  # time.time() of the last step that ran a batch
    num_rejected_queue_full: int = 0  # submits refused because the waiting queue was full
    # running slots the next schedule can fill: max running - running, or 0 when this schedule left a
    # request waiting (slots or KV blocked it, and a newcomer would wait behind it)
    num_free_slots: int = 0
    num_queue_timeouts: int = 0  # requests ended after waiting longer than the queue timeout
    stats: EngineStats = dataclasses.field(default_factory=EngineStats)
    snapshot: EngineSnapshot | None = None  # the engine's own counters and gauges (for /metrics); None before the first
    radix_cache: RadixCacheStats | None = None  # at most 1 s old while busy, fresh when idle; None: no radix cache


def _chunked_rest(req: Req | None) -> int:
    """Tokens of a partly prefilled request not yet in the KV pool (0 for None)."""
    return 0 if req is None else max(0, req.fill_len - req.kv_len)


def snapshot_load(engine: Engine, **loop_fields: Any) -> EngineLoad:
    """The engine's EngineLoad now; `loop_fields` are the loop's own counts (num_pending_reqs,
    num_step_failures, ...). Call on the engine's thread."""
    scheduler = engine.scheduler
    free_slots = 0 if scheduler.waiting else max(0, scheduler.config.max_running_requests - scheduler.num_running)
    snapshot = engine.snapshot()
    return EngineLoad(
        num_running_reqs=scheduler.num_running,
        num_waiting_reqs=len(scheduler.waiting),
        num_free_slots=free_slots,
        kv_total_tokens=engine.limits.pool_tokens,
        kv_swa_total_tokens=None if snapshot is None else snapshot.kv_swa_total_tokens,
        kv_used_tokens=engine.cache.used_tokens(),
        kv_cached_tokens=engine.cache.tree.total_size(),
        kv_locked_tokens=engine.cache.tree.protected_size(),
        num_waiting_tokens=sum(r.fill_len for r in scheduler.waiting),
        num_chunked_rest_tokens=_chunked_rest(scheduler.chunked_req),
        stats=dataclasses.replace(engine.stats),
        snapshot=snapshot,
        **loop_fields,
    )
