"""SGLang's Prometheus names for jaxserve's metrics, as data, and the families that export them.

SGLang 0.5.23 (sglang/srt/observability/metrics_collector.py) exports its metrics as `sglang:<name>`
from collectors with different label sets:
- the scheduler's gauges: `model_name`, `engine_type`, `tp_rank`, `pp_rank`, `moe_ep_rank`
  (`SCHEDULER_LABELS`; jaxserve serves as one unified engine of rank 0);
- the tokenizer manager's per-request counters and histograms: `model_name`, `engine_type`
  (`TOKENIZER_LABELS`), plus `is_streaming` ("true"/"false") on most, `cache_source` on cached tokens
  ("device", "host", "storage": the tier the tokens came from, as SGLang splits them);
- the HiCache storage (L3) collector: `storage_backend`, `tp_rank`, `dp_rank`, `pp_rank`, `pp_size`,
  `attn_cp_rank`, `attn_cp_size` (`STORAGE_LABELS`; SGLang's `StorageAttachment._resolve_metrics_collector`).
The request counters are counted when a request finishes, as SGLang does, so they differ from the
`jaxserve_*` counters (counted on arrival) while requests run.

`SCHEDULER_GAUGES`, `REQUEST_METRICS`, `RADIX_CACHE_NAMES` and `STORAGE_METRICS` are the one mapping
between the names; docs/api.md lists them and examples/grafana/jaxserve.json charts them. A new SGLang
version is a diff of these tables.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import threading
import time
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

ENGINE_TYPE = "unified"  # SGLang's value without prefill-decode disaggregation
SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
TOKENIZER_LABELS = ("model_name", "engine_type")
STORAGE_LABELS = ("storage_backend", "tp_rank", "dp_rank", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size")
CACHE_SOURCES = ("device", "host")  # SGLang's cache_source values; "storage" joins them with a storage tier


class Kind(enum.Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclasses.dataclass(frozen=True)
class MetricName:
    """One SGLang metric. `jaxserve`: our name of the same quantity (None when only the SGLang name
    exists); `source`: for scheduler gauges the `EngineSnapshot` attribute path it reads, for storage
    counters the `RadixCacheStats` field, for storage histograms `<operations field>.<StorageOp
    attribute>` (each operation observes that value once)."""

    sglang: str
    kind: Kind
    doc: str
    jaxserve: str | None = None
    source: str = ""
    extra_labels: tuple[str, ...] = ()


_G, _C, _H = Kind.GAUGE, Kind.COUNTER, Kind.HISTOGRAM

SCHEDULER_GAUGES: tuple[MetricName, ...] = (
    MetricName("sglang:num_running_reqs", _G, "Requests running", "jaxserve_num_running_reqs", "num_running_reqs"),
    MetricName("sglang:num_queue_reqs", _G, "Requests waiting", "jaxserve_num_queue_reqs", "num_queue_reqs"),
    MetricName("sglang:num_grammar_queue_reqs", _G, "Requests waiting for their grammar",
               "jaxserve_num_grammar_queue_reqs", "num_grammar_queue_reqs"),
    MetricName("sglang:gen_throughput", _G, "Generated tokens per second (last log interval)",
               "jaxserve_gen_throughput", "gen_throughput"),
    MetricName("sglang:cache_hit_rate", _G, "Cached / prompt tokens", "jaxserve_cache_hit_rate", "cache_hit_rate"),
    MetricName("sglang:token_usage", _G, "Share of the KV pool in use (with a hybrid sliding-window pool, the "
               "fuller of its two pools)", "jaxserve_token_usage", "token_usage"),
    MetricName("sglang:swa_token_usage", _G, "Share of the sliding-window layers' KV pool in use (0 without a "
               "hybrid sliding-window pool)", None, "swa_token_usage"),
    MetricName("sglang:num_used_tokens", _G, "KV tokens in use (not evictable)", "jaxserve_kv_used_tokens", "kv_used_tokens"),
    MetricName("sglang:kv_used_tokens", _G, "KV tokens in use (not evictable)", "jaxserve_kv_used_tokens", "kv_used_tokens"),
    MetricName("sglang:kv_evictable_tokens", _G, "KV tokens held by the prefix cache and evictable",
               "jaxserve_kv_evictable_tokens", "kv_evictable_tokens"),
    MetricName("sglang:kv_available_tokens", _G, "KV tokens free or evictable", None, "kv_available_tokens"),
    MetricName("sglang:max_total_num_tokens", _G, "KV pool capacity in tokens", None, "kv_total_tokens"),
    MetricName("sglang:spec_accept_length", _G, "Speculative decoding: mean tokens per verifying sequence-forward "
               "(accepted drafts + 1), lifetime; 0 without speculative decoding", "jaxserve_spec_accept_length",
               "spec_accept_length"),
    MetricName("sglang:spec_accept_rate", _G, "Speculative decoding: accepted / proposed draft tokens, lifetime",
               "jaxserve_spec_accept_rate", "spec_accept_rate"),
    MetricName("sglang:num_retracted_requests_total", _C, "Requests retracted to free KV pages",
               "jaxserve_num_retracted_requests_total", "num_retracted_requests"),
)

REQUEST_METRICS: tuple[MetricName, ...] = (
    MetricName("sglang:prompt_tokens_total", _C, "Prompt tokens of finished requests", "jaxserve_prompt_tokens_total",
               extra_labels=("is_streaming",)),
    MetricName("sglang:generation_tokens_total", _C, "Tokens generated by finished requests",
               "jaxserve_generation_tokens_total", extra_labels=("is_streaming",)),
    MetricName("sglang:num_requests_total", _C, "Finished requests", "jaxserve_num_requests_total",
               extra_labels=("is_streaming",)),
    MetricName("sglang:cached_tokens_total", _C, "Prompt tokens served from the prefix cache (finished requests)",
               "jaxserve_cached_tokens_total", extra_labels=("cache_source",)),
    MetricName("sglang:num_aborted_requests_total", _C, "Requests aborted", "jaxserve_num_aborted_requests_total"),
    MetricName("sglang:time_to_first_token_seconds", _H, "Time to first token", "jaxserve_time_to_first_token_seconds",
               extra_labels=("is_streaming",)),
    MetricName("sglang:inter_token_latency_seconds", _H, "Time between tokens (an output of k tokens counts k "
               "times, each interval / k)", "jaxserve_inter_token_latency_seconds"),
    MetricName("sglang:e2e_request_latency_seconds", _H, "Request latency", "jaxserve_e2e_request_latency_seconds",
               extra_labels=("is_streaming",)),
    MetricName("sglang:request_time_per_output_token_seconds", _H,
               "Per request: (finish - first token) / (completion tokens - 1), for stop and length finishes",
               extra_labels=("is_streaming",)),
)

# jaxserve's radix-cache family (without the `jaxserve_radix_cache_` prefix) -> its SGLang-style name
RADIX_CACHE_NAMES: dict[str, str] = {
    "nodes_total": "sglang_radix_cache_nodes_total",
    "shared_ratio": "sglang_radix_cache_shared_ratio",
    "soft_freed_bytes": "sglang_radix_cache_soft_freed_bytes",
    "merge_count": "sglang_radix_cache_merge_count",  # a counter: exported as ..._merge_count_total
}


# SGLang's storage (HiCache L3) metrics that the file backend measures; SGLang's others do not apply
# (docs/api.md says why). Exported only with a storage tier, with `STORAGE_LABELS`.
STORAGE_METRICS: tuple[MetricName, ...] = (
    MetricName("sglang:prefetched_tokens_total", _C, "Prompt tokens read from the storage tier (verified pages)",
               source="storage_prefetched_tokens"),
    MetricName("sglang:backuped_tokens_total", _C, "Tokens of the page files this process wrote to the storage tier",
               source="storage_backuped_tokens"),
    MetricName("sglang:storage_prefetch_hit_tokens_total", _C,
               "Tokens a prefetch found in the storage tier (its pages in a row) before reading them",
               source="storage_prefetch_hit_tokens"),
    MetricName("sglang:hicache_backup_dropped_tokens_total", _C,
               "Backup tokens that never reached the storage tier: the write queue was full",
               source="storage_backup_dropped_tokens"),
    MetricName("sglang:prefetch_pgs", _H, "Pages read per prefetch (one request's pages in a row)",
               source="storage_prefetch_ops.num_pages"),
    MetricName("sglang:backup_pgs", _H, "Pages written per backup batch (pages already on disk left out)",
               source="storage_backup_ops.num_pages"),
    MetricName("sglang:prefetch_bandwidth", _H, "Per-prefetch read bandwidth in GB/s: bytes over the file I/O time",
               source="storage_prefetch_ops.gib_per_s"),
    MetricName("sglang:backup_bandwidth", _H, "Per-batch write bandwidth in GB/s: bytes written over the file I/O "
               "time, pages already on disk left out", source="storage_backup_ops.gib_per_s"),
)
# SGLang's StorageMetricsCollector buckets: pages per operation, GB/s
STORAGE_BUCKETS: dict[str, tuple[float, ...]] = {
    "sglang:prefetch_pgs": (1, 5, 10, 50, 100),
    "sglang:backup_pgs": (1, 5, 10, 50, 100),
    "sglang:prefetch_bandwidth": (0.1, 0.5, 1, 5, 10, 50, 100),
    "sglang:backup_bandwidth": (0.1, 0.5, 1, 5, 10, 50, 100),
}
# `--hicache-storage-backend file` of one process holding every tensor-parallel shard
STORAGE_LABEL_VALUES = ("file", "0", "0", "0", "1", "0", "1")


class StorageExporter:
    """SGLang's storage metrics (`STORAGE_METRICS`) from `RadixCacheStats` snapshots, one scrape at a time.

    Counters are read as they stand. Histograms accumulate here: each scrape observes the operations
    the snapshot holds that earlier scrapes did not (the snapshot keeps the latest
    `jaxserve.cache.storage.MAX_OP_RECORDS`; older unseen ones are lost, as recall latencies are).
    Not thread-safe: /metrics renders one scrape at a time.
    """

    # the operations fields of `RadixCacheStats` -> their cumulative counts
    _OPS_COUNTS = {"storage_prefetch_ops": "storage_num_prefetch_ops", "storage_backup_ops": "storage_num_backup_ops"}

    def __init__(self):
        self._seen = dict.fromkeys(self._OPS_COUNTS, 0)
        self._histograms = {name: _Histogram(buckets) for name, buckets in STORAGE_BUCKETS.items()}

    def families(self, stats: Any) -> Iterable:
        """The `STORAGE_METRICS` families of one `RadixCacheStats` with a storage tier."""
        new_ops = {}
        for field, count_field in self._OPS_COUNTS.items():
            ops, num_ops = getattr(stats, field), getattr(stats, count_field)
            num_new = min(num_ops - self._seen[field], len(ops))
            new_ops[field] = ops[len(ops) - num_new :] if num_new > 0 else ()
            self._seen[field] = max(self._seen[field], num_ops)
        labels = list(STORAGE_LABEL_VALUES)
        for m in STORAGE_METRICS:
            if m.kind is Kind.COUNTER:
                family = CounterMetricFamily(m.sglang.removesuffix("_total"), m.doc, labels=list(STORAGE_LABELS))
                family.add_metric(labels, getattr(stats, m.source))
            else:
                field, attr = m.source.split(".")
                histogram = self._histograms[m.sglang]
                for op in new_ops[field]:
                    histogram.observe(getattr(op, attr))
                family = HistogramMetricFamily(m.sglang, m.doc, labels=list(STORAGE_LABELS))
                family.add_metric(labels, histogram.buckets(), histogram.sum)
            yield family


class _Histogram:
    """Cumulative bucket counts of observed values (Prometheus `le` semantics), exported at scrape time."""

    def __init__(self, upper_bounds: tuple[float, ...]):
        self._bounds = upper_bounds
        self._counts = [0] * (len(upper_bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[next((i for i, b in enumerate(self._bounds) if value <= b), len(self._bounds))] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        cumulative, out = 0, []
        for bound, count in zip([*map(str, map(float, self._bounds)), "+Inf"], self._counts):
            cumulative += count
            out.append((bound, cumulative))
        return out


def scheduler_families(snapshot: Any, model_name: str) -> Iterable:
    """The scheduler's `sglang:*` gauges (and retraction counter) from one engine snapshot; the
    caller passes the snapshot its `jaxserve_*` twins read, so one scrape shows equal values. A gauge of
    a pool the model lacks (None) is 0, as SGLang exports its gauges of absent pools."""
    labels = [model_name, ENGINE_TYPE, "0", "0", "0"]
    for m in SCHEDULER_GAUGES:
        value = _available(snapshot) if m.source == "kv_available_tokens" else operator.attrgetter(m.source)(snapshot)
        value = 0.0 if value is None else value
        if m.kind is Kind.COUNTER:
            family = CounterMetricFamily(m.sglang.removesuffix("_total"), m.doc, labels=list(SCHEDULER_LABELS))
        else:
            family = GaugeMetricFamily(m.sglang, m.doc, labels=list(SCHEDULER_LABELS))
        family.add_metric(labels, value)
        yield family


def _available(s: Any) -> float:
    return max(0, s.kv_total_tokens - s.kv_used_tokens)


class RequestMetrics:
    """SGLang's per-request counters and histograms, fed with every `StepOutput` (engine thread).

    `mark_streaming(rids)` labels requests whose outputs go to a stream (`is_streaming="true"`);
    `mark_unlogged(rids)` leaves requests out (SGLang's `log_metrics: false`, which its health checks
    send). The handler calls them after submitting, so a request that finishes before that (one with
    `max_new_tokens: 0`) is counted as a logged, non-streaming one.

    Cached tokens are counted by the tier they came from (`meta.cached_tokens_details`), under
    `cache_source` "device", "host" and "storage", as SGLang counts them; its fallback source "total"
    (a request without the split) is used only for a request without details. `cache_sources`: the
    series that exist from the start (add "storage" with a storage tier).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, buckets: dict[str, tuple[float, ...]],
                 cache_sources: tuple[str, ...] = CACHE_SOURCES):
        base = (model_name, ENGINE_TYPE)
        self._base = base
        made: dict[str, Any] = {}
        for m in REQUEST_METRICS:
            labelnames = [*TOKENIZER_LABELS, *m.extra_labels]
            if m.kind is Kind.COUNTER:
                made[m.sglang] = Counter(m.sglang.removesuffix("_total"), m.doc, labelnames, registry=registry)
            else:
                made[m.sglang] = Histogram(m.sglang, m.doc, labelnames, registry=registry, buckets=buckets[m.sglang])
        self._m = made
        # every series exists from the start at 0, so dashboards and rate() see it before its first event
        initial = {("is_streaming",): [("true",), ("false",)], ("cache_source",): [(s,) for s in cache_sources]}
        for m in REQUEST_METRICS:
            if m.kind is Kind.COUNTER:
                for extra in initial.get(m.extra_labels, [()]):
                    made[m.sglang].labels(*base, *extra)
        self._streaming: set[str] = set()
        self._unlogged: set[str] = set()
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def mark_streaming(self, rids: Iterable[str]) -> None:
        with self._lock:
            self._streaming.update(rids)

    def mark_unlogged(self, rids: Iterable[str]) -> None:
        with self._lock:
            self._unlogged.update(rids)

    def observe(self, out: Any, now: float | None = None) -> None:
        """Record one `StepOutput`: TTFT on the first tokens, ITL between outputs, the rest at finish."""
        now = time.perf_counter() if now is None else now
        m, meta = self._m, out.meta
        with self._lock:
            if out.rid in self._unlogged:
                if out.finished:
                    self._unlogged.discard(out.rid)
                return
            stream = "true" if out.rid in self._streaming else "false"
            last = self._last.get(out.rid)
            if out.new_token_ids:
                if last is None and meta.ttft is not None:
                    m["sglang:time_to_first_token_seconds"].labels(*self._base, stream).observe(meta.ttft)
                elif last is not None:
                    k = len(out.new_token_ids)
                    itl = m["sglang:inter_token_latency_seconds"].labels(*self._base)
                    for _ in range(k):
                        itl.observe((now - last) / k)
                self._last[out.rid] = now
            if not out.finished:
                return
            self._last.pop(out.rid, None)
            self._streaming.discard(out.rid)
        labels = (*self._base, stream)
        m["sglang:prompt_tokens_total"].labels(*labels).inc(meta.prompt_tokens)
        m["sglang:generation_tokens_total"].labels(*labels).inc(meta.completion_tokens)
        m["sglang:num_requests_total"].labels(*labels).inc()
        if meta.cached_tokens:
            cached = m["sglang:cached_tokens_total"]
            details = meta.cached_tokens_details
            if details is None:
                cached.labels(*self._base, "total").inc(meta.cached_tokens)
            else:
                for source, num_tokens in (("device", details.device), ("host", details.host),
                                           ("storage", details.storage or 0)):
                    if num_tokens > 0:
                        cached.labels(*self._base, source).inc(num_tokens)
        m["sglang:e2e_request_latency_seconds"].labels(*labels).observe(meta.e2e_latency)
        if meta.finish_reason is not None and meta.finish_reason.kind == "abort":
            m["sglang:num_aborted_requests_total"].labels(*self._base).inc()
        elif meta.ttft is not None and meta.completion_tokens > 1:
            per_token = (meta.e2e_latency - meta.ttft) / (meta.completion_tokens - 1)
            m["sglang:request_time_per_output_token_seconds"].labels(*labels).observe(per_token)


def radix_cache_family(family: Any) -> Any | None:
    """The SGLang-style copy of one `jaxserve_radix_cache_*` family, or None when it has none."""
    short = family.name.removeprefix("jaxserve_radix_cache_")
    target = RADIX_CACHE_NAMES.get(short)
    if target is None:
        return None
    copy = type(family)(target, family.documentation, labels=["model_name"])
    for sample in family.samples:
        if sample.name.endswith("_created"):
            continue
        copy.add_metric([sample.labels["model_name"]], sample.value)
    return copy
