"""The Starlette app over an EngineLoop with a fake engine (no model, no subprocess): auth, the error
shape of an engine failure, and how OpenAI fields map onto sampling params."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.engine_loop import EngineLoop
from jaxserve.server.app import create_app, served_model_name
from jaxserve.server.errors import APIError
from jaxserve.server.openai.chat_completions import sampling_params_of
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.server_args import ServerArgs
from tests.server.fakes import FakeEngine


@pytest.fixture
def engine_loop():
    loop = EngineLoop(FakeEngine()).start()
    yield loop
    loop.shutdown()


def _client(engine_loop, **args) -> TestClient:
    return TestClient(create_app(engine_loop, ServerArgs(model_path="/models/fake-model", **args)))


def test_api_key(engine_loop):
    with _client(engine_loop, api_key="secret") as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 401
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert client.post("/generate", json={"text": "hi"}).status_code == 401
        assert client.get("/health").status_code == 200  # liveness probes need no key
        # as SGLang 0.5.23: /health*, /ready* and /metrics* need no key; everything else does
        assert client.get("/health_generate").status_code == 200
        assert client.get("/metrics").status_code == 404  # let through (the fake engine has no metrics)
        assert client.get("/get_load").status_code == 401
        assert client.get("/healthz_not_a_route").status_code == 404  # let through, then not found
        for scheme in ("bearer", "BEARER", "Bearer"):  # the scheme in any case (RFC 7235)
            assert client.get("/get_load", headers={"Authorization": f"{scheme} secret"}).status_code == 200
        for value in ("Basic secret", "Bearer  secret", "Bearersecret", "bearer Secret"):
            assert client.get("/get_load", headers={"Authorization": value}).status_code == 401
        r = client.get("/v1/models", headers={"Authorization": "Bearer secret"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake-model"
        info = client.get("/get_server_info", headers={"Authorization": "Bearer secret"}).json()
        assert info["api_key"] == "***"


@pytest.mark.parametrize("api_key", [None, "secret"])
def test_browser_cross_origin_calls_as_sglang_allows_them(engine_loop, api_key):
    """Before: a browser's preflight OPTIONS got 405 and no route answered with CORS headers."""
    origin = {"Origin": "http://localhost:5173"}
    with _client(engine_loop, api_key=api_key) as client:
        r = client.options("/v1/chat/completions", headers={
            **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"})
        assert r.status_code == 200, r.text  # a preflight needs no API key
        assert r.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        auth = {"Authorization": "Bearer secret"} if api_key else {}
        r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}, headers={**origin, **auth})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:5173"
        if api_key:  # a refused call still says so to the page, which can then read the 401
            r = client.get("/get_load", headers=origin)
            assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://localhost:5173"


def test_no_api_key_needed_by_default(engine_loop):
    with _client(engine_loop) as client:
        r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200 and r.json()["output_ids"] == [7, 7, 7]


def test_engine_failure_is_a_500_with_the_error_shape_then_everything_is_503(engine_loop):
    with _client(engine_loop) as client:
        with client.stream("POST", "/generate", json={"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 50}}) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "error" not in json.loads(first[6:])
            engine_loop.engine.fail_next_step = True
            data = [line[6:] for line in lines if line.startswith("data: ")]
        err = json.loads(data[-2])["error"]
        assert "boom" in err["message"] and err["type"] == "server_error" and data[-1] == "[DONE]"
        for path in ("/health", "/health_generate"):
            r = client.get(path)
            assert r.status_code == 503 and "boom" in r.json()["error"]["message"], path
        r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
        info = client.get("/get_server_info").json()  # operators can still read why
        assert "boom" in info["engine_error"] and info["num_step_failures"] == 1


def test_engine_failure_of_a_non_streamed_request_is_a_500(engine_loop):
    engine_loop.engine.fail_next_step = True
    with _client(engine_loop) as client:
        r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 5}})
        assert r.status_code == 500
        err = r.json()["error"]
        assert "boom" in err["message"] and err["type"] == "server_error" and err["code"] == "engine_error"


def test_sampling_params_mapping():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "top_p": None,
        "temperature": 0.5, "stop": "END", "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [3],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}},
    })
    params = sampling_params_of(req, 5)
    assert params == SamplingParams(max_new_tokens=5, min_new_tokens=2, temperature=0.5, n=1, stop=("END",),
                                    stop_token_ids=(3,), ignore_eos=True, json_schema='{"type": "integer"}')
    obj = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "json_object"}})
    assert json.loads(sampling_params_of(obj, 16).json_schema) == {"type": "object"}
    extra = CompletionRequest.model_validate({"prompt": "x", "regex": "[ab]+", "json_schema": {"type": "string"}})
    assert sampling_params_of(extra, 16).regex == "[ab]+"
    both = CompletionRequest.model_validate({"prompt": "x", "json_schema": "{}", "response_format": {"type": "json_object"}})
    with pytest.raises(APIError) as e:
        sampling_params_of(both, 16)
    assert e.value.param == "response_format"


def test_served_model_name():
    assert served_model_name(ServerArgs(), "/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert served_model_name(ServerArgs(model_path="/m/llama.Q8_0.gguf"), "/m/llama.Q8_0.gguf") == "llama"
    assert served_model_name(ServerArgs(model_path="/m/hf_dir/"), "/m/hf_dir/") == "hf_dir"
    assert served_model_name(ServerArgs(served_model_name="mine"), "/m/x") == "mine"


def test_cli_help_states_each_default_once():
    import argparse
    import dataclasses

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    helps = {a.dest: a.help for a in parser._actions if a.dest != "help"}
    assert len(helps) == len(dataclasses.fields(ServerArgs))
    for dest, text in helps.items():
        assert text.count("(default") == 1, f"--{dest}: {text!r}"
    assert "(default: the model's, capped at 8192)" in helps["context_length"]  # its own words, no "None"
    assert helps["port"].endswith(f"(default: {ServerArgs().port})")


def test_a_slow_request_preparation_does_not_block_the_server(engine_loop):
    """Tokenizing (and grammar checks) run off the event loop, on one preprocessing thread: the server
    keeps answering (and streaming) meanwhile. Other prompts queue behind it, as in SGLang's one
    tokenizer manager."""
    import concurrent.futures
    import threading

    started, release = threading.Event(), threading.Event()
    released_in_time = []
    fast_tokenize = engine_loop.engine.checker.tokenize

    def tokenize(prompt, add_special_tokens=True):
        if prompt == "slow":
            started.set()
            released_in_time.append(release.wait(10))  # the test releases it once the other request is served
        return fast_tokenize(prompt, add_special_tokens)

    engine_loop.engine.checker.tokenize = tokenize
    body = {"sampling_params": {"max_new_tokens": 2}}
    # as a context manager the client runs every request on one event loop, as a server does
    with _client(engine_loop) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(client.post, "/generate", json={"text": "slow", **body})
        assert started.wait(30)
        other = client.get("/v1/models")  # answered while "slow" tokenizes
        assert other.status_code == 200 and other.json()["data"]
        assert not slow.done()
        release.set()
        assert slow.result(timeout=30).status_code == 200
    assert released_in_time == [True], "the other request waited for the slow one's tokenizing"


@pytest.mark.parametrize("log_requests", [True, False])
def test_log_requests_logs_one_line_per_finished_sequence(caplog, log_requests):
    import dataclasses
    import logging

    engine = FakeEngine()
    engine.args = dataclasses.replace(engine.args, log_requests=log_requests)
    loop = EngineLoop(engine).start()
    try:
        with TestClient(create_app(loop, engine.args)) as client, caplog.at_level(logging.INFO):
            r = client.post("/generate", json={"text": "hi", "rid": "r1",
                                               "sampling_params": {"max_new_tokens": 3, "n": 2}})
            assert r.status_code == 200
    finally:
        loop.shutdown()
    lines = sorted(rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("request finished"))
    if not log_requests:
        assert lines == []
        return
    assert len(lines) == 2  # one per sequence of n=2
    for line, rid in zip(lines, ("r1-0", "r1-1")):
        assert line.startswith(f"request finished rid={rid} prompt_tokens=2 completion_tokens=3 cached_tokens=0 "
                               "finish_reason=length e2e_latency="), line


def test_a_draining_server_still_answers_the_model_routes(engine_loop):
    """GET /v1/models/{model} is as read-only as /v1/models: answered while the server drains on SIGTERM."""
    with _client(engine_loop) as client:
        client.app.state.draining = True
        assert client.get("/v1/models").status_code == 200
        r = client.get("/v1/models/fake-model")
        assert r.status_code == 200 and r.json()["id"] == "fake-model"
        assert client.get("/v1/models/other").status_code == 404
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 503
        assert client.get("/health").status_code == 503


def test_openapi_documents_the_model_card_route():
    from jaxserve.server.openapi import openapi_document

    op = openapi_document()["paths"]["/v1/models/{model}"]["get"]
    assert op["parameters"][0]["name"] == "model" and op["parameters"][0]["in"] == "path"
    assert op["responses"]["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ModelCard"}
    assert "404" in op["responses"]
