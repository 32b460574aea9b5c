"""Req's cheap views of prompt + output agree with the concatenated list."""

from hypothesis import given, strategies as st

from jaxserve.engine.request import Req, SamplingParams


@given(st.lists(st.integers(0, 9), min_size=1, max_size=8), st.lists(st.integers(0, 9), max_size=8),
       st.integers(0, 20), st.integers(0, 20))
def test_fill_slice_and_len_match_fill_ids(prompt, output, a, b):
    req = Req("r", prompt, SamplingParams())
    req.output_ids = output
    start, end = min(a, b), max(a, b)
    assert req.fill_slice(start, end) == req.fill_ids[start:end]
    assert req.fill_len == len(req.fill_ids)
