"""`SamplingParams` built in code takes the forms JSON has, so research code's natural spellings mean what
they mean on the wire (a new user's trial: a string `stop` stopped at its first character)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxserve.core.errors import SamplingParamsError
from jaxserve.core.sampling_params import SamplingParams


def test_a_string_stop_is_one_stop_not_its_characters():
    assert SamplingParams(stop=" 7,").stop == (" 7,",)
    assert SamplingParams(stop_regex="a+b").stop_regex == ("a+b",)
    assert SamplingParams(stop=["x", "y"], stop_token_ids=[3, 4]).stop == ("x", "y")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams.from_dict({"stop": " 7,"}) == SamplingParams(stop=" 7,")


def test_logit_bias_as_an_object_or_as_pairs_in_any_order():
    as_object = SamplingParams(logit_bias={"9": 1, 3: -2.5})
    assert as_object.logit_bias == ((3, -2.5), (9, 1.0))
    assert SamplingParams(logit_bias=[(9, 1.0), (3, -2.5)]).logit_bias == ((3, -2.5), (9, 1.0))
    assert SamplingParams.from_dict({"logit_bias": {"9": 1, "3": -2.5}}) == as_object
    with pytest.raises(SamplingParamsError, match="keys must be integer token ids"):
        SamplingParams(logit_bias={"abc": 1})
    with pytest.raises(SamplingParamsError, match="must map token ids to biases") as e:
        SamplingParams(logit_bias=[1, 2], max_new_tokens=4).validate()
    assert e.value.field == "logit_bias"


@pytest.mark.parametrize("kwargs,field,words", [
    (dict(choices="yes"), "choices", "must be a list"),
    (dict(stop=""), "stop", "must not be empty"),
    (dict(stop_regex=""), "stop_regex", "non-empty"),
    (dict(temperature="0.5"), "temperature", 'must be a number, got "0.5" (a string)'),
])
def test_what_json_would_refuse_is_refused_in_code_too(kwargs, field, words):
    with pytest.raises(SamplingParamsError, match=re.escape(words)) as e:
        SamplingParams(max_new_tokens=4, **kwargs).validate()
    assert e.value.field == field


def test_numpy_numbers_are_numbers():
    SamplingParams(max_new_tokens=np.int64(4), seed=np.int32(3), temperature=np.float32(0.5)).validate()
