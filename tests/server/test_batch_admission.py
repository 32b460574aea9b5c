"""A batch is admitted to the waiting queue whole or not at all (fake engine, no model).

Before: a batch's prompts were queued one by one, so a batch over --max-queued-requests filled the
queue (other clients got 503s) until its last prompt was refused and the rest removed again.
"""

from __future__ import annotations

import threading
import time

import pytest
from starlette.testclient import TestClient

from jaxserve.engine.engine_loop import EngineLoop, EngineUnavailableError, RequestError
from jaxserve.server.app import create_app
from jaxserve.server_args import ServerArgs
from tests.server.fakes import FakeEngine

QUEUE = 4


class RecordingEngine(FakeEngine):
    """Runs one request at a time (the others wait) and records every prompt it was given."""

    def __init__(self):
        super().__init__(step_time=0.01)
        self.prompts: list[list[int]] = []
        self.order: list[str] = []
        self.scheduler.config.max_running_requests = 1

    def add_request(self, checked):
        self.prompts.append(list(checked.input_ids))
        rids = super().add_request(checked)
        self.order += rids
        return rids

    def step(self):
        running = [r for r in self.order if r in self.reqs][:1]
        waiting = {r: self.reqs.pop(r) for r in list(self.reqs) if r not in running}
        try:
            return super().step()
        finally:
            self.reqs.update(waiting)
            self.scheduler.num_running = len(running)


@pytest.fixture
def setup():
    engine = RecordingEngine()
    loop = EngineLoop(engine, max_queued_requests=QUEUE).start()
    with TestClient(create_app(loop, ServerArgs(model_path="/models/fake-model"))) as client:
        yield engine, loop, client
    loop.shutdown()


def _wait(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_batch_that_can_never_fit_is_a_400_and_queues_nothing(setup):
    """More sequences than the one running slot plus QUEUE waiting places can never fit."""
    engine, loop, client = setup
    r = client.post("/generate", json={"text": ["hi"] * (QUEUE + 2), "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "text" and "--max-queued-requests" in err["message"]
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": QUEUE + 2}})
    assert r.status_code == 400
    r = client.post("/v1/completions", json={"model": "m", "prompt": ["hi"] * 3, "n": 2, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "n": QUEUE + 2, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    time.sleep(0.05)
    assert engine.prompts == [] and loop.num_pending == 0
    assert client.post("/generate", json={"text": ["hi"] * (QUEUE + 1), "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_a_batch_without_room_now_is_a_503_and_queues_nothing(setup):
    engine, loop, client = setup
    done = threading.Event()
    loop.submit("a", {"max_new_tokens": 40}, on_output=lambda o: o.finished and done.set())
    _wait(lambda: loop.load().num_running_reqs == 1)
    loop.submit("b", {"max_new_tokens": 1}, on_output=lambda o: None)  # waits: 3 places left
    r = client.post("/generate", json={"text": ["zz"] * QUEUE, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "3 free places and the batch needs 4" in r.json()["error"]["message"]
    time.sleep(0.05)
    zz = engine.checker.tokenize("zz")
    assert zz not in engine.prompts
    # the whole room a refused batch would have taken stays free for another client
    r = client.post("/generate", json={"text": ["yy"] * (QUEUE - 1), "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text
    done.wait(5)


def test_reservation_is_spent_by_submits_and_released(setup):
    engine, loop, _ = setup
    res = loop.reserve(3)
    with pytest.raises(EngineUnavailableError):
        loop.reserve(3)  # 3 held + 3 > 1 free running slot + 4 queued
    loop.submit("a", {"max_new_tokens": 1}, on_output=lambda o: None, reservation=res)
    assert res.num_left == 2
    loop.release(res)
    assert loop.reserve(QUEUE - 1).num_left == QUEUE - 1
    with pytest.raises(RequestError, match="max-queued-requests"):
        loop.reserve(QUEUE + 2, "text")


def test_load_counts_waiting_and_reserved_requests_between_snapshots():
    """The load snapshot is published after each step; during a long step it showed 0 waiting while
    the queue refused requests (a router polling /get_load saw a full worker as idle)."""
    engine = FakeEngine(step_time=0.5)
    loop = EngineLoop(engine, max_queued_requests=QUEUE).start()
    try:
        loop.submit("a", {"max_new_tokens": 2}, on_output=lambda o: None)
        res = loop.reserve(2)
        with TestClient(create_app(loop, ServerArgs(model_path="/models/fake-model"))) as client:
            body = client.get("/get_load").json()
            load = body[0] if isinstance(body, list) else body
        assert loop.load().num_running_reqs + loop.load().num_waiting_reqs >= 3
        assert load["num_reqs"] >= 3, load
        loop.release(res)
    finally:
        loop.shutdown()


@pytest.mark.parametrize("route,body,param", [
    ("/generate", {"text": ["hi", "there", ""], "sampling_params": {"max_new_tokens": 1}}, "text[2]"),
    ("/generate", {"input_ids": [[5], [6], [10**6]], "sampling_params": {"max_new_tokens": 1}}, "input_ids[2]"),
    ("/v1/completions", {"model": "m", "prompt": [[5], [6], [10**6]], "max_tokens": 1}, "prompt"),
], ids=["generate-empty-text", "generate-ids", "completions-ids"])
def test_a_batch_with_one_bad_prompt_runs_none_of_it(setup, route, body, param):
    """Every prompt of a batch is checked before any is submitted: a late bad prompt leaves nothing
    prefilled or aborted behind its 400 (before, the prompts ahead of it ran a step, then were aborted)."""
    engine, loop, client = setup
    r = client.post(route, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    time.sleep(0.05)
    assert engine.prompts == [] and loop.num_pending == 0
