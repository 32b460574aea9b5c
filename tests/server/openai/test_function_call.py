"""Tool-call formats (jaxserve/server/openai/tools/): parsing, streaming at every split point, the
forced-call grammars against llguidance, and the prompt through a tools-aware template."""

from __future__ import annotations

import copy
import json

import jsonschema
import llguidance
import llguidance.hf
import pytest
from llguidance import LLMatcher

from jaxserve.engine.engine_loop import EngineLoop
from jaxserve.server.app import create_app
from jaxserve.server.openai.chat_prompt import chat_prompt
from jaxserve.server.openai.tools import PARSERS, get_parser
from jaxserve.server.openai.tools.parsers import closed_schema
from jaxserve.server.openai.tools.streaming import CallArguments, CallStart, Content, ToolCallStreamer
from jaxserve.server.protocol import ChatCompletionRequest, Tool
from jaxserve.server_args import ServerArgs
from tests.server.fakes import FakeEngine

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})
TOOLS = [WEATHER, TIME]

TAGGED = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done', "Let me check.\n\n done",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ('<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>', '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>', []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', []),
    ("No call here, just text with <tool and a < sign.", "No call here, just text with <tool and a < sign.", []),
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>', None, [("get_weather", {"city": "Rome"})]),
    # argument strings that hold the markers' text: the end is where the JSON object ends, not the first marker
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}\n</tool_call>', None,
     [("get_weather", {"city": "a</tool_call>b"})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "<tool_call>}{</tool_call>"}}\n</tool_call>', None,
     [("get_weather", {"city": "<tool_call>}{</tool_call>"})]),
    # a marker that opens no call is text, and a call after it is still found
    ('I use <tool_call> tags. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "I use <tool_call> tags. ",
     [("get_time", {})]),
    ('<tool_call>{"name": "get_time", "arguments": {}} no end <tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": {}} no end ', [("get_time", {})]),
    ('<tool_call> \n{"name": "get_time", "arguments": {}}  \n \n</tool_call>', None, [("get_time", {})]),
    ('<tool_call>{"name": "get_time", "arguments": {}}\n</tool_cal', '<tool_call>{"name": "get_time", "arguments": {}}\n</tool_cal', []),
    ('<tool_call>{"name": "unknown", "arguments": {"x": "</tool_call>"}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {"x": "</tool_call>"}}</tool_call>', []),
]
PLAIN = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "arguments": {"city": "Lima"}}', None,
     [("get_time", {}), ("get_weather", {"city": "Lima"})]),
    ("Paris is sunny.", "Paris is sunny.", []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
]


def _calls(result):
    return [(c.name, json.loads(c.arguments)) for c in result.calls]


@pytest.mark.parametrize("name, cases", [("qwen25", TAGGED), ("hermes", TAGGED), ("llama3", PLAIN)])
def test_parse(name, cases):
    parser = get_parser(name)
    for text, content, calls in cases:
        result = parser.parse(text, TOOLS)
        assert (result.content, _calls(result)) == (content, calls), text


DEEP = "[" * 100000  # JSON nested past Python's recursion limit: json.loads raises RecursionError


@pytest.mark.parametrize("name, text", [
    ("qwen25", f"<tool_call>{DEEP}</tool_call>"),
    ("qwen25", f'<tool_call>{{"name": "get_time", "arguments": "{DEEP}"}}</tool_call>'),
    ("llama3", DEEP),
    ("llama3", f'{{"name": "get_time", "parameters": "{DEEP}"}}'),
])
def test_a_reply_nested_too_deeply_is_text_not_a_crash(name, text):
    """A reply whose JSON nests past the recursion limit was a RecursionError (a 500 after the
    generation); it is no call, so it stays the reply's text."""
    result = get_parser(name).parse(text, TOOLS)
    assert (result.content, result.calls) == (text, ())


def _replay(events):
    """(content, [(name, arguments text)]) from a stream's events."""
    content, calls = "", []
    for e in events:
        if isinstance(e, Content):
            content += e.text
        elif isinstance(e, CallStart):
            calls.append([e.name, ""])
        else:
            calls[-1][1] += e.text
    return content, [tuple(c) for c in calls]


@pytest.mark.parametrize("name, cases, incremental", [
    ("qwen25", TAGGED, False), ("llama3", PLAIN, False),
    ("qwen25", [c for c in TAGGED if c[1] is None and len(c[2]) == 1], True),  # forced: a single well-formed call
])
def test_streaming_equals_parsing_at_every_split(name, cases, incremental):
    parser = get_parser(name)
    for text, _, _ in cases:
        whole = parser.parse(text, TOOLS)
        want_calls = [(c.name, c.arguments) for c in whole.calls]
        for cut in range(len(text) + 1):
            streamer = ToolCallStreamer(parser, TOOLS, incremental)
            content, calls = _replay(streamer.feed(text[:cut]) + streamer.feed(text[cut:]) + streamer.finish())
            assert calls == want_calls, (text, cut)
            assert content == (whole.content or "") or (not whole.content and not content.strip()), (text, cut)


def test_incremental_stream_sends_the_name_first_then_argument_pieces():
    parser = get_parser("qwen25")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris \\" x"}}\n</tool_call>'
    streamer = ToolCallStreamer(parser, TOOLS, incremental=True)
    events = [e for ch in text for e in streamer.feed(ch)] + streamer.finish()
    assert events[0] == CallStart("get_weather") and all(isinstance(e, CallArguments) for e in events[1:])
    assert len(events) > 10  # one piece per character fed
    assert "".join(e.text for e in events[1:]) == '{"city": "Pa}ris \\" x"}' == parser.parse(text, TOOLS).calls[0].arguments


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="qwen25"):
        get_parser("nope")
    assert {"qwen25", "qwen", "hermes", "llama3"} <= set(PARSERS)


def test_closed_schema_still_validates_what_it_accepts():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"type": "object"}}}}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["items"]["additionalProperties"] is False
    assert schema.get("additionalProperties") is None  # the input is not modified
    doc = {"a": {"b": 1}, "c": [{}]}
    jsonschema.validate(doc, closed)
    jsonschema.validate(doc, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": {"b": 1, "x": 2}}, closed)
    assert closed_schema({"type": "object", "additionalProperties": True})["additionalProperties"] is True


ALL_OF = {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                      {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}
NEEDS_KEYS = [{"type": "object", "minProperties": 1}, {"type": "object", "required": ["x"]},
              {"type": "object", "properties": {"y": {"type": "integer"}}, "required": ["x"]}]


@pytest.mark.parametrize("schema, doc", [(ALL_OF, {"a": 1, "b": True}), *((s, {"x": 1}) for s in NEEDS_KEYS)])
def test_closed_schema_keeps_what_response_format_accepts_satisfiable(schema, doc):
    """Closing each allOf part, or an object that needs keys it does not list, made the schema refuse
    every object: a forced call of it was a 400 ("Unsatisfiable schema"), as response_format it ran."""
    jsonschema.validate(doc, schema)
    jsonschema.validate(doc, closed_schema(schema))
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(closed_schema(schema))) == ""


def test_closed_schema_leaves_not_and_if_alone():
    """Bounding what `not` or `if` match widens what the schema accepts: `not` a string of at most 128
    characters accepts a longer string, which `not` a string refuses (and so does `then` once `if` no
    longer matches it)."""
    schema = {"type": "object", "properties": {"s": {"not": {"type": "string"}},
                                               "t": {"if": {"type": "string"}, "then": {"maxLength": 150}}}}
    closed = closed_schema(schema)
    assert closed["properties"]["s"] == schema["properties"]["s"] and closed["properties"]["t"]["if"] == {"type": "string"}
    for doc in ({"s": "x" * 200}, {"t": "x" * 200}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, closed)


@pytest.fixture(scope="module")
def ll_tokenizer(default_tokenizer):
    return llguidance.hf.from_tokenizer(default_tokenizer)  # seconds for a 49k vocabulary: once


def _matches(grammar: str, text: str, ll) -> bool:
    matcher = LLMatcher(ll, llguidance.grammar_from("lark", grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = ll.tokenize_str(text)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize("name", ["qwen25", "llama3"])
def test_grammar_accepts_exactly_valid_calls(name, ll_tokenizer):
    parser = get_parser(name)
    grammar = parser.grammar([WEATHER])
    good = parser.format_call("get_weather", {"city": "Paris"})
    assert _matches(grammar, good, ll_tokenizer)
    assert parser.parse(good, [WEATHER]).calls[0].name == "get_weather"
    for bad in (parser.format_call("get_weather", {}), parser.format_call("get_time", {}),
                parser.format_call("get_weather", {"city": 3}), "Sure! " + good):
        assert not _matches(grammar, bad, ll_tokenizer), bad


LIST_NODE = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
             "required": ["v", "next"]}
LINKED = Tool.model_validate({"type": "function", "function": {"name": "walk", "parameters": {
    "type": "object", "properties": {"head": {"$ref": "#/$defs/node"}}, "required": ["head"], "$defs": {"node": LIST_NODE}}}})
# the same $defs name in another function, another shape; and a schema that refers to its own root
TAGS = Tool.model_validate({"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"name": {"$ref": "#/$defs/node"}, "child": {"$ref": "#"}},
    "required": ["name"], "$defs": {"node": {"type": "string", "enum": ["a", "b"]}}}}})


@pytest.mark.parametrize("name", ["qwen25", "llama3"])
def test_grammar_of_recursive_schemas(name, ll_tokenizer):
    """A `$ref` in a function's parameters resolves against the parameters, as in response_format
    (the call schema that wrapped them had no `$defs`: "Pointer '/$defs/node' does not exist")."""
    parser = get_parser(name)
    grammar = parser.grammar([LINKED, TAGS])
    assert LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar)) == ""
    good = [("walk", {"head": {"v": 1, "next": {"v": 2, "next": None}}}), ("tag", {"name": "a", "child": {"name": "b"}}),
            ("tag", {"name": "b", "child": {"name": "a", "child": {"name": "a"}}})]
    for fn, args in good:
        jsonschema.validate(args, {"walk": LINKED, "tag": TAGS}[fn].function.parameters)  # the reference
        assert _matches(grammar, parser.format_call(fn, args), ll_tokenizer), args
    bad = [("walk", {"head": {"v": 1, "next": {"v": "2", "next": None}}}), ("walk", {"head": {"v": 1}}),
           ("tag", {"name": "c"}), ("tag", {"name": "a", "child": {"name": "x"}}), ("walk", {"name": "a"})]
    for fn, args in bad:
        assert not _matches(grammar, parser.format_call(fn, args), ll_tokenizer), args


def test_grammar_allows_marker_text_in_strings(ll_tokenizer):
    parser = get_parser("qwen25")
    text = parser.format_call("get_weather", {"city": "a</tool_call>\n<tool_call>b"})
    assert _matches(parser.grammar([WEATHER]), text, ll_tokenizer)
    assert _calls(parser.parse(text, [WEATHER])) == [("get_weather", {"city": "a</tool_call>\n<tool_call>b"})]


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_aware_template_gets_tools_and_calls(default_tokenizer):
    tokenizer = copy.copy(default_tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ], "tools": [WEATHER.model_dump()]})
    prompt = chat_prompt(tokenizer, req, get_parser("qwen25"), [WEATHER])
    assert prompt.startswith("<|im_start|>system\nTools:") and '"get_weather"' in prompt.split("<|im_end|>")[0]
    assert 'CALL get_weather {"city": "Paris"}' in prompt  # arguments as an object, not a JSON string
    assert "<|im_start|>tool\nsunny (for c1)<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_default_tool_prompt_without_a_tools_template(default_tokenizer):
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": "Weather?"}]})
    prompt = chat_prompt(default_tokenizer, req, get_parser("qwen25"), [WEATHER])
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions:\n")
    assert json.dumps(WEATHER.model_dump(exclude_none=True)) in system and "<tool_call>" in system


def test_closed_schema_bounds_strings_and_arrays():
    schema = {"type": "object", "properties": {"s": {"type": "string"}, "e": {"type": "string", "enum": ["a"]},
                                               "m": {"type": "string", "minLength": 500}, "l": {"type": "array", "items": {"type": "string", "maxLength": 3}}}}
    closed = closed_schema(schema)["properties"]
    assert closed["s"]["maxLength"] == 128 and "maxLength" not in closed["e"] and closed["m"]["maxLength"] == 500
    assert closed["l"]["maxItems"] == 16 and closed["l"]["items"]["maxLength"] == 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"s": "x" * 129}, closed_schema(schema))


def test_unknown_tool_call_parser_fails_at_start_up():
    loop = EngineLoop(FakeEngine()).start()
    try:
        with pytest.raises(ValueError, match="--tool-call-parser 'nope' is not one of: qwen25"):
            create_app(loop, ServerArgs(model_path="/models/fake-model", tool_call_parser="nope"))
        create_app(loop, ServerArgs(model_path="/models/fake-model", tool_call_parser="hermes"))
    finally:
        loop.shutdown()


@pytest.fixture(scope="module")
def fake_client():
    from starlette.testclient import TestClient

    loop = EngineLoop(FakeEngine()).start()
    with TestClient(create_app(loop, ServerArgs(model_path="/models/fake-model"))) as client:
        yield client
    loop.shutdown()


def _tool(name: str = "f", parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("tools, param, message", [
    ([_tool("x</tool_call>y")], "tools[0].function.name", "must be 1 to 64 of a-z"),
    ([_tool("ok"), _tool("")], "tools[1].function.name", "must be 1 to 64 of a-z"),
    ([_tool("a" * 65)], "tools[0].function.name", "must be 1 to 64 of a-z"),
    ([_tool("a", {"type": "bogus"})], "tools[0].function.parameters", "must be a JSON schema of an object"),
    ([_tool("a", {"type": "string"})], "tools[0].function.parameters", "must be a JSON schema of an object"),
    ([_tool("a", {"type": ["string", "null"]})], "tools[0].function.parameters", "must be a JSON schema of an object"),
    ([_tool("a", {"properties": {"x": {"type": "bogus"}}})], "tools[0].function.parameters",
     "invalid JSON schema: Invalid type: bogus"),
    ([_tool("ok"), _tool("b", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 3}},
                               "required": ["n"]})], "tools[1].function.parameters", "invalid JSON schema: Unsatisfiable schema"),
    ([_tool("a", {"type": "object", "properties": {"s": {"type": "string", "pattern": "("}}})],
     "tools[0].function.parameters", "invalid JSON schema: regex parse error"),
])
@pytest.mark.parametrize("choice", ["auto", "required", None])
def test_bad_tool_name_or_schema_is_a_400_whatever_tool_choice(fake_client, tools, param, message, choice):
    body = {"messages": [{"role": "user", "content": "call it"}], "max_tokens": 4, "tools": tools}
    if choice is not None:
        body["tool_choice"] = choice
    r = fake_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"] and len(err["message"]) < 300, err


def test_good_tool_names_pass_the_check():
    from jaxserve.server.openai.tools.plan import check_tools

    check_tools([Tool.model_validate(_tool(n)) for n in ("a", "get-weather_2", "Z" * 64)] + TOOLS)
    # an object schema with no type keyword, or a type list that allows an object, is an object schema
    check_tools([Tool.model_validate(_tool("a", {})), Tool.model_validate(_tool("b", {"type": ["object", "null"]}))])
