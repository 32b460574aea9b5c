"""Expressions: what gen/select/roles build, and the errors they raise at construction."""

from __future__ import annotations

import json

import pytest

from jaxserve.lang import assistant, gen, gen_int, gen_string, select, user
from jaxserve.lang.expr import REGEX_INT, REGEX_STR, ExprList, Gen, RoleBegin, RoleEnd, Select, Text


def test_gen_maps_sglang_names_and_drops_unset():
    g = gen("x", max_tokens=8, stop="\n", temperature=0)
    assert isinstance(g, Gen) and g.name == "x"
    assert g.params == {"max_new_tokens": 8, "stop": ["\n"], "temperature": 0}


def test_gen_with_choices_is_a_select():
    s = gen("pick", choices=["a", "b"])
    assert isinstance(s, Select) and s.choices == ("a", "b") and s.name == "pick"


def test_json_schema_dict_is_serialised():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(gen("j", json_schema=schema).params["json_schema"]) == schema


def test_typed_gens_use_sglang_regexes():
    assert gen_int("n").params == {"regex": REGEX_INT, "stop": [" ", "\n"]}
    assert gen_int("n", stop="!").params["stop"] == ["!", " ", "\n"]
    assert gen_string("s").params == {"regex": REGEX_STR}


@pytest.mark.parametrize("kwargs", [dict(regex="a", json_schema="{}"), dict(dtype=int, regex="a"), dict(dtype=complex)])
def test_conflicting_constraints_raise(kwargs):
    with pytest.raises(ValueError):
        gen("x", **kwargs)


@pytest.mark.parametrize("choices", [[], None, (), [""], ["a", 3], "ab"])
def test_empty_or_bad_choice_list_raises(choices):
    with pytest.raises(ValueError, match="select\\('pick'\\)"):
        select("pick", choices)


def test_gen_with_empty_choices_raises():
    with pytest.raises(ValueError, match="empty"):
        gen("pick", choices=[])


def test_concatenation_flattens_and_wraps_strings():
    e = "Q: " + gen("a") + "\n" + select("b", ["x"])
    assert isinstance(e, ExprList)
    kinds = [type(x) for x in e.items]
    assert kinds == [Text, Gen, Text, Select]


def test_roles_wrap_their_content():
    e = user("hi")
    assert [type(x) for x in e.items] == [RoleBegin, Text, RoleEnd]
    assert [type(x) for x in assistant().items] == [RoleBegin, RoleEnd]


def test_adding_a_non_expression_raises():
    with pytest.raises(TypeError, match="int"):
        gen("a") + 3
