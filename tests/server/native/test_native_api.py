"""POST /generate (SGLang's native API) and the operational endpoints, against the real server."""

from __future__ import annotations

import json

from tests.server.conftest import wait_idle

GREEDY = {"max_new_tokens": 8, "temperature": 0}


def _sse_payloads(lines) -> list:
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    return events


def test_generate_plain(http):
    r = http.post("/generate", json={"text": "The capital of France is", "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out["text"], str) and len(out["output_ids"]) == 8
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 8 and meta["prompt_tokens"] > 0
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["cached_tokens"] >= 0 and meta["e2e_latency"] > 0 and meta["id"]
    assert "output_token_logprobs" not in meta


def test_generate_input_ids_equals_text(http, default_tokenizer):
    ids = default_tokenizer.encode("Hello world", add_special_tokens=False)
    by_text = http.post("/generate", json={"text": "Hello world", "sampling_params": GREEDY}).json()
    by_ids = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()
    assert by_text["meta_info"]["prompt_tokens"] == by_ids["meta_info"]["prompt_tokens"] == len(ids)
    assert by_ids["output_ids"] == by_text["output_ids"]
    none = http.post("/generate", json={"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 0}}).json()
    assert none["output_ids"] == [] and none["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_batch_matches_single(http):
    prompts = ["Once upon a time", "def fibonacci(n):", "1, 2, 3,"]
    singles = [http.post("/generate", json={"text": p, "sampling_params": GREEDY}).json() for p in prompts]
    batch = http.post("/generate", json={"text": prompts, "sampling_params": GREEDY}).json()
    assert isinstance(batch, list) and len(batch) == 3
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]
    per_prompt = http.post(
        "/generate", json={"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": [GREEDY, {**GREEDY, "max_new_tokens": 3}]}
    ).json()
    assert [len(b["output_ids"]) for b in per_prompt] == [8, 3]


def test_generate_n_gives_a_list(http):
    out = http.post("/generate", json={"text": "Hi", "sampling_params": {**GREEDY, "n": 2, "max_new_tokens": 4}}).json()
    assert isinstance(out, list) and len(out) == 2
    assert out[0]["output_ids"] == out[1]["output_ids"]  # greedy


def test_generate_logprobs(http):
    body = {"text": "Hello", "sampling_params": {**GREEDY, "max_new_tokens": 4}, "return_logprob": True,
            "top_logprobs_num": 2, "return_text_in_logprobs": True}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == 4 and len(meta["output_top_logprobs"]) == 4
    logprob, token_id, text = meta["output_token_logprobs"][0]
    assert logprob <= 0 and isinstance(token_id, int) and isinstance(text, str)
    top = meta["output_top_logprobs"][0]
    assert len(top) == 2 and top[0][1] == token_id  # greedy: the chosen token is the most likely


# SGLang 0.5.23's meta_info logprob keys (TokenizerManager.add_logprob_to_meta_info, read by hand):
# return_logprob gives input/output_token_logprobs and output_token_logprobs_length; top_logprobs_num > 0
# adds input/output_top_logprobs; token_ids_logprob adds input/output_token_ids_logprobs. The input_*
# lists are [] with logprob_start_len -1 (SGLang's default) or equal to the prompt's length.
_BASE_KEYS = {"input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"}
_TOP_KEYS = {"input_top_logprobs", "output_top_logprobs"}
_IDS_KEYS = {"input_token_ids_logprobs", "output_token_ids_logprobs"}
LOGPROB_KEYS = [  # (request fields, the logprob keys of meta_info, the input_* keys that are [])
    ({}, set(), set()),
    ({"return_logprob": True}, _BASE_KEYS, {"input_token_logprobs"}),
    ({"return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 2}, _BASE_KEYS | _TOP_KEYS,
     {"input_token_logprobs", "input_top_logprobs"}),
    ({"return_logprob": True, "token_ids_logprob": [5, 6]}, _BASE_KEYS | _IDS_KEYS,
     {"input_token_logprobs", "input_token_ids_logprobs"}),
    ({"return_logprob": True, "top_logprobs_num": 1, "token_ids_logprob": [5], "logprob_start_len": 3},
     _BASE_KEYS | _TOP_KEYS | _IDS_KEYS, {"input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"}),
    ({"return_logprob": True, "token_ids_logprob": []}, _BASE_KEYS, {"input_token_logprobs"}),  # [] means none
]


def test_logprob_keys_are_sglangs(http):
    logprob_keys = _BASE_KEYS | _TOP_KEYS | _IDS_KEYS
    for fields, keys, empty in LOGPROB_KEYS:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}, **fields}
        meta = http.post("/generate", json=body).json()["meta_info"]
        assert set(meta) & logprob_keys == keys, fields
        assert {k for k in keys if k.startswith("input_") and meta[k] == []} == empty, (fields, meta)
        if keys:
            assert meta["output_token_logprobs_length"] == len(meta["output_token_logprobs"]) == 2
        for k in keys & {"output_top_logprobs", "output_token_ids_logprobs"}:
            assert len(meta[k]) == 2 and all(row for row in meta[k]), (k, meta[k])
    # prompt positions asked for: the prompt logprobs themselves, from logprob_start_len on
    body = {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 1,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    assert [t for _, t, _ in http.post("/generate", json=body).json()["meta_info"]["input_token_logprobs"]] == [2, 3]
    # a stream's events carry the same keys
    with http.stream("POST", "/generate", json={**body, "logprob_start_len": -1, "stream": True}) as r:
        events = [json.loads(p) for p in _sse_payloads(r.iter_lines())[:-1]]
    assert events and all(e["meta_info"]["input_token_logprobs"] == [] for e in events)


def test_generate_stream_is_cumulative(http):
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    full = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        payloads = _sse_payloads(r.iter_lines())
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    assert len(events) >= 2
    for prev, cur in zip(events, events[1:]):
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    last = events[-1]
    assert last["text"] == full["text"] and last["output_ids"] == full["output_ids"]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_generate_stream_batch_has_indexes(http):
    body = {"text": ["a b c", "x y z"], "sampling_params": {**GREEDY, "max_new_tokens": 3}, "stream": True}
    with http.stream("POST", "/generate", json=body) as r:
        payloads = _sse_payloads(r.iter_lines())
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    finished = [e["index"] for e in events if e["meta_info"]["finish_reason"] is not None]
    assert sorted(finished) == [0, 1]


def test_model_and_server_info(http):
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] and info["tokenizer_path"]
    before = http.get("/get_server_info").json()["engine_stats"]["num_requests"]
    http.post("/generate", json={"text": "count me", "sampling_params": {"max_new_tokens": 1}}).raise_for_status()
    server = http.get("/get_server_info").json()
    assert server["context_length"] == 256 and server["max_running_requests"] == 16
    assert server["kv_pool"]["total_tokens"] >= 4096 - 16
    assert server["engine_stats"]["num_requests"] == before + 1  # counted by this test, not by earlier ones
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == server["served_model_name"]


def test_server_info_reports_sglangs_pool_and_input_limits(http):
    """max_total_num_tokens and max_req_input_len (SGLang's get_init_info fields, which scripts read):
    the pool's capacity, and the bound a prompt must stay under, checked against what /generate takes."""
    info = http.get("/get_server_info").json()
    assert info["max_total_num_tokens"] == info["kv_pool"]["total_tokens"] >= 4096 - 16
    limit = info["max_req_input_len"]
    assert 0 < limit <= info["context_length"]
    ok = http.post("/generate", json={"input_ids": [5] * (limit - 1), "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200, ok.text
    refused = http.post("/generate", json={"input_ids": [5] * limit, "sampling_params": {"max_new_tokens": 1}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input_ids", refused.text


def test_health_generate_and_flush_cache(http):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    wait_idle(http)  # a request an earlier test aborted may still be leaving: flushing needs an idle engine
    r = http.post("/flush_cache")
    assert r.status_code == 200, r.text
    info = http.get("/get_server_info").json()
    assert info["kv_pool"]["cached_tokens"] == 0 and info["kv_pool"]["used_tokens"] == 0


def test_metrics(http):
    http.post("/generate", json={"text": "metrics please", "sampling_params": {"max_new_tokens": 2}})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "jaxserve_prompt_tokens_total" in r.text and "jaxserve_num_running_reqs" in r.text
    count = [line for line in r.text.splitlines() if line.startswith("jaxserve_time_to_first_token_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1


def test_token_usage_means_the_same_in_server_info_and_metrics(http):
    """SGLang's token usage: the evictable prefix cache counts as free (the decode log line and
    jaxserve_token_usage use it too)."""
    http.post("/generate", json={"text": "fill the prefix cache with whole pages " * 8, "sampling_params": {"max_new_tokens": 2}})
    info = wait_idle(http)
    kv = info["kv_pool"]
    assert kv["cached_tokens"] > 0  # the request above left its prefix in the cache
    expected = (kv["used_tokens"] - (kv["cached_tokens"] - kv["locked_tokens"])) / kv["total_tokens"]
    assert kv["token_usage"] == expected == 0
    metric = next(float(x.split()[-1]) for x in http.get("/metrics").text.splitlines() if x.startswith("jaxserve_token_usage"))
    assert metric == kv["token_usage"]
