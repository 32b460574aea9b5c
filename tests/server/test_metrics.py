"""/metrics against the real server: exact counters, cumulative hit rate, and bench_serving's totals."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serving import bench_serving
from tests.server.conftest import wait_idle


def scrape(http) -> dict[str, float]:
    """Every sample of /metrics parsed by prometheus-client's own text parser: name -> value."""
    r = http.get("/metrics")
    assert r.status_code == 200
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            assert sample.labels.get("model_name"), f"{sample.name} has no model_name label"
            if sample.name.endswith("_bucket"):
                continue
            out[sample.name] = sample.value
    return out


def counter_delta(before: dict, after: dict, name: str) -> float:
    return after[f"jaxserve_{name}"] - before.get(f"jaxserve_{name}", 0.0)


def test_counters_equal_known_totals(http):
    wait_idle(http)
    before = scrape(http)
    prompts = [[100 + i] * (5 + 3 * i) for i in range(4)]
    for p in prompts:
        r = http.post("/generate", json={"input_ids": p, "sampling_params": {"max_new_tokens": 7, "ignore_eos": True}})
        assert r.status_code == 200, r.text
    wait_idle(http)
    after = scrape(http)
    assert counter_delta(before, after, "prompt_tokens_total") == sum(map(len, prompts))
    assert counter_delta(before, after, "generation_tokens_total") == 7 * len(prompts)
    assert counter_delta(before, after, "num_requests_total") == len(prompts)
    assert after["jaxserve_num_running_reqs"] == 0
    assert after["jaxserve_time_to_first_token_seconds_count"] - before.get("jaxserve_time_to_first_token_seconds_count", 0) == 4
    # cumulative over the lifetime, not the last batch
    rate = after["jaxserve_cached_tokens_total"] / after["jaxserve_prompt_tokens_total"]
    assert after["jaxserve_cache_hit_rate"] == pytest.approx(rate)


def load_bench():
    return bench_serving


@pytest.mark.parametrize("dataset", ["random", "generated-shared-prefix", "sharegpt"])
def test_bench_serving_totals_equal_server_counters(http, base_url, tmp_path, dataset, tiny_model_dir):
    bench = load_bench()
    args = ["--backend", "jaxserve", "--base-url", base_url, "--dataset-name", dataset, "--num-prompts", "4",
            "--max-concurrency", "2", "--disable-tqdm", "--seed", "3", "--warmup-requests", "0",
            "--tokenizer", tiny_model_dir, "--random-input-len", "24", "--random-output-len", "5",
            "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len", "32",
            "--gsp-question-len", "8", "--gsp-output-len", "5", "--sharegpt-output-len", "5"]
    if dataset == "sharegpt":
        convs = [{"conversations": [{"from": "human", "value": f"Tell me about the number {i} and its friends."},
                                    {"from": "gpt", "value": "It is a fine number, one of many."}]} for i in range(6)]
        path = tmp_path / "sharegpt.json"
        path.write_text(json.dumps(convs))
        args += ["--dataset-path", str(path)]
    wait_idle(http)
    before = scrape(http)
    record = bench.main(args)
    wait_idle(http)
    after = scrape(http)
    assert record["completed"] == 4 and record["failed"] == 0
    assert record["total_input_tokens"] == counter_delta(before, after, "prompt_tokens_total")
    assert record["total_output_tokens"] == counter_delta(before, after, "generation_tokens_total")
    assert record["total_cached_tokens"] == counter_delta(before, after, "cached_tokens_total")


def test_radix_cache_metrics_are_exported(http):
    prompt = [7] * 40
    for _ in range(2):
        http.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
    wait_idle(http)
    import time

    time.sleep(1.2)  # the radix stats refresh at most once a second
    http.post("/generate", json={"input_ids": [8, 9], "sampling_params": {"max_new_tokens": 1}})
    values = scrape(http)
    for name in ("nodes_total", "shared_ratio", "frozen_nodes", "soft_freed_bytes", "recalled_bytes",
                 "merge_count_total", "eviction_count_total", "hit_rate", "num_blocks_used", "block_utilization"):
        assert f"jaxserve_radix_cache_{name}" in values, name
    assert values["jaxserve_radix_cache_nodes_total"] >= 1
    assert "jaxserve_radix_cache_recall_latency_seconds_count" in values


def test_storage_tier_metrics_are_exported(tmp_path):
    from prometheus_client import CollectorRegistry

    from jaxserve.server.metrics import RadixCacheExporter
    from jaxserve.server.sglang_metrics import STORAGE_LABELS
    from tests.cache.test_storage_tier import TOKENS, make_server

    a = make_server(tmp_path)
    a.compute(TOKENS)
    a.sync()
    b = make_server(tmp_path)  # a restart: the prompt comes back from storage
    b.prefetch("r", TOKENS)
    match = b.admit("r", TOKENS)
    b.policy.record_lookup(len(TOKENS), match)
    b.tree.dec_lock_ref(match.last_node)
    stats = b.policy.stats()
    exporter = RadixCacheExporter(lambda: stats, CollectorRegistry(), "m")
    storage_labels = dict(zip(STORAGE_LABELS, ("file", "0", "0", "0", "1", "0", "1")))

    def scrape_exporter(exporter) -> dict:
        values = {}
        for family in exporter.families(["m"]):
            for sample in family.samples:
                if sample.name.startswith("sglang:"):
                    assert {k: v for k, v in sample.labels.items() if k != "le"} == storage_labels, sample
                key = sample.labels.get("tier") or sample.labels.get("le")
                values[(sample.name, key)] = sample.value
        return values

    values = scrape_exporter(exporter)
    file_bytes = b.storage.storage.file_bytes
    assert values[("jaxserve_radix_cache_cached_tokens_total", "storage")] == 20
    assert values[("jaxserve_radix_cache_cached_tokens_total", "device")] == 0
    assert values[("jaxserve_radix_cache_storage_bytes_read", None)] == 10 * file_bytes
    assert values[("sglang:prefetched_tokens_total", None)] == 20
    assert values[("sglang:storage_prefetch_hit_tokens_total", None)] == 20
    assert values[("sglang:backuped_tokens_total", None)] == 0  # b wrote nothing: a did
    assert values[("sglang:hicache_backup_dropped_tokens_total", None)] == 0
    # one prefetch of 10 pages: SGLang's buckets (1, 5, 10, 50, 100) count it from le="10.0" on
    assert values[("sglang:prefetch_pgs_bucket", "5.0")] == 0 and values[("sglang:prefetch_pgs_bucket", "10.0")] == 1
    assert values[("sglang:prefetch_pgs_count", None)] == 1 and values[("sglang:prefetch_pgs_sum", None)] == 10
    [op] = stats.storage_prefetch_ops
    assert values[("sglang:prefetch_bandwidth_sum", None)] == pytest.approx(10 * file_bytes / 2**30 / op.seconds)
    assert values[("sglang:prefetch_bandwidth_count", None)] == 1 and values[("sglang:backup_pgs_count", None)] == 0
    assert scrape_exporter(exporter)[("sglang:prefetch_pgs_count", None)] == 1  # a second scrape observes no op twice
    a_stats = a.policy.stats()
    assert a_stats.storage_backuped_tokens == 20 and a_stats.storage_bytes_written == 10 * file_bytes
    a_values = scrape_exporter(RadixCacheExporter(lambda: a_stats, CollectorRegistry(), "m"))
    assert a_values[("sglang:backup_pgs_count", None)] == 1 and a_values[("sglang:backup_pgs_sum", None)] == 10
    assert a_values[("sglang:backuped_tokens_total", None)] == 20
    a.close(), b.close()
