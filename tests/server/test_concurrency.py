"""Many clients at once, clients that go away, and requests aborted or blocked while others run."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx

from tests.server.conftest import wait_idle

NUM_CONCURRENT = 16


def _prompt(i: int) -> str:
    return f"Request number {i}: tell me about item {i * 7 % 13}"


def test_concurrent_requests_equal_solo_outputs(http, base_url):
    params = {"max_new_tokens": 8, "temperature": 0}
    solo = [http.post("/generate", json={"text": _prompt(i), "sampling_params": params}).json()["output_ids"]
            for i in range(NUM_CONCURRENT)]

    async def run_all():
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            async def one(i: int):
                return await client.post("/generate", json={"text": _prompt(i), "sampling_params": params})

            return await asyncio.gather(*(one(i) for i in range(NUM_CONCURRENT)))

    responses = asyncio.run(run_all())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    assert [r.json()["output_ids"] for r in responses] == solo
    wait_idle(http)


def _long_stream_body(**extra) -> dict:
    return {"text": "Tell me a very long story", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}, **extra}


def test_streaming_client_disconnect_frees_its_pages(http, base_url):
    wait_idle(http)
    aborted_before = http.get("/get_server_info").json()["engine_stats"]["num_aborted_requests"]
    with httpx.Client(base_url=base_url, timeout=60) as client:
        with client.stream("POST", "/generate", json=_long_stream_body()) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(first[len("data: "):])["meta_info"]["finish_reason"] is None
    # the connection is closed here, long before 200 tokens
    info = wait_idle(http, timeout=5)
    assert info["engine_stats"]["num_aborted_requests"] == aborted_before + 1


def test_non_streaming_client_disconnect_aborts(http, base_url):
    wait_idle(http)
    aborted_before = http.get("/get_server_info").json()["engine_stats"]["num_aborted_requests"]
    body = {**_long_stream_body(), "stream": False}
    body["sampling_params"]["max_new_tokens"] = 240

    async def post_then_leave_while_it_runs():
        # Leave once the engine runs the request (not after a fixed time: on a fast machine the whole
        # generation can end first, and then there is nothing to abort).
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            post = asyncio.create_task(client.post("/generate", json=body))
            deadline = time.monotonic() + 30
            while (await client.get("/get_server_info")).json()["num_running_reqs"] == 0:
                assert not post.done(), "the request ended before the engine reported it running"
                assert time.monotonic() < deadline, "the request never started running"
                await asyncio.sleep(0.005)
            post.cancel()  # closes the connection mid-request
            try:
                await post
            except asyncio.CancelledError:
                pass

    asyncio.run(post_then_leave_while_it_runs())
    info = wait_idle(http, timeout=10)
    assert info["engine_stats"]["num_aborted_requests"] == aborted_before + 1


def test_abort_request_and_flush_cache_while_running(http, base_url):
    wait_idle(http)
    events: list[dict] = []
    started = threading.Event()

    def consume():
        with httpx.Client(base_url=base_url, timeout=60) as client:
            with client.stream("POST", "/generate", json=_long_stream_body(rid="abort-me")) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[len("data: "):]))
                        started.set()

    thread = threading.Thread(target=consume)
    thread.start()
    assert started.wait(60)
    busy = http.post("/flush_cache")
    assert busy.status_code == 400 and "running" in busy.json()["error"]["message"]
    assert http.post("/abort_request", json={"rid": "abort-me"}).json() == {"success": True}
    thread.join(30)
    assert not thread.is_alive()
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(events[-1]["output_ids"]) < 200
    wait_idle(http)
    assert http.post("/abort_request", json={"rid": "abort-me"}).json() == {"success": False}
    assert http.post("/flush_cache").status_code == 200


def test_abort_all_ends_every_request(http, base_url):
    """SGLang's `{"abort_all": true}` (its AbortReq field) was a 400 asking for a rid."""
    wait_idle(http)
    finals: dict[int, dict] = {}
    streaming = threading.Event()

    def consume():
        # both prompts in one batch: admitted in one step, so neither can run its 200 tokens to the
        # end while the other is still waiting for its first (two separate streams raced so under load)
        body = _long_stream_body(text=["Tell me a very long story", "Tell me another long story"], rid=["all-0", "all-1"])
        with httpx.Client(base_url=base_url, timeout=60) as client:
            with client.stream("POST", "/generate", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[len("data: "):])
                        finals[event["index"]] = event
                        if len(finals) == 2:
                            streaming.set()

    threads = [threading.Thread(target=consume)]
    for t in threads:
        t.start()
    assert streaming.wait(60)
    r = http.post("/abort_request", json={"abort_all": True})
    assert r.status_code == 200 and r.json() == {"success": True, "num_aborted": 2}, r.text
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    for final in finals.values():
        assert final["meta_info"]["finish_reason"]["type"] == "abort" and len(final["output_ids"]) < 200
    wait_idle(http)
    bad = http.post("/abort_request", json={"abort_all": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "abort_all", bad.text
    assert http.post("/abort_request", json={"abort_all": True}).json() == {"success": True, "num_aborted": 0}


def test_duplicate_rid_is_rejected(http, base_url):
    wait_idle(http)
    results: list[int] = []

    def first():
        with httpx.Client(base_url=base_url, timeout=60) as client:
            with client.stream("POST", "/generate", json=_long_stream_body(rid="dup")) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        results.append(1)
                        dup = client.post("/generate", json={"text": "x", "rid": "dup"})
                        results.append(dup.status_code)
                        client.post("/abort_request", json={"rid": "dup"})
                        break

    first()
    assert results[-1] == 400
    start = time.monotonic()
    wait_idle(http)
    assert time.monotonic() - start < 10
