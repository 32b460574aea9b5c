import json
import re

import jsonschema
import numpy as np
import pytest

from jaxserve.constrained.backend import GrammarBackend, GrammarMatcher, GrammarSpec, InvalidGrammarError
from jaxserve.constrained.bitmask import allocate_bitmask, allowed_token_ids, unpack_bitmask
from jaxserve.constrained.llguidance_backend import LLGuidanceBackend
from jaxserve.constrained.registry import get_grammar_backend
from tests.constrained.random_walk import max_structural_whitespace_run, random_walk, whitespace_token_ids

EOS = 2


@pytest.fixture(scope="module")
def ws_ids(tokenizer):
    return whitespace_token_ids(tokenizer)


def _walk(backend, tokenizer, spec, seed, **kwargs):
    return random_walk(backend, backend.new_matcher(backend.compile(spec)), tokenizer, seed, **kwargs)


def test_backend_and_matcher_follow_the_protocols(backend):
    assert isinstance(backend, GrammarBackend)
    assert isinstance(backend.new_matcher(backend.compile(GrammarSpec.regex("a"))), GrammarMatcher)
    assert backend.vocab_size == 49152 and backend.eos_token_ids == (EOS,) and backend.num_words == 1536


REGEXES = {
    "ipv4": r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
    "date": r"\d{4}-\d{2}-\d{2}",
    "accented_words": r"(café|naïve|über)",
    "latin1_letters": r"[a-zà-ÿ]{3,8}",
    "phone": r"\+?1? ?\(\d{3}\) \d{3}-\d{4}",
}


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_regex_walks_fullmatch(backend, tokenizer, name):
    pattern = REGEXES[name]
    spec = GrammarSpec.regex(pattern)
    for seed in range(8):
        result = _walk(backend, tokenizer, spec, seed)
        assert result.is_terminated, (name, seed, result.text)
        assert re.fullmatch(pattern, result.text), (name, seed, result.text)
        assert "\ufffd" not in result.text
        if name in ("date", "phone", "ipv4"):
            assert re.fullmatch(r"[0-9.+() -]+", result.text), "\\d must mean ASCII digits"


def test_choices(backend, tokenizer):
    choices = ["red", "green", "light green", 'say "hi"', "back\\slash", "café", "emoji 😀", "two\nlines"]
    spec = GrammarSpec.from_choices(choices)
    seen = set()
    for seed in range(20):
        result = _walk(backend, tokenizer, spec, seed)
        assert result.is_terminated and result.text in choices, result.text
        seen.add(result.text)
    assert len(seen) >= 3


@pytest.mark.parametrize(
    "grammar",
    [
        'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/',  # Lark
        'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [0-9] [0-9] | [0-9] [0-9] [0-9]',  # GBNF
    ],
)
def test_ebnf(backend, tokenizer, grammar):
    for seed in range(8):
        result = _walk(backend, tokenizer, GrammarSpec.ebnf(grammar), seed, close_after=40)
        assert result.is_terminated and re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", result.text), result.text


SCHEMAS = {
    "refs_defs": {
        "$defs": {
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "zip"],
                "additionalProperties": False,
            },
            "person": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 12}, "home": {"$ref": "#/$defs/address"}},
                "required": ["name", "home"],
                "additionalProperties": False,
            },
        },
        "type": "object",
        "properties": {"owner": {"$ref": "#/$defs/person"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["owner"],
        "additionalProperties": False,
    },
    "enum_and_pattern": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue", 7, None]},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{3}$"},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "code", "ok"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "minItems": 1,
        "maxItems": 4,
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "score": {"type": "number"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            },
            "required": ["id", "score"],
            "additionalProperties": False,
        },
    },
    "any_object": {"type": "object"},
    "nested_free_form": {
        "type": "object",
        "properties": {"meta": {"type": "object"}, "items": {"type": "array"}, "name": {"type": "string"}},
        "required": ["name"],
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_walks_validate(backend, tokenizer, name):
    schema = SCHEMAS[name]
    spec = GrammarSpec.json_schema(schema)
    num_terminated = 0
    for seed in range(20):
        result = _walk(backend, tokenizer, spec, seed, close_after=100)
        assert result.is_terminated, (seed, result.text)
        num_terminated += 1
        value = json.loads(result.text)
        jsonschema.validate(value, schema)
        assert max_structural_whitespace_run(result.text) <= 20, repr(result.text)
        assert "\ufffd" not in result.text
    assert num_terminated == 20


@pytest.mark.parametrize("name", ["refs_defs", "array_of_objects", "any_object"])
def test_json_whitespace_heavy_walks_stay_bounded(backend, tokenizer, ws_ids, name):
    schema = SCHEMAS[name]
    spec = GrammarSpec.json_schema(schema)
    for seed in range(5):
        result = _walk(backend, tokenizer, spec, seed, policy="whitespace", whitespace_ids=ws_ids, close_after=100)
        assert result.is_terminated, result.text
        jsonschema.validate(json.loads(result.text), schema)
        assert max_structural_whitespace_run(result.text) <= 20, repr(result.text)


def test_default_whitespace_rejects_runaway_blank_space(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(GrammarSpec.json_schema({"type": "object"})))
    assert matcher.accept_tokens(tokenizer.encode('{\n    "a": 1}', add_special_tokens=False)) > 0
    matcher.reset()
    runaway = tokenizer.encode("{" + "\n" * 40 + '"a": 1}', add_special_tokens=False)
    assert matcher.accept_tokens(runaway) < len(runaway)


def test_compact_whitespace_pattern(compact_backend, tokenizer, ws_ids):
    spec = GrammarSpec.json_schema(SCHEMAS["array_of_objects"])
    for seed in range(5):
        result = _walk(compact_backend, tokenizer, spec, seed, policy="whitespace", whitespace_ids=ws_ids)
        assert result.is_terminated and max_structural_whitespace_run(result.text) == 0, repr(result.text)


LONG_KEYS_SCHEMA = {
    "type": "object",
    "properties": {
        "very_long_property_name_alpha": {"type": "integer"},
        "another_quite_long_key_beta": {"enum": ["first_option_value", "second_option_value"]},
    },
    "required": ["very_long_property_name_alpha", "another_quite_long_key_beta"],
    "additionalProperties": False,
}


def _decode(tokenizer, ids):
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def _accept_text(matcher, tokenizer, text: str) -> None:
    """Feed `text` as if sampled (tokenized on its own)."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert matcher.accept_tokens(tokens) == len(tokens), text


def _accept_forced(matcher, tokenizer, expected_forced: str) -> str:
    """Accept the forced tokens; check they are non-empty and spell a prefix of `expected_forced`."""
    assert matcher.jump_forward_text() == expected_forced.encode()
    forced = matcher.jump_forward_tokens()
    assert forced, f"nothing forced before {expected_forced!r}"
    text = _decode(tokenizer, forced)
    assert expected_forced.startswith(text) and len(text) >= len(expected_forced) // 2, (text, expected_forced)
    assert matcher.accept_jump_forward() == forced
    return text


def test_jump_forward_on_fixed_keys(compact_backend, tokenizer):
    """Forced text at the start, after ',' (the second key) and inside an enum value; nowhere else."""
    matcher = compact_backend.new_matcher(compact_backend.compile(GrammarSpec.json_schema(LONG_KEYS_SCHEMA)))
    output = ""
    for forced_text, sampled_after in [
        ('{"very_long_property_name_alpha":', "12,"),
        ('"another_quite_long_key_beta":"', "f"),
        ('irst_option_value"}', ""),
    ]:
        text = _accept_forced(matcher, tokenizer, forced_text)
        # llguidance leaves the last forced bytes to sampling: they may merge with what follows.
        sampled = forced_text[len(text):] + sampled_after
        if sampled:
            _accept_text(matcher, tokenizer, sampled)
        output += text + sampled
    assert matcher.is_terminated() and matcher.jump_forward_tokens() == []
    expected = {"very_long_property_name_alpha": 12, "another_quite_long_key_beta": "first_option_value"}
    assert json.loads(output) == expected


def test_nothing_is_forced_where_the_model_has_a_choice(compact_backend, tokenizer):
    matcher = compact_backend.new_matcher(compact_backend.compile(GrammarSpec.json_schema(LONG_KEYS_SCHEMA)))
    matcher.accept_jump_forward()
    _accept_text(matcher, tokenizer, '":1')
    assert matcher.jump_forward_tokens() == [] and matcher.jump_forward_text() == b""  # digit or ','


def test_jump_forward_with_default_whitespace(backend, tokenizer):
    """Optional whitespace after '{' means nothing is forced at the start, but the key is, after '{"'."""
    matcher = backend.new_matcher(backend.compile(GrammarSpec.json_schema(LONG_KEYS_SCHEMA)))
    assert matcher.jump_forward_text() == b"{"
    assert matcher.accept_tokens(tokenizer.encode('{"', add_special_tokens=False)) == 1
    forced = matcher.accept_jump_forward()
    assert forced and "very_long_property_name_alpha".startswith(_decode(tokenizer, forced))
    for seed in range(5):
        result = _walk(backend, tokenizer, GrammarSpec.json_schema(LONG_KEYS_SCHEMA), seed)
        assert result.num_forced_tokens > 0
        jsonschema.validate(json.loads(result.text), LONG_KEYS_SCHEMA)


def test_walk_without_jump_forward_gives_the_same_language(backend, tokenizer):
    for seed in range(5):
        result = _walk(backend, tokenizer, GrammarSpec.json_schema(LONG_KEYS_SCHEMA), seed, use_jump_forward=False)
        jsonschema.validate(json.loads(result.text), LONG_KEYS_SCHEMA)


def test_fixed_length_grammar_terminates_without_eos(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(GrammarSpec.regex("[0-9]{2}")))
    row = allocate_bitmask(1, backend.vocab_size)[0]
    matcher.fill_bitmask(row)
    assert EOS not in allowed_token_ids(row, backend.vocab_size)
    assert matcher.accept_token(tokenizer.encode("4", add_special_tokens=False)[0])
    assert not matcher.is_terminated() and not matcher.is_accepting()
    assert matcher.accept_token(tokenizer.encode("2", add_special_tokens=False)[0])
    assert matcher.is_terminated() and matcher.is_accepting()
    matcher.fill_bitmask(row)
    assert allowed_token_ids(row, backend.vocab_size).tolist() == [EOS]
    assert not matcher.accept_token(tokenizer.encode("5", add_special_tokens=False)[0])
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    matcher.rollback(1)  # the EOS
    assert matcher.is_terminated()
    matcher.rollback(1)  # the "2"
    assert not matcher.is_terminated() and matcher.error_message() is None


def test_eos_ends_an_open_ended_grammar_and_rolls_back(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(GrammarSpec.regex("[0-9]+")))
    assert not matcher.accept_token(EOS), "EOS before the grammar accepts"
    assert matcher.accept_tokens(tokenizer.encode("12", add_special_tokens=False)) == 2
    assert matcher.is_accepting() and not matcher.is_terminated()
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated() and matcher.is_accepting()
    assert matcher.accept_token(tokenizer.encode("3", add_special_tokens=False)[0])


def test_rejected_token_leaves_state_intact(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(GrammarSpec.regex(r"\d{4}-\d{2}-\d{2}")))
    assert matcher.accept_tokens(tokenizer.encode("2024-", add_special_tokens=False)) == 5
    row_before = allocate_bitmask(1, backend.vocab_size)[0]
    matcher.fill_bitmask(row_before)
    for bad in tokenizer.encode("x-a", add_special_tokens=False) + [EOS, 0, 1]:
        assert not matcher.accept_token(bad)
    assert matcher.error_message() is None
    row_after = allocate_bitmask(1, backend.vocab_size)[0]
    matcher.fill_bitmask(row_after)
    np.testing.assert_array_equal(row_before, row_after)
    assert matcher.accept_tokens(tokenizer.encode("01-31", add_special_tokens=False)) == 5
    assert matcher.is_terminated()


def test_rollback_restores_the_mask(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(GrammarSpec.json_schema(SCHEMAS["enum_and_pattern"])))
    prefix = tokenizer.encode('{"color": "red", "code": "AB', add_special_tokens=False)
    masks = []
    row = allocate_bitmask(1, backend.vocab_size)[0]
    for token in prefix:
        matcher.fill_bitmask(row)
        masks.append(row.copy())
        assert matcher.accept_token(token)
    matcher.rollback(3)
    matcher.fill_bitmask(row)
    np.testing.assert_array_equal(row, masks[-3])
    matcher.rollback(0)
    with pytest.raises(ValueError):
        matcher.rollback(-1)
    with pytest.raises(ValueError, match="only"):
        matcher.rollback(len(prefix))  # 3 already rolled back
    assert matcher.num_tokens == len(prefix) - 3 and matcher.error_message() is None
    matcher.rollback(len(prefix) - 3)
    np.testing.assert_array_equal(_mask(matcher, backend.vocab_size), masks[0])


def test_fill_bitmask_batch_fills_only_its_rows(backend, tokenizer):
    specs = [
        GrammarSpec.regex("[0-9]+"),
        GrammarSpec.from_choices(["yes", "no"]),
        GrammarSpec.json_schema({"type": "object"}),
    ]
    matchers = [backend.new_matcher(backend.compile(s)) for s in specs]
    bitmask = allocate_bitmask(4, backend.vocab_size)
    backend.fill_bitmask_batch([(matchers[0], 0), (matchers[1], 2), (matchers[2], 3)], bitmask)
    assert (bitmask[1] == -1).all()
    for matcher, row in zip(matchers, [0, 2, 3]):
        single = allocate_bitmask(1, backend.vocab_size)[0]
        matcher.fill_bitmask(single)
        np.testing.assert_array_equal(bitmask[row], single)
    assert unpack_bitmask(bitmask[2:3], backend.vocab_size).sum() < 20
    with pytest.raises(ValueError, match="shape"):
        matchers[0].fill_bitmask(np.zeros(10, dtype=np.int32))
    with pytest.raises(ValueError, match="int32"):
        matchers[0].fill_bitmask(np.zeros(backend.num_words, dtype=np.int64))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec.regex("(ab"), r"invalid regex.*unclosed group"),
        (GrammarSpec.regex("[a-"), r"invalid regex.*unclosed character class"),
        (GrammarSpec.regex("a(?=b)"), r"invalid regex.*look-around"),
        (GrammarSpec.regex("a{3,1}"), r"invalid regex.*repetition"),
        # builds and masks fine; the lexer's limit only trips on the first token (caught by a probe step)
        (GrammarSpec.regex("a{99999999}"), r"invalid regex.*too many expressions"),
        (GrammarSpec.json_schema('{"type": "nope"}'), r"invalid JSON schema.*nope"),
        (GrammarSpec.json_schema("not json {"), r"invalid JSON schema: not valid JSON"),
        (GrammarSpec.json_schema("[1, 2]"), r"invalid JSON schema: expected a JSON object"),
        (GrammarSpec.json_schema("[" * 100000), r"^invalid JSON schema: nested too deeply$"),  # was a RecursionError
        (GrammarSpec("choices", "[" * 100000), r"invalid choices.*nested too deeply"),
        (GrammarSpec.json_schema('{"$ref": "#/$defs/missing"}'), r"invalid JSON schema.*missing"),
        (GrammarSpec.json_schema('{"type": "string", "pattern": "(x"}'), r"invalid JSON schema.*regex parse error"),
        (GrammarSpec.json_schema('{"type": "array", "uniqueItems": true}'), r"invalid JSON schema.*uniqueItems"),
        (GrammarSpec.json_schema('{"type": "string", "minLength": 5, "maxLength": 2}'), r"invalid JSON sch.*minLength"),
        (GrammarSpec.ebnf("start: foo bar"), r"invalid EBNF grammar.*unknown name"),
        (GrammarSpec.ebnf('root ::= "a" ('), r"invalid EBNF grammar"),
        (GrammarSpec.ebnf("   "), r"invalid EBNF grammar: empty"),
        # llguidance stops with NoExtensionBias: no token (nor the end) may come first
        (GrammarSpec.ebnf("root ::= root"), r"^invalid EBNF grammar: the grammar matches no string$"),
        (GrammarSpec.regex("[^\\x00-\\x{10FFFF}]"), r"^invalid regex: the grammar matches no string$"),
        (GrammarSpec.from_choices([]), r"invalid choices: the list is empty"),
        (GrammarSpec("choices", '["a", 1]'), r"invalid choices: expected a JSON list of strings"),
    ],
)
def test_invalid_grammars_raise_with_the_reason(backend, spec, message):
    with pytest.raises(InvalidGrammarError, match=re.compile(message, re.S)):
        backend.compile(spec)
    assert backend.lookup(spec) is None


def test_compile_cache_is_an_lru_and_vocab_can_be_padded(tokenizer):
    backend = LLGuidanceBackend(tokenizer, cache_size=2, vocab_size=49152 + 77)
    assert backend.vocab_size == 49229 and backend.num_words == 1539
    a, b, c = (GrammarSpec.regex(p) for p in ("a+", "b+", "c+"))
    compiled_a = backend.compile(a)
    assert backend.compile(a) is compiled_a and backend.lookup(a) is compiled_a
    backend.compile(b)
    backend.lookup(a)  # a is now the most recent
    backend.compile(c)
    assert backend.lookup(b) is None and backend.lookup(a) is compiled_a and backend.num_cached == 2
    row = allocate_bitmask(1, backend.vocab_size)[0]
    backend.new_matcher(backend.compile(GrammarSpec.regex("(.|\n)*"))).fill_bitmask(row)
    allowed = unpack_bitmask(row[None], backend.vocab_size)[0]
    assert not allowed[49152:].any() and allowed[100:49152].sum() > 40000


def test_invalid_whitespace_pattern_fails_at_start(tokenizer):
    with pytest.raises(ValueError, match="whitespace pattern"):
        get_grammar_backend("llguidance", tokenizer, whitespace_pattern="[")


def _mask(matcher, vocab_size):
    row = allocate_bitmask(1, vocab_size)[0]
    matcher.fill_bitmask(row)
    return row


@pytest.fixture(scope="module")
def op_tokens(tokenizer):
    texts = ['{"', "color", '":', '"', "red", '",', "code", "AB", "C", "-", "1", "ok", "true", "}", " ", "x"]
    return sorted({t for text in texts for t in tokenizer.encode(text, add_special_tokens=False)} | {EOS})


def test_accept_and_rollback_match_a_replay(backend, op_tokens):
    """Property: after any mix of accepts (valid or not) and rollbacks, the mask equals that of a fresh
    matcher fed the accepted tokens."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    compiled = backend.compile(GrammarSpec.json_schema(SCHEMAS["enum_and_pattern"]))
    ops = st.lists(
        st.one_of(
            st.tuples(st.just("accept"), st.sampled_from(op_tokens)),
            st.tuples(st.just("rollback"), st.integers(0, 3)),
        ),
        max_size=25,
    )

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(ops)
    def check(operations):
        matcher = backend.new_matcher(compiled)
        accepted: list[int] = []
        for op, arg in operations:
            if op == "accept":
                before = _mask(matcher, backend.vocab_size)
                is_allowed = bool(unpack_bitmask(before[None], backend.vocab_size)[0, arg])
                assert matcher.accept_token(arg) == is_allowed
                if is_allowed:
                    accepted.append(arg)
                else:
                    np.testing.assert_array_equal(_mask(matcher, backend.vocab_size), before)
            else:
                num = min(arg, len(accepted))
                matcher.rollback(num)
                del accepted[len(accepted) - num :]
        replay = backend.new_matcher(compiled)
        assert replay.accept_tokens(accepted) == len(accepted)
        np.testing.assert_array_equal(_mask(matcher, backend.vocab_size), _mask(replay, backend.vocab_size))
        assert matcher.is_terminated() == replay.is_terminated() and matcher.error_message() is None
        assert matcher.num_tokens == len(accepted)

    check()
