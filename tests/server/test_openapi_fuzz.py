"""GET /openapi.json, and every POST route fuzzed from it with schemathesis against a real (tiny
checkpoint) server: no 5xx, every 4xx an OpenAI-shaped JSON error, and the server still answers
/health and a greedy request afterwards. Bounded: FUZZ_EXAMPLES generated cases per route."""

from __future__ import annotations

import json

import httpx
import hypothesis
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.server.conftest import TINY_SERVER_FLAGS, ServerProcess

FUZZ_EXAMPLES = 20  # per route and generation mode (schema-valid bodies, then schema-violating ones)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir, tmp_path_factory):
    """Its own server: fuzzed requests (n up to 128, long outputs) must not slow the shared one. It
    serves the plain-JSON tool format (`--tool-call-parser llama3`), so that format is tested end to end."""
    flags = ["--model-path", tiny_model_dir, *TINY_SERVER_FLAGS, "--tool-call-parser", "llama3"]
    proc = ServerProcess(flags, tmp_path_factory.mktemp("fuzz") / "server.log")
    proc.wait_healthy()
    yield proc
    proc.stop()


def test_openapi_document_lists_the_routes_and_models(fuzz_server):
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request", "/flush_cache"):
        assert "post" in doc["paths"][path], path
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    for field in ("messages", "tools", "tool_choice", "logit_bias", "max_completion_tokens", "continue_final_message"):
        assert field in chat["properties"], field
    assert "messages" in chat["required"]
    assert doc["components"]["schemas"]["GenerateRequest"].get("additionalProperties") is False
    schemathesis.openapi.from_dict(doc)  # loads as a valid document


def _post_operations(url: str):
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    return [op for op in ops if op.method.upper() == "POST"]


def test_fuzz_post_routes(fuzz_server):
    ops = _post_operations(fuzz_server.url)
    assert {op.path for op in ops} >= {"/generate", "/v1/completions", "/v1/chat/completions"}
    failures: list[str] = []
    statuses: dict[tuple[str, str], list[int]] = {}
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    with_body = {path for path, methods in doc["paths"].items() if "requestBody" in methods.get("post", {})}
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    with httpx.Client(base_url=fuzz_server.url, timeout=120) as http:
        # a route without a body (/flush_cache) has no schema to violate: positive cases only
        for op, mode in [(op, m) for op in ops for m in modes if op.path in with_body or m is modes[0]]:
            @given(case=op.as_strategy(mode))
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
            def run(case):
                body = case.body if not isinstance(case.body, schemathesis.core.NotSet) else None
                if isinstance(body, bytes):  # negative mode may send raw bytes as the body
                    r = http.post(op.path, content=body, headers={"content-type": "application/json"})
                else:
                    r = http.post(op.path, json=body) if body is not None else http.post(op.path)
                statuses.setdefault((op.path, mode.value), []).append(r.status_code)
                if r.status_code >= 500:
                    failures.append(f"{op.path} {body!r:.300} -> {r.status_code} {r.text[:300]}")
                elif r.status_code >= 400:
                    err = r.json().get("error")
                    if not (isinstance(err, dict) and err.get("message") and err.get("type")):
                        failures.append(f"{op.path} {body!r:.300} -> {r.status_code} without an error body: {r.text[:300]}")
            run()
        assert not failures, "\n".join(failures[:10])
        for (path, mode), codes in statuses.items():  # the fuzzer reached the handlers
            assert len(codes) >= (5 if path in with_body else 1), (path, mode, codes)
            if mode == "negative":
                assert 400 in codes, (path, codes)
        # some fuzzed body generated text (which route's happens to be valid varies with the schema's
        # draws; the hostile-field test below puts every route's fuzzed fields under a valid core)
        generation = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses")
        assert any(200 in codes for (path, mode), codes in statuses.items() if path in generation), statuses
        assert http.get("/health").status_code == 200
        r = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] > 0


SET = {"type": "function", "function": {"name": "set_level", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "mode": {"type": "string", "enum": ["low", "high"]}},
    "required": ["on", "level", "mode"]}}}


def test_forced_call_from_random_weights_in_the_llama3_format(fuzz_server):
    """The grammar alone makes a valid call: the tiny checkpoint's weights are random."""
    body = {"messages": [{"role": "user", "content": "Set it."}], "tools": [SET], "tool_choice": "required",
            "temperature": 1.0, "seed": 5, "n": 4}
    r = httpx.post(fuzz_server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "set_level"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SET["function"]["parameters"])


def test_auto_parses_the_llama3_format(fuzz_server):
    """Under tool_choice "auto" a reply that is a llama3-format call becomes tool_calls on this server
    (the reply is pinned with an EBNF grammar; with the default qwen25 parser it would stay content)."""
    reply = json.dumps({"name": "set_level", "parameters": {"on": True, "level": 3, "mode": "high"}})
    body = {"messages": [{"role": "user", "content": "Set it."}], "tools": [SET], "temperature": 0,
            "ebnf": "start: " + json.dumps(reply)}
    r = httpx.post(fuzz_server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"on": True, "level": 3, "mode": "high"}


# Fields the server echoes back or stores, each with values it must refuse by name (before: a lone
# surrogate in one gave a 500 mid-stream, an oversize one was run and echoed).
SURROGATE = "a\ud800b"
HOSTILE_FIELDS = {
    "/generate": [(("rid",), SURROGATE), (("rid",), "r" * 257)],
    "/v1/completions": [(("rid",), SURROGATE), (("rid",), "r" * 257)],
    "/v1/chat/completions": [(("rid",), SURROGATE), (("rid",), "r" * 257)],
    "/v1/responses": [(("request_id",), SURROGATE), (("request_id",), "r" * 257),
                      (("metadata",), {SURROGATE: "v"}), (("metadata",), {"k": SURROGATE}),
                      (("metadata",), {f"k{i}": "v" for i in range(17)}), (("metadata",), {"k" * 65: "v"}),
                      (("metadata",), {"k": "v" * 513}), (("text",), {"format": {"type": "json_schema", "name": SURROGATE,
                                                                                   "schema": {"type": "object"}}})],
}


VALID_CORE = {
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 2, "n": 1},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 1},
    "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 2},
}


def test_fuzzed_bodies_with_a_hostile_echoed_field_are_400s_naming_it(fuzz_server):
    """Schema-valid bodies from the fuzzer, each sent as it is and again with one echoed field made
    hostile: where the clean body is a 200 the hostile one is a 400 naming that field; never a 5xx."""
    ops = {op.path: op for op in _post_operations(fuzz_server.url) if op.path in HOSTILE_FIELDS}
    assert set(ops) == set(HOSTILE_FIELDS)
    failures: list[str] = []
    refused_by_name = {path: 0 for path in HOSTILE_FIELDS}
    with httpx.Client(base_url=fuzz_server.url, timeout=120) as http:
        for path, op in ops.items():
            @given(case=op.as_strategy(schemathesis.GenerationMode.POSITIVE),
                   hostile=hypothesis.strategies.sampled_from(HOSTILE_FIELDS[path]))
            @settings(max_examples=8, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
            def run(case, hostile):
                body = case.body
                if not isinstance(body, dict):
                    return
                # the fuzzed fields under a small valid core, so that many clean bodies are 200s; not
                # streamed: the error is then the status of the whole answer
                body = {**body, **VALID_CORE[path], "stream": False}
                (field, *_), value = hostile
                clean = http.post(path, json=body)
                r = http.post(path, content=json.dumps({**body, field: value}), headers={"content-type": "application/json"})
                if r.status_code >= 500 or r.status_code == 200:
                    failures.append(f"{path} {field}={value!r:.60} -> {r.status_code} {r.text[:300]}")
                elif clean.status_code == 200:
                    param = (r.json().get("error") or {}).get("param") or ""
                    if r.status_code != 400 or not param.startswith(field):
                        failures.append(f"{path} {field}={value!r:.60} -> {r.status_code} param {param!r}: {r.text[:300]}")
                    else:
                        refused_by_name[path] += 1
            run()
        assert not failures, "\n".join(failures[:10])
        assert all(n > 0 for n in refused_by_name.values()), refused_by_name  # some clean bodies were 200s
        assert http.get("/health").status_code == 200
