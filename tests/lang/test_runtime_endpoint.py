"""RuntimeEndpoint against a scripted HTTP server (httpx.MockTransport): requests, SSE, errors."""

from __future__ import annotations

import json

import httpx
import pytest

from jaxserve.lang import BackendError, RuntimeEndpoint, function, gen, select

MODEL_INFO = {"model_path": "/nowhere/model.gguf", "tokenizer_path": "/nowhere/model.gguf", "is_generation": True}


def endpoint(handler, **kwargs) -> RuntimeEndpoint:
    def route(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json=MODEL_INFO)
        return handler(request)

    return RuntimeEndpoint("http://test", transport=httpx.MockTransport(route), **kwargs)


def test_generate_sends_sglang_native_request():
    seen = []

    def handler(request):
        seen.append((request.url.path, json.loads(request.content), request.headers.get("authorization")))
        return httpx.Response(200, json={"text": " Paris", "output_ids": [1, 2], "meta_info": {"cached_tokens": 0}})

    backend = endpoint(handler, api_key="secret")
    result = backend.generate("The capital is", {"max_new_tokens": 4})
    assert result.text == " Paris" and result.output_ids == [1, 2]
    assert seen == [("/generate", {"text": "The capital is", "sampling_params": {"max_new_tokens": 4}}, "Bearer secret")]


@pytest.mark.parametrize("param", ["regex", "sampling_params.regex", "sampling_params[0].regex"])
def test_http_400_raises_with_the_servers_message(param):
    def handler(request):
        body = {"error": {"message": "regex: invalid regex '(': missing )", "type": "invalid_request_error",
                          "param": param, "code": "invalid_value"}}
        return httpx.Response(400, json=body)

    @function
    def prog(s):
        s += "x" + gen("y", regex="(")

    with pytest.raises(BackendError) as info:
        prog.run(backend=endpoint(handler))
    assert isinstance(info.value, RuntimeError)
    assert info.value.status_code == 400 and info.value.param == "regex"
    assert info.value.message == "regex: invalid regex '(': missing )"


def test_http_500_with_a_plain_body():
    backend = endpoint(lambda request: httpx.Response(503, text="overloaded"))
    with pytest.raises(BackendError, match="503.*overloaded"):
        backend.generate("x", {})


def test_unreachable_server_raises_backend_error():
    def refuse(request):
        raise httpx.ConnectError("connection refused")

    with pytest.raises(BackendError, match="connection refused"):
        RuntimeEndpoint("http://test", transport=httpx.MockTransport(refuse))


def test_stream_parses_cumulative_sse_text():
    events = [{"text": "Hel", "output_ids": [1], "meta_info": {}}, {"text": "Hello", "output_ids": [1, 2], "meta_info": {"completion_tokens": 2}}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def handler(request):
        assert json.loads(request.content)["stream"] is True
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    chunks = list(endpoint(handler).generate_stream("x", {}))
    assert [c.text_delta for c in chunks] == ["Hel", "lo", ""]
    assert chunks[-1].result.text == "Hello" and chunks[-1].result.meta_info == {"completion_tokens": 2}


def test_stream_error_event_raises():
    body = 'data: {"error": {"message": "engine error: boom", "code": 500}}\n\n'
    backend = endpoint(lambda request: httpx.Response(200, text=body))
    with pytest.raises(BackendError, match="boom"):
        list(backend.generate_stream("x", {}))


def test_select_is_one_batched_logprob_request(default_tokenizer):
    requests = []

    def handler(request):
        body = json.loads(request.content)
        requests.append(body)
        start = body["logprob_start_len"]
        out = [{"text": "", "meta_info": {"input_token_logprobs": [[-0.5 if t == ids[-1] else -2.0, t, None] for t in ids[start:]]}}
               for ids in body["input_ids"]]
        return httpx.Response(200, json=out)

    @function
    def pick(s):
        s += "Answer:\n" + select("c", ["yes", "maybe so"])

    state = pick.run(backend=endpoint(handler, tokenizer=default_tokenizer))
    assert len(requests) == 1
    body = requests[0]
    assert body["return_logprob"] is True and body["sampling_params"] == {"max_new_tokens": 1, "temperature": 0}
    assert body["input_ids"] == [default_tokenizer.encode("Answer:\n" + c, add_special_tokens=False) for c in ["yes", "maybe so"]]
    assert state["c"] == "yes"  # one token at -0.5 beats a mean of (-2 - 2 - 0.5) / 3


def test_missing_tokenizer_is_a_clear_error():
    @function
    def pick(s):
        s += select("c", ["a", "b"])

    with pytest.raises(BackendError, match="tokenizer=") as info:
        pick.run(backend=endpoint(lambda request: httpx.Response(500)))
    assert "/nowhere/model.gguf" in str(info.value)
