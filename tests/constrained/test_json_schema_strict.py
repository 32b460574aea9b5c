"""JSON schemas are read as SGLang 0.5.23's default backend reads them (xgrammar 0.2.7, strict mode):
no property or item the schema does not name. The expected answers are xgrammar 0.2.7's own, taken with
`xgrammar.Grammar.from_json_schema(schema, strict_mode=True)` and `xgrammar.testing._is_grammar_accept_string`."""

from __future__ import annotations

import copy

import pytest

from jaxserve.constrained.backend import GrammarSpec
from jaxserve.constrained.json_schema_strict import close_unnamed

A_INT = {"type": "object", "properties": {"a": {"type": "integer"}}}

# (schema, text, accepted by xgrammar 0.2.7 in strict mode)
XGRAMMAR_STRICT = [
    (A_INT, '{"a": 1}', True),
    (A_INT, '{"a": 1, "b": 2}', False),  # the reported defect: an unnamed property got through
    ({"properties": {"a": {"type": "integer"}}}, '{"a": 1, "b": 2}', False),  # no "type"
    ({"type": "object", "properties": {}}, '{"x": 1}', False),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1, "z": 0}', False),
    ({"type": "object"}, '{"x": 1}', True),  # a bare object stays open (response_format json_object)
    ({"type": "array"}, "[1, 2]", True),
    ({"type": "object", "properties": {"a": {"type": "object"}}}, '{"a": {"x": 1}}', True),
    ({"type": "array", "items": A_INT}, '[{"a": 1, "b": 2}]', False),
    ({"anyOf": [A_INT, {"type": "string"}]}, '{"a": 1, "b": 2}', False),
    ({"$defs": {"X": A_INT}, "$ref": "#/$defs/X"}, '{"a": 1, "b": 2}', False),
    ({**A_INT, "additionalProperties": True}, '{"a": 1, "b": 2}', True),
    ({**A_INT, "additionalProperties": {"type": "string"}}, '{"a": 1, "b": "s"}', True),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "[1]", True),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "[1, 2]", False),
]


def _accepts(backend, tokenizer, schema, text: str) -> bool:
    matcher = backend.new_matcher(backend.compile(GrammarSpec.json_schema(schema)))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return matcher.accept_tokens(tokens) == len(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("schema, text, accepted", XGRAMMAR_STRICT, ids=[f"{i}" for i in range(len(XGRAMMAR_STRICT))])
def test_the_backend_reads_schemas_as_xgrammars_strict_mode(backend, tokenizer, schema, text, accepted):
    assert _accepts(backend, tokenizer, schema, text) is accepted


def test_close_unnamed_leaves_its_input_and_allof_alone():
    schema = {"type": "object", "properties": {"a": A_INT}, "$defs": {"X": A_INT}}
    before = copy.deepcopy(schema)
    closed = close_unnamed(schema)
    assert schema == before
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["X"]["additionalProperties"] is False
    all_of = {"allOf": [A_INT, {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert close_unnamed(all_of) == all_of  # closing each part would refuse the other part's key
    assert close_unnamed(True) is True
