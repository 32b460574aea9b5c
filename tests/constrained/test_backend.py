import json

import pytest

from jaxserve.constrained.backend import GrammarDisabledError, GrammarSpec, InvalidGrammarError, NoGrammarBackend
from jaxserve.constrained.registry import GRAMMAR_BACKENDS, get_grammar_backend


def test_grammar_spec_is_a_frozen_hashable_key():
    spec = GrammarSpec.regex(r"\d+")
    assert spec == GrammarSpec("regex", r"\d+") and hash(spec) == hash(GrammarSpec("regex", r"\d+"))
    with pytest.raises(AttributeError):
        spec.source = "x"  # type: ignore[misc]


def test_grammar_spec_validates_kind_and_source():
    with pytest.raises(ValueError, match="unknown grammar kind"):
        GrammarSpec("xml", "<a/>")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be a string"):
        GrammarSpec("json_schema", {"type": "object"})  # type: ignore[arg-type]


def test_grammar_spec_constructors():
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    spec = GrammarSpec.json_schema(schema)
    assert spec == GrammarSpec.json_schema(json.dumps(schema)) and spec.kind == "json_schema"
    assert spec.source.index('"b"') < spec.source.index('"a"'), "property order is generation order"
    choices = GrammarSpec.from_choices(["café", 'say "hi"'])
    assert choices.kind == "choices" and json.loads(choices.source) == ["café", 'say "hi"']
    with pytest.raises(ValueError):
        GrammarSpec.from_choices("abc")


def test_none_backend_refuses_to_compile():
    backend = get_grammar_backend("none", None, vocab_size=100)
    assert isinstance(backend, NoGrammarBackend) and backend.lookup(GrammarSpec.regex("a")) is None
    for spec in (GrammarSpec.regex("a"), GrammarSpec.ebnf("start: a")):
        with pytest.raises(GrammarDisabledError) as e:
            backend.compile(spec)
        # the kind is not named: tool_choice "required" said "cannot use a ebnf constraint"
        assert str(e.value) == "structured generation is disabled (--grammar-backend none): this field needs it"
    assert issubclass(GrammarDisabledError, InvalidGrammarError) and issubclass(InvalidGrammarError, ValueError)


def test_registry():
    assert set(GRAMMAR_BACKENDS) == {"llguidance", "none"}
    with pytest.raises(ValueError, match="unknown grammar backend 'xgrammar'"):
        get_grammar_backend("xgrammar", None)
