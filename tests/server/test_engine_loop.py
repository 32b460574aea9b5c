"""EngineLoop with a fake engine (no model): threading, validation, aborts, failures, shutdown."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from jaxserve.core.errors import RequestError, SamplingParamsError
from jaxserve.core.request import finish_length
from jaxserve.engine.engine_loop import EngineLoop, EngineUnavailableError
from jaxserve.engine.outputs import StepOutput
from tests.server.fakes import FakeEngine


class Collector:
    def __init__(self):
        self.outputs: list[StepOutput] = []
        self.done = threading.Event()
        self.num_expected = 1

    def __call__(self, out: StepOutput):
        self.outputs.append(out)
        if sum(o.finished for o in self.outputs) >= self.num_expected:
            self.done.set()

    def finals(self) -> list[StepOutput]:
        return [o for o in self.outputs if o.finished]


@pytest.fixture
def engine_loop():
    loop = EngineLoop(FakeEngine()).start()
    yield loop
    loop.shutdown()


def test_outputs_reach_the_callback_on_the_loop_thread(engine_loop):
    got = Collector()
    rids = engine_loop.submit("hello", {"max_new_tokens": 3}, on_output=got)
    assert got.done.wait(5)
    assert [o.rid for o in got.outputs] == rids * 3
    final = got.finals()[0]
    assert final.output_ids == [7, 7, 7] and final.meta.finish_reason == finish_length(3)
    assert engine_loop.engine.thread_ids == {engine_loop._thread.ident}


@pytest.mark.parametrize("rid", [None, ""])
def test_without_a_rid_the_request_gets_one_the_engine_uses(engine_loop, rid):
    """An empty rid means none, as in the engine: the loop mints one and hands the engine that one (with
    "" the engine minted a second rid, the loop failed the request with a 500 and the engine ran it,
    unreachable by abort)."""
    got = Collector()
    rids = engine_loop.submit("hello", {"max_new_tokens": 2}, rid=rid, on_output=got)
    assert got.done.wait(5)
    assert len(rids) == 1 and rids[0] and [o.rid for o in got.finals()] == rids
    assert got.finals()[0].meta.finish_reason == finish_length(2)


def test_n_sequences_and_group_abort(engine_loop):
    got = Collector()
    got.num_expected = 2
    rids = engine_loop.submit("hi", {"max_new_tokens": 60, "n": 2}, rid="grp", on_output=got)
    assert rids == ["grp-0", "grp-1"]
    time.sleep(0.05)
    assert engine_loop.abort("grp")
    assert got.done.wait(5)
    assert sorted(o.rid for o in got.finals()) == rids
    assert all(o.meta.finish_reason.kind == "abort" for o in got.finals())
    assert not engine_loop.abort("grp")
    assert "grp" not in engine_loop._groups  # a group is dropped with its last sequence


def test_a_large_n_group_finishes_and_is_dropped(engine_loop):
    got = Collector()
    got.num_expected = 128
    rids = engine_loop.submit("hi", {"max_new_tokens": 2, "n": 128}, rid="big", on_output=got)
    assert len(rids) == 128
    assert got.done.wait(30)
    assert sorted(o.rid for o in got.finals()) == sorted(rids)
    assert "big" not in engine_loop._groups


def test_validation_errors_raise_in_the_caller(engine_loop):
    with pytest.raises(SamplingParamsError) as e:
        engine_loop.submit("hi", {"top_p": 2}, on_output=print)
    assert e.value.field == "top_p"
    with pytest.raises(RequestError) as e:
        engine_loop.submit("", {}, on_output=print)
    assert e.value.field == "prompt"
    with pytest.raises(RequestError) as e:
        engine_loop.submit("hi", {"max_new_tokens": 100}, on_output=print)
    assert e.value.field == "max_new_tokens" and "64" in str(e.value)
    with pytest.raises(RequestError) as e:
        engine_loop.submit([1, True], {}, on_output=print)
    assert e.value.field == "input_ids"
    assert engine_loop.engine.reqs == {}


def test_default_max_new_tokens_is_cut_to_the_context(engine_loop):
    got = Collector()
    engine_loop.submit("a" * 60, {}, on_output=got)  # 128 by default, 4 left in the context
    assert got.done.wait(5)
    assert len(got.finals()[0].output_ids) == 4


def test_duplicate_rid_is_rejected(engine_loop):
    engine_loop.submit("hi", {"max_new_tokens": 60}, rid="same", on_output=lambda o: None)
    with pytest.raises(RequestError) as e:
        engine_loop.submit("hi", {}, rid="same", on_output=print)
    assert e.value.field == "rid"
    engine_loop.abort("same")


def test_a_failed_step_fails_pending_requests_and_the_loop_dies(engine_loop):
    got = Collector()
    got.num_expected = 2
    deaths = []
    engine_loop.add_death_observer(deaths.append)
    engine_loop.submit("a", {"max_new_tokens": 50}, on_output=got)
    engine_loop.submit("b", {"max_new_tokens": 50}, on_output=got)
    time.sleep(0.03)
    engine_loop.engine.fail_next_step = True
    assert got.done.wait(5)
    for out in got.finals():
        assert out.meta.finish_reason.kind == "abort" and out.meta.finish_reason.status_code == 500
        assert "boom" in out.meta.finish_reason.message
    engine_loop._thread.join(5)
    assert deaths == ["RuntimeError: boom"] and engine_loop.error == "RuntimeError: boom"
    assert not engine_loop.is_running
    assert engine_loop.load().num_step_failures == 1 and engine_loop.load().num_pending_reqs == 0
    with pytest.raises(EngineUnavailableError, match="boom"):
        engine_loop.submit("c", {"max_new_tokens": 2}, on_output=print)


def test_a_failing_callback_aborts_only_its_request(engine_loop):
    def bad(out):
        raise RuntimeError("client gone")

    good = Collector()
    engine_loop.submit("a", {"max_new_tokens": 30}, on_output=bad)
    engine_loop.submit("b", {"max_new_tokens": 5}, on_output=good)
    assert good.done.wait(5) and good.finals()[0].meta.finish_reason == finish_length(5)
    deadline = time.monotonic() + 5
    while engine_loop.engine.reqs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine_loop.engine.reqs == {}


def test_flush_cache_runs_on_the_loop_only_when_idle(engine_loop):
    engine_loop.submit("a", {"max_new_tokens": 60}, rid="busy", on_output=lambda o: None)
    time.sleep(0.02)
    with pytest.raises(RuntimeError, match="running"):
        engine_loop.flush_cache().result(5)
    engine_loop.abort("busy")
    deadline = time.monotonic() + 5
    while engine_loop.load().num_pending_reqs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine_loop.flush_cache().result(5) is None


def test_idle_loop_sleeps(engine_loop):
    got = Collector()
    engine_loop.submit("a", {"max_new_tokens": 2}, on_output=got)
    assert got.done.wait(5)
    time.sleep(0.05)
    steps = engine_loop.engine.num_steps
    time.sleep(0.3)
    assert engine_loop.engine.num_steps == steps


def test_load_snapshot(engine_loop):
    engine_loop.submit("a", {"max_new_tokens": 60}, rid="x", on_output=lambda o: None)
    time.sleep(0.05)
    load = engine_loop.load()
    assert load.num_pending_reqs == 1 and load.kv_used_tokens == 16 and load.kv_total_tokens == 1024
    assert dataclasses.is_dataclass(load.stats)
    engine_loop.abort("x")


def test_shutdown_fails_pending_requests():
    loop = EngineLoop(FakeEngine(step_time=0.01)).start()
    got = Collector()
    loop.submit("a", {"max_new_tokens": 60}, on_output=got)
    time.sleep(0.03)
    loop.shutdown()
    assert got.done.is_set()
    assert got.finals()[0].meta.finish_reason.status_code == 503
    with pytest.raises(RuntimeError):
        loop.submit("a", {}, on_output=got)


def test_a_request_no_longer_valid_when_queued_ends_with_a_400(engine_loop, monkeypatch):
    """Checked in the caller's thread, the request met an engine that had changed (an adapter unloaded
    between the check and the queueing): before, a 500 "engine bug"; now a 400 with the engine's message."""
    from jaxserve.core.errors import RequestError

    def refuse(checked):
        raise RequestError("lora_path", "LoRA adapter 'x' is not loaded; loaded: []")

    monkeypatch.setattr(engine_loop.engine, "add_request", refuse)
    out = Collector()
    engine_loop.submit("a", {"max_new_tokens": 2}, on_output=out)
    assert out.done.wait(5)
    reason = out.finals()[0].meta.finish_reason
    assert reason.kind == "abort" and reason.status_code == 400 and "is not loaded" in reason.message, reason
