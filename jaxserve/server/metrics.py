"""Prometheus metrics (`GET /metrics`): ours, prefix `jaxserve_`, label `model_name`, and the same
quantities under SGLang's names and labels (`sglang:*`, `sglang_radix_cache_*`; the mapping is data
in `sglang_metrics.py`), so SGLang dashboards and alerts work unchanged.

Counters and gauges are read from the engine's snapshot at scrape time, so they equal the engine's
own counters exactly. Latency histograms are observed as outputs stream out: TTFT when a request's
first token arrives, ITL between consecutive outputs of a request, E2E when it finishes. Names follow
SGLang's (`sglang:prompt_tokens_total` -> `jaxserve_prompt_tokens_total`).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request

from jaxserve.server import sglang_metrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# SGLang's latency buckets (seconds), shortened for CPU serving
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _EngineCollector(Collector):
    def __init__(self, snapshot_fn: Callable, model_name: str, extra_fn: Callable | None):
        self._snapshot_fn = snapshot_fn
        self._labels = [model_name]
        self._extra_fn = extra_fn

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        m = CounterMetricFamily(f"jaxserve_{name}", doc, labels=["model_name"])
        m.add_metric(self._labels, value)
        return m

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        m = GaugeMetricFamily(f"jaxserve_{name}", doc, labels=["model_name"])
        m.add_metric(self._labels, value)
        return m

    def collect(self) -> Iterable:
        s = self._snapshot_fn()
        c = s.counters
        yield self._counter("prompt_tokens", "Prompt tokens received", c.prompt_tokens)
        yield self._counter("generation_tokens", "Tokens generated", c.generation_tokens)
        yield self._counter("cached_tokens", "Prompt tokens served from the prefix cache", c.cached_tokens)
        yield self._counter("num_requests", "Requests received (each of n sequences counts)", c.num_requests)
        yield self._counter("num_aborted_requests", "Requests aborted", c.num_aborted_requests)
        yield self._counter("num_retracted_requests", "Requests retracted to free KV pages", s.num_retracted_requests)
        yield self._counter("jit_compiles", "Compilations after warm-up", s.num_jit_compiles)
        yield self._counter("spec_verifications", "Speculative decoding: sequences verified with a draft (one per sequence per forward)", c.num_spec_verifications)
        yield self._counter("spec_draft_tokens", "Speculative decoding: draft tokens proposed", c.num_spec_draft_tokens)
        yield self._counter("spec_accepted_tokens", "Speculative decoding: draft tokens accepted", c.num_spec_accepted_tokens)
        yield self._gauge("num_running_reqs", "Requests running", s.num_running_reqs)
        yield self._gauge("num_queue_reqs", "Requests waiting", s.num_queue_reqs)
        yield self._gauge("num_grammar_queue_reqs", "Requests waiting for their grammar to compile", s.num_grammar_queue_reqs)
        yield self._gauge("token_usage", "Share of the KV pool in use (with a hybrid sliding-window pool, the fuller "
                          "of its two pools)", s.token_usage)
        yield self._gauge("kv_used_tokens", "KV tokens in use (not evictable)", s.kv_used_tokens)
        yield self._gauge("kv_evictable_tokens", "KV tokens held by the cache and evictable", s.kv_evictable_tokens)
        yield self._gauge("gen_throughput", "Generated tokens per second (last log interval)", s.gen_throughput)
        yield self._gauge("cache_hit_rate", "Cached / prompt tokens over the process lifetime", s.cache_hit_rate)
        yield from sglang_metrics.scheduler_families(s, self._labels[0])
        yield self._gauge("spec_accept_length", "Speculative decoding: mean tokens per verifying sequence-forward (accepted drafts + 1), lifetime", s.spec_accept_length)
        yield self._gauge("spec_accept_rate", "Speculative decoding: accepted / proposed draft tokens, lifetime", s.spec_accept_rate)
        if self._extra_fn is not None:
            yield from self._extra_fn(self._labels)


_RECALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class RadixCacheExporter:
    """`jaxserve_radix_cache_*` from the release policy's `RadixCacheStats` (D-36).

    Cumulative byte totals (`soft_freed_bytes`, `recalled_bytes`) are exported as gauges under those
    exact names; merges and evictions are counters (`_merge_count_total`, `_eviction_count_total`);
    cached tokens by tier are `jaxserve_radix_cache_cached_tokens_total{tier="device"|"host"|"storage"}`.
    Recall latencies feed the `_recall_latency_seconds` histogram at scrape time. With a storage tier,
    `jaxserve_radix_cache_storage_*` and SGLang's storage metrics (`sglang_metrics.STORAGE_METRICS`,
    `StorageExporter`) join them.
    """

    def __init__(self, stats_fn: Callable, registry: CollectorRegistry, model_name: str):
        self._stats_fn = stats_fn
        self._seen_recalls = 0
        self._storage = sglang_metrics.StorageExporter()
        self._recall = Histogram(
            "jaxserve_radix_cache_recall_latency_seconds", "Host -> device recall latency",
            labelnames=["model_name"], buckets=_RECALL_BUCKETS, registry=registry,
        ).labels(model_name)

    def families(self, labels: list[str]) -> Iterable:
        s = self._stats_fn()
        if s is None:
            return
        new = s.num_recalls - self._seen_recalls
        if new > 0:
            for latency in s.recall_latency_s[-min(new, len(s.recall_latency_s)):]:
                self._recall.observe(latency)
            self._seen_recalls = s.num_recalls

        for family in self._families(s, labels):
            yield family
            sglang_copy = sglang_metrics.radix_cache_family(family)
            if sglang_copy is not None:
                yield sglang_copy
        if s.has_storage_tier:
            yield from self._storage.families(s)

    def _families(self, s, labels: list[str]) -> Iterable:
        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            m = GaugeMetricFamily(f"jaxserve_radix_cache_{name}", doc, labels=["model_name"])
            m.add_metric(labels, value)
            return m

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(f"jaxserve_radix_cache_{name}", doc, labels=["model_name"])
            m.add_metric(labels, value)
            return m

        yield gauge("nodes_total", "Nodes in the radix tree", s.nodes_total)
        yield gauge("shared_ratio", "Share of nodes matched by more than the request that inserted them", s.shared_ratio)
        yield gauge("frozen_nodes", "Locked (frozen) nodes", s.frozen_nodes)
        yield gauge("soft_freed_bytes", "Bytes moved device -> host tier (cumulative)", s.soft_freed_bytes)
        yield gauge("recalled_bytes", "Bytes recalled host -> device (cumulative)", s.recalled_bytes)
        yield counter("merge_count", "Single-child chains merged", s.merge_count)
        yield counter("eviction_count", "Nodes dropped for good", s.eviction_count)
        yield gauge("hit_rate", "Cached / looked-up tokens (all tiers)", s.hit_rate)
        yield gauge("num_blocks_used", "Device KV pages allocated", s.num_blocks_used)
        yield gauge("block_utilization", "Used token slots / slots of allocated pages", s.block_utilization)
        tiers = CounterMetricFamily("jaxserve_radix_cache_cached_tokens", "Cached prompt tokens by tier",
                                    labels=["model_name", "tier"])
        tiers.add_metric(labels + ["device"], s.cached_hit_tokens - s.host_hit_tokens - s.storage_hit_tokens)
        tiers.add_metric(labels + ["host"], s.host_hit_tokens)
        if s.has_storage_tier:
            tiers.add_metric(labels + ["storage"], s.storage_hit_tokens)
        yield tiers
        if not s.has_storage_tier:
            return
        yield gauge("storage_bytes_read", "Bytes of verified page files read from the storage tier (cumulative)",
                    s.storage_bytes_read)
        yield gauge("storage_bytes_written", "Bytes of page files this process wrote to the storage tier (cumulative)",
                    s.storage_bytes_written)
        yield counter("storage_prefetch_waits", "Requests held in the queue by their storage prefetch",
                      s.storage_prefetch_waits)
        yield counter("storage_prefetch_wait_seconds", "Seconds requests were held by their storage prefetch",
                      s.storage_prefetch_wait_s)
        yield counter("storage_files_evicted", "Page files removed to keep the directory within its bound",
                      s.storage_files_evicted)
        yield counter("storage_bad_files", "Truncated, corrupted or foreign page files met (misses)", s.storage_bad_files)
        yield counter("storage_pages_dropped", "Pages not written because the write queue was full",
                      s.storage_pages_dropped)
        yield counter("storage_pages_failed", "Pages whose write failed (a later backup of them tries again)",
                      s.storage_pages_failed)


class ServingMetrics:
    """The registry behind /metrics plus the latency observer fed with every engine output.

    Args:
        snapshot_fn: returns an `EngineSnapshot` (thread-safe read).
        model_name: value of the `model_name` label.
        radix_stats_fn: returns the release policy's `RadixCacheStats` (or None), for `jaxserve_radix_cache_*`.
        has_storage_tier: the server has a storage tier (`sglang:cached_tokens_total{cache_source="storage"}`
            exists from the start).
    """

    def __init__(self, snapshot_fn: Callable, model_name: str, radix_stats_fn: Callable | None = None,
                 has_storage_tier: bool = False):
        self.registry = CollectorRegistry()
        extra_fn = None
        if radix_stats_fn is not None:
            extra_fn = RadixCacheExporter(radix_stats_fn, self.registry, model_name).families
        self.registry.register(_EngineCollector(snapshot_fn, model_name, extra_fn))
        self.sglang = sglang_metrics.RequestMetrics(self.registry, model_name, {
            "sglang:time_to_first_token_seconds": _TTFT_BUCKETS,
            "sglang:inter_token_latency_seconds": _ITL_BUCKETS,
            "sglang:e2e_request_latency_seconds": _E2E_BUCKETS,
            "sglang:request_time_per_output_token_seconds": _ITL_BUCKETS,
        }, sglang_metrics.CACHE_SOURCES + (("storage",) if has_storage_tier else ()))
        self._model_name = model_name
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "Time to first token", buckets=_TTFT_BUCKETS, **kw)
        self.itl = Histogram("jaxserve_inter_token_latency_seconds", "Time between outputs of a request", buckets=_ITL_BUCKETS, **kw)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds", "Request latency", buckets=_E2E_BUCKETS, **kw)
        self._last_output: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, out) -> None:
        """Record one `StepOutput` (called on the engine thread for every output)."""
        now = time.perf_counter()
        self.sglang.observe(out, now)
        labels = (self._model_name,)
        with self._lock:
            last = self._last_output.get(out.rid)
            if out.new_token_ids:
                if last is None and out.meta.ttft is not None:
                    self.ttft.labels(*labels).observe(out.meta.ttft)
                elif last is not None:
                    self.itl.labels(*labels).observe(now - last)
                self._last_output[out.rid] = now
            if out.finished:
                self._last_output.pop(out.rid, None)
                self.e2e.labels(*labels).observe(out.meta.e2e_latency)

    def mark_streaming(self, rids) -> None:
        """Label these requests `is_streaming="true"` in the `sglang:*` metrics."""
        self.sglang.mark_streaming(rids)

    def mark_unlogged(self, rids) -> None:
        """Leave these requests out of the `sglang:*` request metrics (`log_metrics: false`)."""
        self.sglang.mark_unlogged(rids)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def mark_streaming(request: Request, rids) -> None:
    """Tell the app's metrics (if enabled) that these requests stream their outputs."""
    metrics = getattr(request.app.state, "serving_metrics", None)
    if metrics is not None:
        metrics.mark_streaming(rids)


def mark_unlogged(request: Request, rids) -> None:
    """Tell the app's metrics (if enabled) to leave these requests out of SGLang's request metrics."""
    metrics = getattr(request.app.state, "serving_metrics", None)
    if metrics is not None:
        metrics.mark_unlogged(rids)
