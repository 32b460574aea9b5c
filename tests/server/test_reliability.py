"""Faults and overload against a real server (scripts/serve.py on the tiny checkpoint): engine death,
the bounded queue, and the SIGTERM drain. Each test starts its own server, since each ends it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import warnings

import httpx
import pytest

from tests.server.conftest import TINY_SERVER_FLAGS, ServerProcess

FAULT_ENV = "JAXSERVE_TEST_FAULT_FILE"
LONG = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}


def _start(tiny_model_dir, tmp_path, *flags: str, env: dict | None = None) -> ServerProcess:
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:  # ServerProcess passes os.environ to the child
        proc = ServerProcess(["--model-path", tiny_model_dir, *TINY_SERVER_FLAGS, *flags], tmp_path / "server.log")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    proc.wait_healthy()
    return proc


async def _stream_events(client: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None) -> list:
    events = []
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if started is not None and len(events) == 1:
                    started.set()
    return events


def _tracebacks(log: str) -> list[list[str]]:
    """Each Python traceback in `log` as its lines, the exception line last (the line before the
    traceback, which names the logger's message, first)."""
    lines = log.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            end = i + 1
            while end < len(lines) and (lines[end].startswith(" ") or not lines[end].strip()):
                end += 1
            found.append(lines[max(i - 1, 0):end + 1])
    return found


def _warm(url: str) -> None:
    """Compile the buckets the test uses before it times anything."""
    httpx.post(url + "/generate", json={"text": "warm up", "sampling_params": {"max_new_tokens": 4}}, timeout=300)


def test_engine_death_fails_every_request_and_the_process_exits_non_zero(tiny_model_dir, tmp_path):
    fault = tmp_path / "fault"
    server = _start(tiny_model_dir, tmp_path, env={FAULT_ENV: str(fault)})
    try:
        _warm(server.url)

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                streams_started = [asyncio.Event() for _ in range(4)]
                streams = [asyncio.create_task(_stream_events(client, {"text": f"story {i}", "sampling_params": LONG}, e))
                           for i, e in enumerate(streams_started)]
                posts = [asyncio.create_task(client.post("/generate", json={"text": f"essay {i}", "sampling_params": LONG}))
                         for i in range(4)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streams_started)), 60)
                fault.touch()
                t0 = time.monotonic()
                results = await asyncio.gather(*streams, *posts)
                return results, time.monotonic() - t0

        results, elapsed = asyncio.run(run())
        assert elapsed < 5, elapsed
        for events in results[:4]:
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["type"] == "server_error" and "InjectedFault" in err["message"]
        for r in results[4:]:
            assert r.status_code == 500 and "InjectedFault" in r.json()["error"]["message"]
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and "InjectedFault" in health.json()["error"]["message"]
        assert server.proc.wait(60) != 0
        # the death is logged once, with its traceback; the failed requests add none of their own
        log = server.log()
        died = log.index("the engine died (InjectedFault")
        after = _tracebacks(log[died:])
        assert [t[-1] for t in after] == [f"jaxserve.engine.engine_loop.InjectedFault: fault injected through {FAULT_ENV}"], after
        if earlier := _tracebacks(log[:died]):  # not this test's subject; CI once logged 12 here, cause unknown
            warnings.warn(f"the server logged {len(earlier)} tracebacks before the fault: {earlier}")
    finally:
        server.stop()


def test_overload_is_a_503_with_retry_after(tiny_model_dir, tmp_path):
    server = _start(tiny_model_dir, tmp_path, "--max-queued-requests", "4", "--max-running-requests", "2")
    try:
        _warm(server.url)
        params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
        bodies = [{"text": f"Request {i}: tell me about item {i * 7 % 13}", "sampling_params": params} for i in range(16)]

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                return await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))

        responses = asyncio.run(run())
        ok = [i for i, r in enumerate(responses) if r.status_code == 200]
        rejected = [r for r in responses if r.status_code != 200]
        assert len(ok) >= 4 and rejected, [r.status_code for r in responses]  # the queue bound is admitted at least
        for r in rejected:
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "unavailable" and "queue is full" in r.json()["error"]["message"]
        with httpx.Client(base_url=server.url, timeout=120) as http:
            for i in ok:  # alone, one at a time: the same greedy output
                assert http.post("/generate", json=bodies[i]).json()["output_ids"] == responses[i].json()["output_ids"]
            metrics = http.get("/metrics").text
        line = next(x for x in metrics.splitlines() if x.startswith("jaxserve_num_rejected_requests_total") and "queue_full" in x)
        assert float(line.split()[-1]) == len(rejected)
    finally:
        server.stop()


def test_sigterm_drains_running_streams_and_exits_zero(tiny_model_dir, tmp_path):
    server = _start(tiny_model_dir, tmp_path)
    try:
        _warm(server.url)

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                started = [asyncio.Event() for _ in range(4)]
                streams = [asyncio.create_task(_stream_events(client, {"text": f"tale {i}", "sampling_params": LONG}, e))
                           for i, e in enumerate(started)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                async with httpx.AsyncClient(base_url=server.url, timeout=10) as fresh:
                    during = await fresh.post("/generate", json={"text": "late", "sampling_params": {"max_new_tokens": 2}})
                    health = await fresh.get("/health")
                return await asyncio.gather(*streams), during, health

        results, during, health = asyncio.run(run())
        assert during.status_code == 503 and "shutting down" in during.json()["error"]["message"]
        assert health.status_code == 503
        for events in results:
            assert events[-1] == "[DONE]"
            last = json.loads(events[-2])
            assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
            assert len(last["output_ids"]) == 200
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


@pytest.mark.parametrize("timeout_s", ["0.5"])
def test_sigterm_past_the_shutdown_timeout_aborts_with_a_reason(tiny_model_dir, tmp_path, timeout_s):
    server = _start(tiny_model_dir, tmp_path, "--shutdown-timeout", timeout_s, "--context-length", "4096",
                    env={"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"})  # past the tiny model's 1024
    try:
        _warm(server.url)
        long = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                started = asyncio.Event()
                stream = asyncio.create_task(_stream_events(client, {"text": "saga", "sampling_params": long}, started))
                await asyncio.wait_for(started.wait(), 60)
                server.proc.send_signal(signal.SIGTERM)
                return await stream

        events = asyncio.run(run())
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        reason = last["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "--shutdown-timeout" in reason["message"], reason
        assert 0 < len(last["output_ids"]) < 4000
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


def test_keep_alive_on_engine_error_stays_up_answering_503(tiny_model_dir, tmp_path):
    fault = tmp_path / "fault"
    server = _start(tiny_model_dir, tmp_path, "--keep-alive-on-engine-error", env={FAULT_ENV: str(fault)})
    try:
        _warm(server.url)
        fault.touch()
        r = httpx.post(server.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
        assert r.status_code == 500 and "InjectedFault" in r.json()["error"]["message"]
        time.sleep(4)  # past the 3 s after which a server without the flag exits
        assert server.proc.poll() is None
        assert httpx.get(server.url + "/health", timeout=5).status_code == 503
        r = httpx.post(server.url + "/generate", json={"text": "x"}, timeout=10)
        assert r.status_code == 503 and "InjectedFault" in r.json()["error"]["message"]
        assert "InjectedFault" in httpx.get(server.url + "/get_server_info", timeout=5).json()["engine_error"]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 1  # the engine died: a supervisor should still see a failure
    finally:
        server.stop()


def test_a_second_sigterm_exits_at_once(tiny_model_dir, tmp_path):
    server = _start(tiny_model_dir, tmp_path, "--shutdown-timeout", "300", "--context-length", "4096",
                    env={"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"})  # past the tiny model's 1024
    try:
        _warm(server.url)
        long = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/generate", json={"text": "epic", "stream": True, "sampling_params": long}) as r:
                lines = r.iter_lines()  # held: a closed line iterator would close the connection
                assert next(line for line in lines if line.startswith("data: "))
                server.proc.send_signal(signal.SIGTERM)
                time.sleep(0.5)
                assert server.proc.poll() is None  # draining: the stream may go on for 300 s
                server.proc.send_signal(signal.SIGTERM)
                assert server.proc.wait(10) == 1
    finally:
        server.stop()
