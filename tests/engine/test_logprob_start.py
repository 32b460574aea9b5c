"""`Engine.add_request` checks `logprob_start_len` as the HTTP API does (SGLang's rule, one check:
jaxserve/engine/validation/logprob_start.py); before, the in-process API queued any value."""

from __future__ import annotations

import pytest

from jaxserve.core.errors import RequestError
from tests.engine.test_model_limits import make_engine

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def _finish(engine, rids: list[str]) -> dict:
    done = {}
    while len(done) < len(rids):
        done.update({out.rid: out for out in engine.step() if out.finished and out.rid in rids})
    return done[rids[0]].meta


@pytest.mark.parametrize("start, words", [(4, "has 3 tokens"), (10**6, "past the end"), (-2, "-1"), ("1", "integer")])
def test_bad_logprob_start_len_is_a_value_error_naming_it(engine, start, words):
    for asks in ({"return_logprob": True}, {"top_logprobs_num": 2}):
        with pytest.raises(ValueError, match=words) as info:
            engine.add_request(PROMPT, {"max_new_tokens": 1}, logprob_start_len=start, **asks)
        assert isinstance(info.value, RequestError) and info.value.field == "logprob_start_len"
        assert "logprob_start_len" in str(info.value)
    assert not engine.has_unfinished()  # nothing was queued


def test_valid_logprob_start_len_and_ignored_without_logprobs(engine):
    params = {"max_new_tokens": 1, "temperature": 0}
    at_end = _finish(engine, engine.add_request(PROMPT, params, return_logprob=True, logprob_start_len=3))
    assert at_end.input_token_logprobs == []
    from_one = _finish(engine, engine.add_request(PROMPT, params, return_logprob=True, logprob_start_len=1))
    assert [t for _, t in from_one.input_token_logprobs] == [6, 7]
    # without logprobs the field is ignored, as in SGLang
    ignored = _finish(engine, engine.add_request(PROMPT, params, logprob_start_len=99))
    assert ignored.completion_tokens == 1 and not engine.has_unfinished()


def test_engine_loop_submit_refuses_it_in_the_callers_thread(engine):
    """`EngineLoop.submit` (the frontend's in-process backend goes through it) checks before queuing:
    before, a bad value reached `Engine.add_request` on the loop thread and failed as a 500."""
    from jaxserve.engine.engine_loop import EngineLoop

    loop = EngineLoop(engine).start()
    try:
        with pytest.raises(RequestError, match="past the end") as info:
            loop.submit(PROMPT, {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=4,
                        on_output=lambda out: None)
        assert info.value.field == "logprob_start_len"
        assert loop.num_pending == 0
    finally:
        loop.shutdown()
