"""Prometheus metrics (`GET /metrics`), prefix `jaxserve_`, label `model_name`.

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
        yield self._gauge("num_running_reqs", "Requests running", s.num_running_reqs)
        yield self._gauge("num_queue_reqs", "Requests waiting", s.num_queue_reqs)
        yield self._gauge("num_grammar_queue_reqs", "Requests waiting for their grammar to compile", s.num_grammar_queue_reqs)
        yield self._gauge("token_usage", "Share of the KV pool in use", s.token_usage)
        yield self._gauge("kv_used_tokens", "KV tokens in use (not evictable)", s.kv_used_tokens)
        yield self._gauge("kv_evictable_tokens", "KV tokens held by the cache and evictable", s.kv_evictable_tokens)
        yield self._gauge("gen_throughput", "Generated tokens per second (last log interval)", s.gen_throughput)
        yield self._gauge("cache_hit_rate", "Cached / prompt tokens over the process lifetime", s.cache_hit_rate)
        if self._extra_fn is not None:
            yield from self._extra_fn(self._labels)


class ServingMetrics:
    """The registry behind /metrics plus the latency observer fed with every engine output.

    Args:
        snapshot_fn: returns an `EngineSnapshot` (thread-safe read).
        model_name: value of the `model_name` label.
        extra_fn: optional generator of more metric families (e.g. the radix cache's), given the labels.
    """

    def __init__(self, snapshot_fn: Callable, model_name: str, extra_fn: Callable | None = None):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot_fn, model_name, extra_fn))
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
