"""The engine's per-step log lines in SGLang's wording, which operators and scripts grep for.

SGLang 0.5.23 logs one "Prefill batch" line for each step that runs prefill
(`scheduler_components/metrics_reporter.py`, `report_prefill_stats`):

    Prefill batch. #new-seq: 2, #new-token: 57, #cached-token: 16, token usage: 0.01, #running-req: 3, #queue-req: 0

`#new-seq` counts the batch's prefill entries (new prompts and the next chunk of a chunked one),
`#new-token` the prompt tokens they run this step, `#cached-token` the tokens of theirs already in the
KV cache (a prefix-cache hit, or the earlier chunks), `#running-req` the requests decoding before
this step, and `token usage` SGLang's share of the pool not free for new requests (the evictable
prefix cache counts as free, as in the Decode batch line). jaxserve leaves out `#pending-token` and
SGLang's disaggregation fields.

Every `--decode-log-interval` decode steps one "Decode batch" line follows:

    Decode batch. #running-req: 3, #queue-req: 0, token usage: 0.02, gen throughput (token/s): 41.20, cache hit rate: 0.125

With the hybrid sliding-window pool (D-46) both lines give each pool's usage where the single
`token usage` stands, in SGLang's words for its hybrid SWA pool (`PoolStats.get_prefill_usage_msg_parts`
and `get_decode_usage_msg_parts`): `full token usage: 0.05, swa token usage: 0.10` in the Prefill batch
line, `#full token: 48, full token usage: 0.05, #swa token: 40, swa token usage: 0.10` in the Decode
batch line (`EngineSnapshot`: the window pool counts the pages running requests' windows read).

With a storage tier (`--hicache-storage-backend file`) each Decode batch line is followed by one of
jaxserve's own (SGLang logs no storage line), cumulative since start:

    Storage tier. hits: 144 tokens, read: 1474560 B, written: 0 B, prefetch waits: 1, files evicted: 0

`hits` are prompt tokens admitted requests took from storage, `read` / `written` the bytes of page
files this process read (verified) and wrote, `prefetch waits` the requests the prefetch policy held in
the queue, `files evicted` the files this process removed to keep the directory within its bound.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

from jaxserve.cache.release_policy import RadixCacheStats
from jaxserve.engine.outputs import EngineSnapshot


class _Entry(Protocol):
    kv_len: int  # tokens of the request already in the KV cache


@dataclasses.dataclass(frozen=True)
class PrefillStats:
    """What one step's prefill entries run: counts of sequences and tokens."""

    num_new_seqs: int
    num_new_tokens: int
    num_cached_tokens: int


def prefill_stats(reqs: Sequence[_Entry], extend_lens: Sequence[int], running: Sequence[_Entry]) -> PrefillStats:
    """The prefill entries of a batch: its requests (`reqs`, before the step runs, with the tokens
    each runs in `extend_lens`) that are not among the decoding ones (`running`)."""
    decoding = set(map(id, running))
    prefill = [(r.kv_len, n) for r, n in zip(reqs, extend_lens) if id(r) not in decoding]
    return PrefillStats(len(prefill), sum(n for _, n in prefill), sum(k for k, _ in prefill))


def storage_line(stats: RadixCacheStats) -> str:
    """The storage tier's stats line (module docstring) from a `RadixCacheStats` with a storage tier."""
    return (f"Storage tier. hits: {stats.storage_hit_tokens} tokens, read: {stats.storage_bytes_read} B, "
            f"written: {stats.storage_bytes_written} B, prefetch waits: {stats.storage_prefetch_waits}, "
            f"files evicted: {stats.storage_files_evicted}")


def prefill_line(stats: PrefillStats, snap: EngineSnapshot) -> str:
    """SGLang's Prefill batch log line (module docstring), the gauges from `snap` taken before the step."""
    return (f"Prefill batch. #new-seq: {stats.num_new_seqs}, #new-token: {stats.num_new_tokens}, "
            f"#cached-token: {stats.num_cached_tokens}, {_usage(snap, is_decode=False)}, "
            f"#running-req: {snap.num_running_reqs}, #queue-req: {snap.num_queue_reqs}")


def decode_line(snap: EngineSnapshot) -> str:
    """SGLang's Decode batch log line (module docstring) from `snap`."""
    return (f"Decode batch. #running-req: {snap.num_running_reqs}, #queue-req: {snap.num_queue_reqs}, "
            f"{_usage(snap, is_decode=True)}, gen throughput (token/s): {snap.gen_throughput:.2f}, "
            f"cache hit rate: {snap.cache_hit_rate:.3f}")


def _usage(snap: EngineSnapshot, is_decode: bool) -> str:
    if snap.swa_token_usage is None:
        return f"token usage: {snap.token_usage:.2f}"
    full, swa = f"full token usage: {snap.full_token_usage:.2f}", f"swa token usage: {snap.swa_token_usage:.2f}"
    if is_decode:
        return f"#full token: {snap.kv_used_tokens}, {full}, #swa token: {snap.kv_swa_used_tokens}, {swa}"
    return f"{full}, {swa}"
