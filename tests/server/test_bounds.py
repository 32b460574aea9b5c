"""Bounds on a request's size: the body (--max-request-body-bytes, a 413) and its fields (ids, stop
strings, metadata, tools, logit_bias: a 400 naming the field); the server keeps serving after each."""

from __future__ import annotations

import json

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from jaxserve.core.size_limits import SIZE_LIMITS
from jaxserve.server.body_limit import BodySizeLimitMiddleware
from jaxserve.server.errors import EXCEPTION_HANDLERS

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
RESPONSES_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def _limited_app(max_bytes: int, idle_timeout_s: float = 60.0) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"bytes": len(await request.body())})

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])], exception_handlers=EXCEPTION_HANDLERS)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_bytes, idle_timeout_s=idle_timeout_s)
    return app


def _assert_413(r) -> None:
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["param"] is None and err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert "--max-request-body-bytes" in err["message"]


def test_a_body_over_the_bound_is_a_413_by_its_content_length():
    with TestClient(_limited_app(100)) as client:
        assert client.post("/echo", content=b"x" * 100).json() == {"bytes": 100}
        r = client.post("/echo", content=b"x" * 101)
        _assert_413(r)
        assert "Content-Length 101" in r.json()["error"]["message"]


def test_a_chunked_body_over_the_bound_is_a_413_as_it_arrives():
    def chunks(n: int):
        for _ in range(n):
            yield b"x" * 40

    with TestClient(_limited_app(100)) as client:
        assert client.post("/echo", content=chunks(2)).json() == {"bytes": 80}
        r = client.post("/echo", content=chunks(3))  # a generator: no Content-Length, Transfer-Encoding chunked
        _assert_413(r)


def test_the_real_server_refuses_a_body_over_its_default_bound(http):
    r = http.post(CHAT, content=b" " * (32 * 1024 * 1024 + 1), headers={"content-type": "application/json"})
    _assert_413(r)
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 2})
    assert r.status_code == 200, r.text


# (endpoint, body, param, text in the message)
OVER_BOUNDS = [
    ("/generate", {"text": "hi", "rid": "r" * 1_000_000}, "rid", "at most 256 characters"),
    ("/generate", {"text": ["hi", "yo"], "rid": ["a", "r" * 257]}, "rid", "at most 256 characters"),
    (CHAT, {"messages": MSG, "rid": "r" * 1_000_000}, "rid", "at most 256 characters"),
    ("/v1/completions", {"prompt": "hi", "rid": "r" * 257}, "rid", "at most 256 characters"),
    ("/v1/responses", {"input": "hi", "request_id": "r" * 1_000_000}, "request_id", "at most 256 characters"),
    (CHAT, {"messages": MSG, "stop": ["s"] * 10_000}, "stop", "at most 64 stop strings, got 10000"),
    (CHAT, {"messages": MSG, "stop": "s" * 100_000}, "stop", "at most 1024 bytes, got 100000"),
    ("/v1/completions", {"prompt": "hi", "stop": ["s" * 1025]}, "stop", "at most 1024 bytes"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["s"] * 10_000}}, "sampling_params.stop", "at most 64"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": "é" * 513}}, "sampling_params.stop", "got 1026"),
    ("/v1/responses", {"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 pairs"),
    ("/v1/responses", {"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata", "at most 64 characters"),
    ("/v1/responses", {"input": "hi", "metadata": {"k": "v" * 513}}, "metadata.k", "at most 512 characters"),
    (CHAT, {"messages": MSG, "tools": [TOOL] * 129}, "tools", "at most 128 tools, got 129"),
    ("/v1/responses", {"input": "hi", "tools": [RESPONSES_TOOL] * 129}, "tools", "at most 128 tools"),
    (CHAT, {"messages": MSG, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300 entries"),
]


@pytest.mark.parametrize("path,body,param,fragment", OVER_BOUNDS)
def test_a_field_over_its_bound_is_a_400_naming_it(http, path, body, param, fragment):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err
    assert len(r.content) < 2000  # the value is not echoed back


def test_fields_at_their_bounds_are_served_and_the_server_keeps_serving(http):
    body = {"messages": MSG, "max_tokens": 2, "rid": "r" * 256, "stop": ["s" * 1024] + ["t"] * 63}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    # 128 tools pass their bound (the test server's 256-token context may refuse the prompt they make)
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 2, "tools": [TOOL] * 128})
    assert r.status_code == 200 or r.json()["error"]["param"] != "tools", r.text
    r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "store": False,
                                         "metadata": {f"{i:064d}": "v" * 512 for i in range(16)}})
    assert r.status_code == 200, r.text


def test_every_bound_names_its_source():
    assert SIZE_LIMITS and all(source in ("OpenAI", "SGLang", "ours") for _, source in SIZE_LIMITS.values())


def _run_asgi(app, messages_in, hold_after: float | None = None) -> list[dict]:
    """Drive `app` with one POST /echo whose receive returns `messages_in` and then waits (forever, or
    `hold_after` seconds before an http.disconnect); returns what the app sent."""
    import asyncio

    async def main():
        sent, pending = [], list(messages_in)

        async def receive():
            if pending:
                return pending.pop(0)
            if hold_after is None:
                await asyncio.Event().wait()
            await asyncio.sleep(hold_after)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/echo", "raw_path": b"/echo", "query_string": b"",
                 "headers": [(b"content-length", b"10")], "http_version": "1.1", "scheme": "http",
                 "server": ("test", 80), "client": ("test", 1), "root_path": ""}
        await asyncio.wait_for(app(scope, receive, send), 10)
        return sent

    return asyncio.run(main())


def test_a_body_that_stops_arriving_is_a_408():
    """Before: Content-Length 10 and 1 byte held the connection and its handler with no end."""
    sent = _run_asgi(_limited_app(100, idle_timeout_s=0.2), [{"type": "http.request", "body": b"{", "more_body": True}])
    assert sent[0]["status"] == 408
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["error"]["code"] == "request_timeout" and "stopped arriving" in body["error"]["message"]


def test_after_the_whole_body_reads_wait_without_the_idle_timeout():
    """A streamed response waits on receive() for the client's disconnect: no 408 there."""
    async def wait_for_disconnect(request: Request) -> JSONResponse:
        await request.body()
        message = await request.receive()
        return JSONResponse({"next": message["type"]})

    app = Starlette(routes=[Route("/echo", wait_for_disconnect, methods=["POST"])], exception_handlers=EXCEPTION_HANDLERS)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=100, idle_timeout_s=0.1)
    sent = _run_asgi(app, [{"type": "http.request", "body": b"0123456789", "more_body": False}], hold_after=0.4)
    assert sent[0]["status"] == 200 and b"http.disconnect" in sent[1]["body"]
