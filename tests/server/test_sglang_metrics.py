"""SGLang's metric names on GET /metrics: the mapping table against SGLang 0.5.23's collector source,
values against the responses and the jaxserve_* twins, and the Grafana dashboard's queries against
what the running server exports."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.server.sglang_metrics import (
    RADIX_CACHE_NAMES,
    REQUEST_METRICS,
    SCHEDULER_GAUGES,
    SCHEDULER_LABELS,
    STORAGE_COUNTERS,
    TOKENIZER_LABELS,
)
from tests.server.conftest import wait_idle

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "examples" / "grafana" / "jaxserve.json"


def sglang_collector_source() -> str:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin, "sglang==0.5.23 (--no-deps) is a test dependency"
    return (Path(spec.origin).parent / "srt" / "observability" / "metrics_collector.py").read_text()


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
    names |= set(STORAGE_COUNTERS)
    assert documented == names


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
