"""Req's cheap views of prompt + output agree with the concatenated list."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxserve.core.errors import SamplingParamsError
from jaxserve.core.request import Req
from jaxserve.core.sampling_params import SamplingParams


@given(st.lists(st.integers(0, 9), min_size=1, max_size=8), st.lists(st.integers(0, 9), max_size=8),
       st.integers(0, 20), st.integers(0, 20))
def test_fill_slice_and_len_match_fill_ids(prompt, output, a, b):
    req = Req("r", prompt, SamplingParams())
    req.output_ids = output
    start, end = min(a, b), max(a, b)
    assert req.fill_slice(start, end) == req.fill_ids[start:end]
    assert req.fill_len == len(req.fill_ids)


@pytest.mark.parametrize("field,value,shown", [("regex", 5, "5 (an integer)"), ("ebnf", ["x"], '["x"] (a list)'),
                                               ("json_schema", {"type": "object"}, '{"type": "object"} (an object)')])
def test_grammar_field_of_the_wrong_type_is_a_sampling_params_error(field, value, shown):
    # it reached GrammarSpec's ValueError, an HTTP 500 ("grammar source must be a string, got int")
    with pytest.raises(SamplingParamsError, match=re.escape(f"must be a string, got {shown}")) as info:
        SamplingParams.from_dict({field: value}).validate()
    assert info.value.field == field
