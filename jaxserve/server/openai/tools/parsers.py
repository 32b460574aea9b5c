"""Tool-call output formats: parse model text into calls, write calls back as text, and the Lark grammar
that forces a call (tool_choice "required" or a named function).

Two formats, under SGLang's `--tool-call-parser` names:
- `qwen25` (also `qwen`, `hermes`): each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  (the Hermes-2-Pro / Qwen2.5 format); text outside the tags is content.
- `llama3`: the whole reply is JSON: `{"name": ..., "parameters": {...}}` (Llama 3.1/3.2's JSON tool
  format; "arguments" is accepted too), several calls separated by `;`, an optional `<|python_tag|>`
  first. A reply that is not such JSON is content.

The grammars embed each function's JSON schema through llguidance's Lark `%json` (compact separators, no
free whitespace, so a small model cannot run on in blank space).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # annotations only: serve.py's flag parsing reads PARSERS without importing the app (and jax)
    from jaxserve.server.protocol import Tool

# What decoding a model's (or a client's) JSON text raises: not JSON, or nested past Python's recursion
# limit (a 500 without the second).
JSON_ERRORS = (json.JSONDecodeError, RecursionError)

# JSON layout inside a forced call: what json.dumps writes, and no other whitespace.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    """One tool call read from model output. `arguments` is a JSON object as text."""

    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class ParseResult:
    """Model output split into content (text outside calls; None when there is none) and calls."""

    content: str | None
    calls: tuple[ParsedCall, ...]


def _call_of(obj: Any, args_keys: Sequence[str], known: set[str]) -> ParsedCall | None:
    """A ParsedCall from a decoded JSON object, or None if it is not a call of a declared function."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in known:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except JSON_ERRORS:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def closed_schema(schema: Any, close_object: bool = True) -> Any:
    """`schema` bounded for forced decoding: `additionalProperties: false` on every object schema that
    does not say (as OpenAI's strict mode), at most FORCED_MAX_STRING_CHARS characters in a string and
    FORCED_MAX_ITEMS items in an array that set no bound. What it accepts still validates against
    `schema`; the bounds stop a small model from inventing keys or repeating itself inside a string
    until max_tokens, so a forced call always closes.

    Left open, so that what response_format accepts stays satisfiable: an object that needs keys it
    does not list (`minProperties` above the number of `properties`, a `required` name not among them)
    and, as `json_schema_strict.close_unnamed` leaves them, the parts of an `allOf` and the schema
    holding one (closing each part would make their intersection refuse the other parts' keys).
    `not` and `if` are not touched: bounding what they match would change what the schema accepts."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_schema(v) if k in _SUBSCHEMA_KEYS else v for k, v in schema.items()}
    if isinstance(schema.get("allOf"), list):
        out["allOf"] = [closed_schema(s, close_object=False) for s in schema["allOf"]]
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed_schema(s) for name, s in schema[key].items()}
    types = schema.get("type") if isinstance(schema.get("type"), list) else [schema.get("type")]
    unbounded = "enum" not in schema and "const" not in schema
    if ("object" in types or "properties" in schema) and close_object and "allOf" not in schema and not (
            "additionalProperties" in schema or "unevaluatedProperties" in schema or _needs_unlisted_keys(schema)):
        out["additionalProperties"] = False
    if "string" in types and unbounded and "maxLength" not in schema:
        out["maxLength"] = max(FORCED_MAX_STRING_CHARS, schema.get("minLength", 0))
    if "array" in types and unbounded and "maxItems" not in schema:
        out["maxItems"] = max(FORCED_MAX_ITEMS, schema.get("minItems", 0))
    return out


def _needs_unlisted_keys(schema: dict[str, Any]) -> bool:
    """Whether an object schema needs a key its `properties` do not list (so closing it would refuse every
    object); with `patternProperties` the pattern may allow it, and it counts as listed."""
    listed = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if "patternProperties" in schema:
        return False
    min_properties = schema.get("minProperties", 0)
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    return (isinstance(min_properties, int) and min_properties > len(listed)) or any(r not in listed for r in required)


FORCED_MAX_STRING_CHARS = 128
FORCED_MAX_ITEMS = 16
_SUBSCHEMA_KEYS = frozenset({"items", "prefixItems", "anyOf", "oneOf", "then", "else"})


def _literal(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def call_rules(tools: Sequence[Tool], args_key: str) -> str:
    """Lark rules whose rule `call` is exactly one call object `{"name": <name>, args_key: <arguments>}`
    (json.dumps's layout) of one of `tools`, its arguments valid against that function's parameters,
    closed (`closed_schema`).

    Each function's parameters are the root of their own `%json` rule, so a `$ref` inside them
    (`#/$defs/node`, `#` itself: a recursive schema) resolves as it does in `response_format`, and two
    functions' `$defs` of the same name do not meet."""
    rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        params = closed_schema(tool.function.parameters or {"type": "object", "properties": {}})
        head = f'{{"name": {json.dumps(tool.function.name)}, "{args_key}": '
        rules.append(f'call_{i}: {_literal(head)} args_{i} "}}"')
        rules.append(f"args_{i}: %json " + json.dumps({**params, "x-guidance": _COMPACT_JSON}))
    return "\n".join(rules)


class ToolCallParser:
    """One output format. Subclasses set `name`, `start_marker` (text that opens a call; None when the
    reply as a whole is the call) and implement `parse`, `format_call`, `grammar` and `instructions`."""

    name: str = ""
    start_marker: str | None = None

    def parse(self, text: str, tools: Sequence[Tool]) -> ParseResult:
        raise NotImplementedError

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        """The text of one call in this format (to render an earlier assistant turn)."""
        raise NotImplementedError

    def grammar(self, tools: Sequence[Tool]) -> str:
        """A Lark grammar (llguidance) whose every string is exactly one call of one of `tools`, its
        arguments valid against that function's schema."""
        raise NotImplementedError

    def instructions(self) -> str:
        """How to call, for the default tool prompt."""
        raise NotImplementedError


# `{"name": "<name>", "arguments": ` at the start of a call: what a call's stream can be sent after
CALL_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def raw_arguments(body: str) -> str | None:
    """The text of the arguments object of a call body `{"name": ..., "arguments": {...}}`, or None
    when the body has another layout (then the arguments are re-serialized)."""
    m = CALL_HEADER.match(body)
    if m is None or not body[m.end() :].startswith("{"):
        return None
    try:
        obj, end = json.JSONDecoder().raw_decode(body, m.end())
    except JSON_ERRORS:
        return None
    return body[m.end() : end] if isinstance(obj, dict) else None


def _skip_space(text: str, at: int) -> int:
    """The index of the first non-whitespace character of `text` at or after `at` (str.isspace's)."""
    while at < len(text) and text[at].isspace():
        at += 1
    return at


class TaggedJsonParser(ToolCallParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5 / Hermes)."""

    name = "qwen25"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def parse(self, text: str, tools: Sequence[Tool]) -> ParseResult:
        """Calls found by the format's structure: the start marker, one JSON object, the end marker
        (whitespace around the object). The end marker is looked for only after the object, so an
        argument string may hold either marker's text; a start marker that opens no well-formed call
        of a declared function is text, and the search goes on after it."""
        known = {t.function.name for t in tools}
        calls, content, pos, search = [], [], 0, 0
        while (start := text.find(self.start_marker, search)) >= 0:
            search = start + len(self.start_marker)
            found = self.call_at(text, search, known)
            if found is None:
                continue
            call, search = found
            content.append(text[pos:start])
            calls.append(call)
            pos = search
        content.append(text[pos:])
        rest = "".join(content)
        return ParseResult(rest if rest.strip() or not calls else None, tuple(calls))

    def call_at(self, text: str, at: int, known: set[str]) -> tuple[ParsedCall, int] | None:
        """The call whose body starts at `at` (just after a start marker) and the index just past its
        end marker, or None if none is there."""
        begin = _skip_space(text, at)
        if not text.startswith("{", begin):
            return None
        try:
            obj, end = json.JSONDecoder().raw_decode(text, begin)
        except JSON_ERRORS:
            return None
        close = _skip_space(text, end)
        if not text.startswith(self.end_marker, close):
            return None
        call = _call_of(obj, ("arguments", "parameters"), known)
        if call is None:
            return None
        if (raw := raw_arguments(text[begin:end])) is not None:
            call = ParsedCall(call.name, raw)  # the arguments as the model wrote them, as streamed
        return call, close + len(self.end_marker)

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.start_marker}\n{body}\n{self.end_marker}"

    def grammar(self, tools: Sequence[Tool]) -> str:
        open_tag, close_tag = _literal(self.start_marker + "\n"), _literal("\n" + self.end_marker)
        return f"start: {open_tag} call {close_tag}\n" + call_rules(tools, "arguments")

    def instructions(self) -> str:
        return (
            "To call a function, reply with one line per call, each wrapped in tags:\n"
            f'{self.start_marker}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{self.end_marker}'
        )


class PlainJsonParser(ToolCallParser):
    """The reply is `{"name": ..., "parameters": {...}}` (Llama 3's JSON tool format), calls separated by `;`."""

    name = "llama3"
    start_marker = None
    python_tag = "<|python_tag|>"

    def parse(self, text: str, tools: Sequence[Tool]) -> ParseResult:
        known = {t.function.name for t in tools}
        body = text.strip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag) :].strip()
        if not body.startswith(("{", "[")):
            return ParseResult(text, ())
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        try:
            while pos < len(body):
                obj, end = decoder.raw_decode(body, pos)
                for item in obj if isinstance(obj, list) else [obj]:
                    call = _call_of(item, ("parameters", "arguments"), known)
                    if call is None:
                        return ParseResult(text, ())
                    calls.append(call)
                pos = end
                while pos < len(body) and body[pos] in " \t\r\n;":
                    pos += 1
        except JSON_ERRORS:
            return ParseResult(text, ())
        return ParseResult(None, tuple(calls))

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def grammar(self, tools: Sequence[Tool]) -> str:
        return "start: call\n" + call_rules(tools, "parameters")

    def instructions(self) -> str:
        return (
            "To call a function, reply with only a JSON object, nothing else:\n"
            '{"name": <function-name>, "parameters": <arguments-json-object>}'
        )


# --tool-call-parser NAME -> format (SGLang's names for these formats)
PARSERS: dict[str, type[ToolCallParser]] = {
    "qwen25": TaggedJsonParser,
    "qwen": TaggedJsonParser,
    "hermes": TaggedJsonParser,
    "llama3": PlainJsonParser,
}
DEFAULT_PARSER = "qwen25"


def get_parser(name: str | None) -> ToolCallParser:
    """The parser registered as `name` (None: DEFAULT_PARSER).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    cls = PARSERS.get(name or DEFAULT_PARSER)
    if cls is None:
        raise ValueError(f"--tool-call-parser {name!r} is not one of: {', '.join(PARSERS)}")
    return cls()
