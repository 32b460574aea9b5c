"""Bad input to the in-process API raises a clear error and leaves the engine as it was: nothing queued,
the next request served (a new user's trial: a batch whose third prompt was bad left the first two running;
a `None` prompt or a string `top_logprobs_num` raised a bare TypeError)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.core.errors import RequestError, SamplingParamsError
from jaxserve.engine.engine import Engine

GREEDY = {"max_new_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(model_path=tiny_model_dir, max_total_tokens=512, disable_precompile=True)


@pytest.mark.parametrize("bad,field", [
    ([10**7], "input_ids"),
    ([], "prompt"),
    (None, "prompt"),
    (b"Hi there", "prompt"),
])
def test_a_batch_with_a_bad_third_prompt_queues_nothing(engine, bad, field):
    with pytest.raises(RequestError) as e:
        engine.generate(["Hi", "There", bad], GREEDY)
    assert e.value.field == field
    assert not engine.has_unfinished()
    assert engine.generate("Hi", GREEDY)["meta_info"]["completion_tokens"] == 4


def test_a_bad_sampling_entry_of_a_batch_queues_nothing(engine):
    with pytest.raises(SamplingParamsError) as e:
        engine.generate(["Hi", "There", "You"], [GREEDY, GREEDY, {**GREEDY, "top_p": 2}])
    assert e.value.field == "top_p" and not engine.has_unfinished()


@pytest.mark.parametrize("fields,field", [
    (dict(top_logprobs_num="2"), "top_logprobs_num"),
    (dict(return_logprob="yes"), "return_logprob"),
    (dict(rid=5), "rid"),
    (dict(logprob_start_len=0.5, return_logprob=True), "logprob_start_len"),
])
def test_request_fields_of_the_wrong_type_are_named(engine, fields, field):
    with pytest.raises(RequestError, match=f"{field}: must be") as e:
        engine.add_request("Hi", GREEDY, **fields)
    assert e.value.field == field and not engine.has_unfinished()


def test_numpy_prompts_and_seeds_are_served(engine):
    ids = np.array(engine.checker.tokenize("Hi"), dtype=np.int64)
    out = engine.generate(ids, {**GREEDY, "seed": np.int64(3)})
    assert out == engine.generate(ids.tolist(), {**GREEDY, "seed": 3}) | {"meta_info": out["meta_info"]}
