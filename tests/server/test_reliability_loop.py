"""Admission control and draining of the EngineLoop, with a fake engine (no model): the queue bound,
the queue timeout, abort_all, the fault-injection hook and the default queue size."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from jaxserve.core.request import finish_abort, finish_length
from jaxserve.engine.engine_loop import (
    FAULT_FILE_ENV,
    EngineLoop,
    EngineUnavailableError,
    default_max_queued_requests,
)
from tests.server.fakes import FakeEngine


class QueueingEngine(FakeEngine):
    """FakeEngine that runs at most `max_running` requests; the others wait in `scheduler.waiting`."""

    def __init__(self, max_running: int, step_time: float = 0.005):
        super().__init__(step_time)
        self.max_running = max_running
        self.scheduler.config.max_running_requests = max_running
        self.order: list[str] = []

    def add_request(self, checked):
        rids = super().add_request(checked)
        self.order += rids
        return rids

    def step(self):
        running = [r for r in self.order if r in self.reqs][: self.max_running]
        waiting = {r: self.reqs.pop(r) for r in list(self.reqs) if r not in running}
        try:
            outs = super().step()
        finally:
            self.reqs.update(waiting)
        self.scheduler.num_running = len(running)
        self.scheduler.waiting = [SimpleNamespace(rid=r, fill_len=1) for r in waiting]
        return outs


class Finals:
    def __init__(self):
        self.outputs = {}
        self.lock = threading.Lock()

    def __call__(self, out):
        if out.finished:
            with self.lock:
                self.outputs[out.rid] = out


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_waiting_queue_is_bounded():
    loop = EngineLoop(QueueingEngine(max_running=2, step_time=0.01), max_queued_requests=3).start()
    try:
        finals = Finals()
        rids = [loop.submit("a", {"max_new_tokens": 20}, on_output=finals)[0] for _ in range(2)]
        wait_for(lambda: loop.load().num_running_reqs == 2)
        rids += [loop.submit("b", {"max_new_tokens": 20}, on_output=finals)[0] for _ in range(3)]
        with pytest.raises(EngineUnavailableError, match="queue is full") as e:
            loop.submit("c", {"max_new_tokens": 20}, on_output=finals)
        assert e.value.retry_after_s == 1
        with pytest.raises(EngineUnavailableError):  # n sequences count as n waiting requests
            loop.submit("c", {"max_new_tokens": 20, "n": 2}, on_output=finals)
        assert loop.load().num_rejected_queue_full == 2
        wait_for(lambda: len(finals.outputs) == 5)
        assert all(finals.outputs[r].meta.finish_reason == finish_length(20) for r in rids)
        assert loop.submit("d", {"max_new_tokens": 1}, on_output=finals)  # room again
    finally:
        loop.shutdown()


def test_a_burst_on_an_idle_loop_fills_the_free_slots_and_the_queue():
    """12 concurrent requests at --max-running-requests 2 --max-queued-requests 2: 4 fit (2 run, 2 wait).
    Before: requests submitted between two schedules all counted as waiting, so 2 fit and 10 were
    refused while both running slots were free."""
    loop = EngineLoop(QueueingEngine(max_running=2, step_time=0.05), max_queued_requests=2).start()
    try:
        finals, barrier = Finals(), threading.Barrier(12)
        accepted, refused = [], []

        def client(i):
            barrier.wait()
            try:
                accepted.append(loop.submit(f"p{i}", {"max_new_tokens": 3}, on_output=finals)[0])
            except EngineUnavailableError:
                refused.append(i)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(accepted) == 4 and len(refused) == 8, (accepted, refused)
        wait_for(lambda: len(finals.outputs) == 4)
        assert all(finals.outputs[r].meta.finish_reason == finish_length(3) for r in accepted)
    finally:
        loop.shutdown()


def test_slots_left_free_by_a_blocked_schedule_do_not_widen_the_queue():
    """When the last schedule left a request waiting (KV or slots blocked it), no free slot is
    counted: a newcomer would wait behind it."""
    engine = QueueingEngine(max_running=4, step_time=0.01)
    loop = EngineLoop(engine, max_queued_requests=1)
    engine.scheduler.waiting = [SimpleNamespace(fill_len=1)]  # as a schedule that could not admit a request leaves it
    loop._publish_load()
    assert loop.load().num_free_slots == 0
    loop.submit("a", {"max_new_tokens": 1}, on_output=lambda o: None)
    with pytest.raises(EngineUnavailableError, match="queue is full"):
        loop.submit("b", {"max_new_tokens": 1}, on_output=lambda o: None)


def test_a_request_waiting_past_the_queue_timeout_ends_with_503():
    loop = EngineLoop(QueueingEngine(max_running=1, step_time=0.01), queue_timeout_s=0.1).start()
    try:
        finals = Finals()
        first = loop.submit("a", {"max_new_tokens": 30}, on_output=finals)[0]  # ~0.3 s of steps
        second = loop.submit("b", {"max_new_tokens": 2}, on_output=finals)[0]
        wait_for(lambda: len(finals.outputs) == 2)
        assert finals.outputs[first].meta.finish_reason == finish_length(30)
        reason = finals.outputs[second].meta.finish_reason
        assert reason.kind == "abort" and reason.status_code == 503 and "--queue-timeout" in reason.message
        assert loop.load().num_queue_timeouts == 1
        wait_for(lambda: not loop.engine.reqs)  # the aborted request left the engine
    finally:
        loop.shutdown()


def test_abort_all_cuts_every_request_short_with_the_message():
    loop = EngineLoop(QueueingEngine(max_running=1, step_time=0.01)).start()
    try:
        finals = Finals()
        rids = [loop.submit("a", {"max_new_tokens": 60}, on_output=finals)[0] for _ in range(3)]
        time.sleep(0.05)
        assert loop.abort_all("shutting down now").result(5) == 3
        assert set(finals.outputs) == set(rids)
        for out in finals.outputs.values():
            assert out.meta.finish_reason == finish_abort("shutting down now")
        wait_for(lambda: not loop.engine.reqs and loop.num_pending == 0)
        assert loop.is_running  # aborting is not dying
    finally:
        loop.shutdown()


def test_the_fault_file_kills_the_loop(tmp_path, monkeypatch):
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))
    loop = EngineLoop(FakeEngine(step_time=0.02)).start()
    try:
        finals = Finals()
        rid = loop.submit("a", {"max_new_tokens": 60}, on_output=finals)[0]
        time.sleep(0.05)
        assert not finals.outputs and loop.is_running
        fault.touch()
        wait_for(lambda: rid in finals.outputs)
        reason = finals.outputs[rid].meta.finish_reason
        assert reason.status_code == 500 and "InjectedFault" in reason.message
        assert loop.error.startswith("InjectedFault") and not loop.is_running
    finally:
        loop.shutdown()


def test_default_queue_bound_follows_the_pool():
    assert default_max_queued_requests(1024) == 128
    assert default_max_queued_requests(64 * 1000) == 1000
    assert EngineLoop(FakeEngine()).max_queued_requests == 128  # the fake's pool: 1024 tokens
