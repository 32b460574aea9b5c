"""GET /get_load with SGLang 0.5.23's meanings (scheduler_components/load_inquirer.py `get_loads`,
pool_stats_observer.py): num_tokens = KV tokens requests hold (capacity - free - evictable) + the
waiting queue's tokens; num_pending_tokens = tokens still to prefill (waiting queue + the chunked
request's rest). sglang-router polls it to balance, so a warm prefix cache must not look busy."""

from __future__ import annotations

from types import SimpleNamespace

from starlette.testclient import TestClient

from jaxserve.engine.engine_loop import EngineLoop
from jaxserve.server.app import create_app
from jaxserve.server_args import ServerArgs
from tests.server.conftest import wait_idle
from tests.server.fakes import FakeEngine
from tests.server.test_sglang_metrics import scrape


def test_a_warm_prefix_cache_is_no_load(http):
    prompt = list(range(10, 210))  # 200 tokens (the tiny model has 256), cached after the request
    r = http.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text
    wait_idle(http)
    samples = scrape(http)
    evictable = samples["sglang:kv_evictable_tokens"][0][1]
    assert evictable >= 128, evictable  # the prompt's pages stayed in the prefix cache
    assert samples["sglang:num_used_tokens"][0][1] == 0
    (load,) = http.get("/get_load").json()
    assert load["num_reqs"] == 0 and load["num_waiting_reqs"] == 0
    assert load["num_tokens"] == 0, load
    assert load["num_pending_tokens"] == 0, load


def test_waiting_and_chunked_tokens_are_load_and_pending():
    engine = FakeEngine()
    # 2 requests hold 16 KV tokens each (the fake's pool), 40 of them cached of which 8 locked
    engine.reqs = {"a": {}, "b": {}}
    engine.cache = SimpleNamespace(used_tokens=lambda: 32 + 40 - 8)
    engine.cache.tree = SimpleNamespace(total_size=lambda: 40, protected_size=lambda: 8)
    engine.scheduler = SimpleNamespace(
        num_running=2,
        waiting=[SimpleNamespace(fill_len=100), SimpleNamespace(fill_len=23)],
        chunked_req=SimpleNamespace(fill_len=500, kv_len=192),
        config=SimpleNamespace(max_running_requests=8),
    )
    loop = EngineLoop(engine, max_queued_requests=8)
    loop._publish_load()  # the snapshot the loop thread takes after each step
    with TestClient(create_app(loop, ServerArgs(model_path="/models/fake-model"))) as client:
        (load,) = client.get("/get_load").json()
    # held: used 64 - evictable (40 - 8) = 32; + waiting 123
    assert load["num_tokens"] == 32 + 123, load
    assert load["num_pending_tokens"] == 123 + (500 - 192), load
    assert load["num_waiting_reqs"] == 2 and load["num_reqs"] == 4, load
