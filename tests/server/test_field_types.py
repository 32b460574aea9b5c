"""One type table for the sampling fields (jaxserve/core/field_types.py): the in-process engine
(`SamplingParams.validate`, of one built by `from_dict` or directly) and the HTTP routes (`check_field_types`,
in the same module, where a route checks a body itself) refuse a wrong JSON type with the same message. Before, the
engine said "must be a number, got True" or "has the wrong type str" where the routes said
"must be an integer, got true (a boolean)"."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.core.errors import SamplingParamsError
from jaxserve.core.field_types import OPENAI_FIELD_TYPES as ROUTE_FIELD_TYPES
from jaxserve.core.field_types import SAMPLING_FIELD_TYPES, FieldType, check_field_types
from jaxserve.core.field_types import SAMPLING_FIELD_TYPES as NATIVE_FIELD_TYPES
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.server.errors import from_engine_error

WRONG = {FieldType.INTEGER: [True, "7", 1.5], FieldType.NUMBER: ["0.5", False, [1]], FieldType.BOOLEAN: [1, "yes"],
         FieldType.STRING: [5, ["x"], {"type": "object"}], FieldType.STRING_OR_STRINGS: [5, ["a", 1]],
         FieldType.INTEGERS: [3, [True], ["1"]]}
CASES = [(name, value) for name, kind in SAMPLING_FIELD_TYPES.items() for value in WRONG[kind]]
DATACLASS_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v!r}" for n, v in CASES])
def test_engine_and_routes_word_a_wrong_type_alike(name, value):
    with pytest.raises(SamplingParamsError) as checked:
        check_field_types({name: value}, NATIVE_FIELD_TYPES)  # /generate's sampling_params
    route = from_engine_error(checked.value)  # its 400
    assert route.message.startswith(f"{name}: must be {SAMPLING_FIELD_TYPES[name].value}, got ")
    if name == "structural_tag":  # no SamplingParams field: /generate's field table refuses it by name first
        return
    with pytest.raises(SamplingParamsError) as engine:
        SamplingParams.from_dict({name: value}).validate()
    assert str(engine.value) == route.message and engine.value.field == name == route.param
    assert from_engine_error(engine.value).code == route.code == "invalid_type"
    if name in DATACLASS_FIELDS:  # not sampling_seed (from_dict's alias of seed)
        with pytest.raises(SamplingParamsError) as built:
            SamplingParams(**{name: value}).validate()
        assert str(built.value) == route.message


def test_openai_names_share_the_native_types():
    assert ROUTE_FIELD_TYPES["max_tokens"] is ROUTE_FIELD_TYPES["max_completion_tokens"] is FieldType.INTEGER
    assert ROUTE_FIELD_TYPES["min_tokens"] is FieldType.INTEGER
    # every native field but json_schema, which the OpenAI routes also take as an object (docs/api.md)
    assert {k: v for k, v in ROUTE_FIELD_TYPES.items() if k in SAMPLING_FIELD_TYPES} == {
        k: v for k, v in SAMPLING_FIELD_TYPES.items() if k != "json_schema"}
    assert NATIVE_FIELD_TYPES["json_schema"] is FieldType.STRING and "json_schema" not in ROUTE_FIELD_TYPES


def test_right_types_pass_and_keep_their_range_checks():
    SamplingParams.from_dict({"seed": -1, "stop": "x", "stop_token_ids": [2], "top_p": 1, "stream_interval": 2}).validate()
    with pytest.raises(SamplingParamsError, match=r"^top_k: must be -1 \(disabled\) or between 1 and 2147483647, got 2147483648$"):
        SamplingParams.from_dict({"top_k": 2**31}).validate()
    # negatives are invalid, so the range said must not start at -2147483647
    with pytest.raises(SamplingParamsError, match=r"^max_new_tokens: must be between 0 and 2147483647, got 10{23}$"):
        SamplingParams.from_dict({"max_new_tokens": 10**23}).validate()
    with pytest.raises(SamplingParamsError, match=r"^min_new_tokens: must be between 0 and 2147483647, got -10{12}$"):
        SamplingParams.from_dict({"min_new_tokens": -10**12}).validate()
    with pytest.raises(SamplingParamsError, match=r"^stream_interval: must be between 1 and 2147483647, got 2147483648$"):
        SamplingParams.from_dict({"stream_interval": 2**31}).validate()
    with pytest.raises(SamplingParamsError, match=r"^temperature: must be a finite number, got inf$"):
        SamplingParams.from_dict({"temperature": float("inf")}).validate()
