"""SGLang's metric names on GET /metrics: the mapping table against SGLang 0.5.23's collector source,
values against the responses and the jaxserve_* twins, cached tokens by the tier they came from (a
device hit, and a storage hit after a restart), the hybrid sliding-window pool's usage against its
allocator, and the Grafana dashboard's queries against what the running server exports."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.server.sglang_metrics import (
    RADIX_CACHE_NAMES,
    REQUEST_METRICS,
    SCHEDULER_GAUGES,
    SCHEDULER_LABELS,
    STORAGE_BUCKETS,
    STORAGE_LABELS,
    STORAGE_METRICS,
    TOKENIZER_LABELS,
    Kind,
)
from tests.server.conftest import TINY_SERVER_FLAGS, ServerProcess, wait_idle

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "examples" / "grafana" / "jaxserve.json"


def sglang_source(path: str) -> str:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin, "sglang==0.5.23 (--no-deps) is a test dependency"
    return (Path(spec.origin).parent / "srt" / path).read_text()


def sglang_collector_source() -> str:
    return sglang_source("observability/metrics_collector.py")


def scrape(http) -> dict[str, list]:
    """Sample name -> [(labels, value)] of one /metrics scrape."""
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def total(samples, name: str, **labels) -> float:
    return sum(v for ls, v in samples.get(name, []) if all(ls.get(k) == x for k, x in labels.items()))


@pytest.mark.parametrize("metric", [*SCHEDULER_GAUGES, *REQUEST_METRICS], ids=lambda m: m.sglang)
def test_names_and_extra_labels_are_sglangs(metric):
    source = sglang_collector_source()
    at = source.find(f'name="{metric.sglang}"')
    assert at >= 0, f"{metric.sglang} is not in SGLang's collector"
    labelnames = source[at:].split("labelnames=", 1)[1].split("\n", 1)[0]
    quoted = set(re.findall(r'"(\w+)"', labelnames))
    assert quoted == set(metric.extra_labels), (metric.sglang, labelnames)


def test_label_sets_are_sglangs():
    source = sglang_collector_source()
    scheduler = source[source.index("labels = {\n                \"model_name\""):][:400]
    assert re.findall(r'"(\w+)": ', scheduler) == list(SCHEDULER_LABELS)
    tokenizer = source[source.index("def tokenizer_metric_labels"):][:500]
    assert re.findall(r'"(\w+)": ', tokenizer) == list(TOKENIZER_LABELS)


@pytest.mark.parametrize("metric", STORAGE_METRICS, ids=lambda m: m.sglang)
def test_storage_names_kinds_labels_and_buckets_are_sglangs(metric):
    source = sglang_collector_source()
    collector = source[source.index("class StorageMetricsCollector"):source.index("class ExpertDispatchCollector")]
    at = collector.find(f'name="{metric.sglang}"')
    assert at >= 0, f"{metric.sglang} is not in SGLang's storage collector"
    constructor = re.findall(r"= (Counter|Histogram)\(", collector[:at])[-1]
    assert constructor.lower() == metric.kind.value, metric.sglang
    call = collector[at:].split("\n        )", 1)[0]
    assert "labelnames=labels.keys()," in call, (metric.sglang, call)  # no label beyond the collector's
    if metric.kind is Kind.HISTOGRAM:
        bucket_list = re.search(r"buckets=(\w+)", call).group(1)
        numbers = re.search(bucket_list + r" = \[([^\]]*)\]", collector).group(1)
        assert tuple(float(x) for x in re.findall(r"[\d.]+", numbers)) == STORAGE_BUCKETS[metric.sglang]


def test_storage_labels_and_cache_sources_are_sglangs():
    attach = sglang_source("mem_cache/unified_cache/storage_attachment.py")
    labels = attach[attach.index("def _resolve_metrics_collector"):]
    labels = labels[labels.index("labels = {"):labels.index("}")]
    assert tuple(re.findall(r'"(\w+)": ', labels)) == STORAGE_LABELS
    source = sglang_collector_source()
    finished = source[source.index("def observe_one_finished_request"):source.index("def observe_time_to_first_token")]
    assert set(re.findall(r'report_cache_source\("(\w+)"', finished)) == {"device", "host", "storage"}
    assert '"cache_source": "total"' in finished  # only without a per-tier split
    # meta_info's cached_tokens_details: device and host, plus storage and the backend's class name with L3
    streamer = sglang_source("managers/scheduler_components/output_streamer.py")
    details = streamer[streamer.index("def get_cached_tokens_details"):streamer.index("def stream_output")]
    assert set(re.findall(r'"(\w+)": req\.cached_tokens_(\w+)', details)) == {("device", "device"), ("host", "host")}
    assert 'details["storage"] = req.cached_tokens_storage' in details
    assert 'details["storage_backend"] = self._get_storage_backend_type()' in details
    assert "class HiCacheFile(" in sglang_source("mem_cache/hicache_storage.py")
    assert 'meta_info["cached_tokens_details"]' in sglang_source("managers/tokenizer_manager.py")


def test_every_name_is_exported_with_its_labels(http):
    http.post("/generate", json={"text": "metric names", "sampling_params": {"max_new_tokens": 3}})
    samples = scrape(http)
    for m in SCHEDULER_GAUGES:
        assert samples[m.sglang][0][0].keys() == set(SCHEDULER_LABELS), m.sglang
        if m.jaxserve is not None:
            assert m.jaxserve in samples, m.jaxserve
    for m in REQUEST_METRICS:
        name = m.sglang if m.kind.value == "counter" else m.sglang + "_count"
        assert name in samples, name
        assert samples[name][0][0].keys() == {*TOKENIZER_LABELS, *m.extra_labels}, name
        assert m.jaxserve is None or m.jaxserve in samples or m.jaxserve + "_count" in samples, m.jaxserve
    for ours, theirs in RADIX_CACHE_NAMES.items():
        suffix = "_total" if ours == "merge_count" else ""
        assert samples[theirs + suffix] and samples[f"jaxserve_radix_cache_{ours}{suffix}"], theirs
        assert samples[theirs + suffix][0][1] == samples[f"jaxserve_radix_cache_{ours}{suffix}"][0][1]


def test_request_counters_follow_the_responses(http):
    wait_idle(http)  # no other test's request finishes between the two scrapes
    before = scrape(http)
    outs = [http.post("/generate", json={"text": t, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
            for t in ("one two three", "four five")]
    with http.stream("POST", "/generate", json={"text": "streamed request", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 5, "temperature": 0}}) as r:
        last = [line for line in r.iter_lines() if line.startswith("data: {")][-1]
    streamed = json.loads(last[6:])
    after = scrape(http)

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("sglang:prompt_tokens_total", is_streaming="false") == sum(o["meta_info"]["prompt_tokens"] for o in outs)
    assert delta("sglang:generation_tokens_total", is_streaming="false") == sum(o["meta_info"]["completion_tokens"] for o in outs)
    assert delta("sglang:prompt_tokens_total", is_streaming="true") == streamed["meta_info"]["prompt_tokens"]
    assert delta("sglang:generation_tokens_total", is_streaming="true") == streamed["meta_info"]["completion_tokens"]
    assert delta("sglang:num_requests_total", is_streaming="false") == 2
    assert delta("sglang:num_requests_total", is_streaming="true") == 1
    assert delta("sglang:time_to_first_token_seconds_count", is_streaming="true") == 1
    assert delta("sglang:e2e_request_latency_seconds_count") == 3
    # one ITL observation per token after the first of each request
    assert delta("sglang:inter_token_latency_seconds_count") == sum(
        o["meta_info"]["completion_tokens"] - 1 for o in [*outs, streamed])
    assert delta("jaxserve_prompt_tokens_total") == delta("sglang:prompt_tokens_total")


def test_scheduler_gauges_equal_the_jaxserve_ones(http):
    wait_idle(http)
    samples = scrape(http)  # one scrape reads one snapshot for both
    for m in SCHEDULER_GAUGES:
        if m.jaxserve is not None:
            assert samples[m.sglang][0][1] == samples[m.jaxserve][0][1], m.sglang
    capacity = samples["sglang:max_total_num_tokens"][0][1]
    assert capacity == 4096
    assert samples["sglang:kv_available_tokens"][0][1] == capacity - samples["sglang:kv_used_tokens"][0][1]
    # no sliding-window pool: SGLang's gauge is there at 0, and token usage is the one pool's
    assert samples["sglang:swa_token_usage"] == [(samples["sglang:token_usage"][0][0], 0.0)]
    assert samples["sglang:token_usage"][0][1] == samples["sglang:kv_used_tokens"][0][1] / capacity


def test_swa_token_usage_of_a_hybrid_pool_follows_its_allocator(sliding_window_model_dir):
    """An engine with the hybrid sliding-window pool (D-46), scraped in process: `sglang:swa_token_usage`
    is the share of window pages a running window reads, and `token_usage` the fuller pool's share, as
    SGLang's (`max(full, swa)`): the window pool early in a prefill (every page still in the window, and
    the window pool is the smaller), the full pool once two sequences outgrow their windows."""
    from jaxserve.engine.engine import Engine
    from jaxserve.server.metrics import ServingMetrics

    page = 8
    eng = Engine(model_path=sliding_window_model_dir, max_total_tokens=1024, context_length=512, page_size=page,
                 chunked_prefill_size=32, max_running_requests=4, disable_precompile=True)
    metrics, alloc = ServingMetrics(eng.snapshot, "gemma3"), eng.cache.allocator

    def gauges() -> tuple[dict[str, float], float, float]:
        """The scrape's usage gauges, and the full and window pools' shares in use from the allocator."""
        samples = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
        full = (alloc.num_used * page - eng.cache.tree.evictable_size()) / eng.runner.pool_shape.num_tokens
        swa = np.count_nonzero(alloc.window_locks) / alloc.window.num_usable
        return samples, full, swa

    rng = np.random.default_rng(6)
    params = {"max_new_tokens": 16, "ignore_eos": True}
    eng.add_request([int(x) for x in rng.integers(3, 49152, 30)], params)
    eng.step()
    samples, full, swa = gauges()
    assert 0 < full < swa
    assert samples["sglang:swa_token_usage"] == pytest.approx(swa)
    assert samples["sglang:token_usage"] == samples["jaxserve_token_usage"] == pytest.approx(swa)

    eng.add_request([int(x) for x in rng.integers(3, 49152, 150)], params)
    for _ in range(10):  # five chunks of the long prompt, then decode steps
        eng.step()
    samples, full, swa = gauges()
    assert eng.scheduler.num_running == 2 and 0 < swa < full
    assert samples["sglang:swa_token_usage"] == pytest.approx(swa)
    assert samples["sglang:token_usage"] == samples["jaxserve_token_usage"] == pytest.approx(full)

    while eng.has_unfinished():
        eng.step()
    samples, _, _ = gauges()
    assert alloc.window.num_used > 0  # the tree keeps the last windows: evictable, so free as in SGLang
    assert samples["sglang:swa_token_usage"] == samples["sglang:token_usage"] == 0


def dashboard_metric_names() -> set[str]:
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    dash = json.loads(DASHBOARD.read_text())
    walk(dash["panels"])
    assert len(exprs) >= 20
    return {n for e in exprs for n in re.findall(r"\b((?:sglang:|sglang_|jaxserve_)[A-Za-z0-9_:]+)", e)}


def test_every_metric_the_dashboard_queries_is_exported(http):
    http.post("/generate", json={"text": "dashboard", "sampling_params": {"max_new_tokens": 2}})
    exported = set(scrape(http))
    names = dashboard_metric_names()
    assert {"sglang:time_to_first_token_seconds_bucket", "sglang_radix_cache_nodes_total"} <= names
    assert {"sglang:spec_accept_length", "sglang:spec_accept_rate"} <= names  # the speculative row
    assert names - exported == set()


def test_docs_list_every_sglang_name():
    text = (REPO / "docs" / "api.md").read_text()
    section = text[text.index("## Metrics"):text.index("## Operations")]
    documented = set(re.findall(r"^\| `([\w:]+)` \|", section, flags=re.M))
    names = {m.sglang for m in (*SCHEDULER_GAUGES, *REQUEST_METRICS)}
    names |= {t + ("_total" if o == "merge_count" else "") for o, t in RADIX_CACHE_NAMES.items()}
    names |= {m.sglang for m in STORAGE_METRICS}
    assert documented == names


def test_a_device_hit_is_counted_as_device(http):
    tokens = [(7 * i) % 500 + 3 for i in range(70)]
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    first = http.post("/generate", json=body).json()["meta_info"]
    wait_idle(http)
    before = scrape(http)
    meta = http.post("/generate", json=body).json()["meta_info"]
    after = scrape(http)
    cached = meta["cached_tokens"]
    assert first["cached_tokens_details"] is None and cached > first["cached_tokens"] >= 0
    assert meta["cached_tokens_details"] == {"device": cached, "host": 0}  # no storage tier: no storage keys
    for source, want in (("device", cached), ("host", 0), ("storage", 0), ("total", 0)):
        delta = total(after, "sglang:cached_tokens_total", cache_source=source) - total(
            before, "sglang:cached_tokens_total", cache_source=source)
        assert delta == want, source
    assert [ls["cache_source"] for ls, _ in before["sglang:cached_tokens_total"]] == ["device", "host"]


def test_log_metrics_false_leaves_a_request_out(http):
    wait_idle(http)
    before = scrape(http)
    http.post("/generate", json={"text": "not logged", "log_metrics": False, "sampling_params": {"max_new_tokens": 3}})
    http.post("/generate", json={"text": "logged", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    after = scrape(http)
    assert total(after, "sglang:num_requests_total") - total(before, "sglang:num_requests_total") == 1
    assert total(after, "jaxserve_num_requests_total") - total(before, "jaxserve_num_requests_total") == 2


def test_internal_states_last_gen_throughput_is_the_gauge(http):
    http.post("/generate", json={"text": "throughput", "sampling_params": {"max_new_tokens": 4}})
    wait_idle(http)
    states = http.get("/server_info").json()["internal_states"]
    samples = scrape(http)
    assert len(states) == 1 and "avg_spec_accept_length" not in states[0]  # no speculative decoding
    assert states[0]["last_gen_throughput"] == samples["jaxserve_gen_throughput"][0][1]
    assert http.get("/get_server_info").json()["internal_states"][0].keys() == states[0].keys()


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir, tmp_path_factory):
    from tests.server.conftest import TINY_SERVER_FLAGS, ServerProcess

    proc = ServerProcess(["--model-path", tiny_model_dir, *TINY_SERVER_FLAGS, "--speculative-algorithm", "NGRAM",
                          "--speculative-num-draft-tokens", "4", "--disable-speculative-adaptive"],
                         tmp_path_factory.mktemp("spec") / "server.log")
    proc.wait_healthy()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def spec_http(spec_server):
    import httpx

    with httpx.Client(base_url=spec_server.url, timeout=120) as client:
        yield client


def test_the_ready_line_names_the_speculative_algorithm(spec_server):
    """Before: the ready line was the same with and without --speculative-algorithm (or --quantization)."""
    ready = [line for line in spec_server.log().splitlines() if line.startswith("jaxserve ready:")]
    assert ready == [f"jaxserve ready: serving tiny_llama0 at {spec_server.url} "
                     "(OpenAI API at /v1; --speculative-algorithm NGRAM)"], ready


def test_speculative_accept_length_and_rate_under_sglang_names(spec_http):
    text = "a b c d e f a b c d e f a b c d e f a b c d e f"  # repeats: n-gram drafts to verify
    for _ in range(2):
        spec_http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 24, "temperature": 0}})
    wait_idle(spec_http)
    samples = scrape(spec_http)
    verified = samples["jaxserve_spec_verifications_total"][0][1]
    drafted = samples["jaxserve_spec_draft_tokens_total"][0][1]
    accepted = samples["jaxserve_spec_accepted_tokens_total"][0][1]
    assert verified > 0 and drafted > 0
    for name, want in (("sglang:spec_accept_length", (accepted + verified) / verified),
                       ("sglang:spec_accept_rate", accepted / drafted)):
        [(labels, value)] = samples[name]
        assert labels.keys() == set(SCHEDULER_LABELS)
        assert value == pytest.approx(want) and value == samples[name.replace("sglang:", "jaxserve_")][0][1]
    [state] = spec_http.get("/server_info").json()["internal_states"]
    assert state["avg_spec_accept_length"] == pytest.approx((accepted + verified) / verified)


def test_a_storage_hit_after_a_restart_is_counted_as_storage(tiny_model_dir, tmp_path, monkeypatch):
    """A server computes a prompt and stops; a new one on the same storage directory reads its prefix from
    storage: meta_info and sglang:cached_tokens_total{cache_source} say so, the storage collector's
    metrics count it under SGLang's label set, and the prompt's next run is a device hit."""
    import time

    import httpx

    storage_dir = tmp_path / "hicache"
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(storage_dir))
    flags = ["--model-path", tiny_model_dir, *TINY_SERVER_FLAGS, "--page-size", "16",
             "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 16}']
    tokens = [(37 * i) % 30000 + 3 for i in range(150)]
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    num_pages = (len(tokens) - 1) // 16  # the pages of the match key (the last prompt token is computed)

    first = ServerProcess(flags, tmp_path / "first.log")
    try:
        first.wait_healthy()
        with httpx.Client(base_url=first.url, timeout=120) as client:
            computed = client.post("/generate", json=body).json()
        deadline = time.monotonic() + 60  # its pages are written off the request's path
        while len(list(storage_dir.glob("*.kv"))) < num_pages and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        first.stop()
    assert computed["meta_info"]["cached_tokens"] == 0 and computed["meta_info"]["cached_tokens_details"] is None

    second = ServerProcess(flags, tmp_path / "second.log")  # the restart
    try:
        second.wait_healthy()
        with httpx.Client(base_url=second.url, timeout=120) as client:
            before = scrape(client)
            meta = client.post("/generate", json=body).json()["meta_info"]
            deadline = time.monotonic() + 10  # the storage collector reads stats refreshed once a second
            while total(after := scrape(client), "sglang:prefetch_pgs_count") < 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            again = client.post("/generate", json=body).json()["meta_info"]
            last = scrape(client)
    finally:
        second.stop()

    cached = meta["cached_tokens"]
    assert cached == num_pages * 16
    assert meta["cached_tokens_details"] == {"device": 0, "host": 0, "storage": cached, "storage_backend": "HiCacheFile"}
    assert again["cached_tokens_details"] == {"device": again["cached_tokens"], "host": 0, "storage": 0,
                                              "storage_backend": "HiCacheFile"}
    request_labels = {"model_name": "tiny_llama0", "engine_type": "unified"}
    assert sorted(ls["cache_source"] for ls, _ in before["sglang:cached_tokens_total"]) == ["device", "host", "storage"]

    def cached_by(samples, source):
        [(labels, value)] = [(ls, v) for ls, v in samples["sglang:cached_tokens_total"] if ls["cache_source"] == source]
        assert labels == {**request_labels, "cache_source": source}
        return value

    assert (cached_by(after, "storage"), cached_by(after, "device"), cached_by(after, "host")) == (cached, 0, 0)
    assert (cached_by(last, "storage"), cached_by(last, "device")) == (cached, again["cached_tokens"])
    storage_labels = dict(zip(STORAGE_LABELS, ("file", "0", "0", "0", "1", "0", "1")))
    for m in STORAGE_METRICS:
        name = m.sglang if m.kind is Kind.COUNTER else m.sglang + "_count"
        [(labels, _)] = after[name]
        assert labels == storage_labels, name
    assert total(after, "sglang:storage_prefetch_hit_tokens_total") == cached  # the hit query found every page
    assert total(after, "sglang:prefetched_tokens_total") == cached
    assert total(after, "sglang:prefetch_pgs_count") == 1 and total(after, "sglang:prefetch_pgs_sum") == num_pages
    assert total(after, "sglang:prefetch_pgs_bucket", le="5.0") == 0
    assert total(after, "sglang:prefetch_pgs_bucket", le="10.0") == 1
    assert total(after, "sglang:prefetch_bandwidth_count") == 1
    assert total(after, "sglang:hicache_backup_dropped_tokens_total") == 0
