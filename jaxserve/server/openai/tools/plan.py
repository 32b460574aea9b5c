"""How a chat request uses tools: `tool_plan` checks `tools` / `tool_choice` and decides what the model
is shown, how its reply is parsed and which grammar forces a call; `tool_calls_out` gives parsed calls
their OpenAI ids."""

from __future__ import annotations

import dataclasses
import re
import uuid
from typing import Any, Iterable

from llguidance import LLMatcher

from jaxserve.server.errors import APIError
from jaxserve.server.openai.tools.parsers import ParsedCall, ToolCallParser, get_parser
from jaxserve.server.protocol import ChatCompletionRequest, FunctionCall, Tool, ToolCall


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How a chat request uses tools: those shown to the model (none for tool_choice "none"), the
    parser of the reply, and the grammar that forces a call (tool_choice "required" or named)."""

    tools: list[Tool] | None
    parser: ToolCallParser
    grammar: str | None


def tool_plan(req: ChatCompletionRequest, parser_name: str | None) -> ToolPlan:
    """Check tools (`check_tools`) and tool_choice. Raises APIError (400) naming the field."""
    parser = get_parser(parser_name)
    check_tools(req.tools or [])
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    if choice == "none" or (choice == "auto" and not req.tools):  # "auto" with nothing to call: no calls
        return ToolPlan(None, parser, None)
    if not req.tools:
        raise APIError(f"tool_choice {_choice_name(choice)} needs tools", 400, param="tool_choice", code="invalid_value")
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        again = next(i for i, name in enumerate(names) if name in names[:i])
        raise APIError(f"tools declare the function name {names[again]!r} twice", 400,
                       param=f"tools[{again}].function.name", code="invalid_value")
    if choice == "auto":
        return ToolPlan(list(req.tools), parser, None)
    forced = list(req.tools)
    if not isinstance(choice, str):
        forced = [t for t in req.tools if t.function.name == choice.function.name]
        if not forced:
            raise APIError(f"tool_choice names the function {choice.function.name!r}, which tools do not declare", 400,
                           param="tool_choice.function.name", code="invalid_value")
    if req.regex is not None or req.ebnf is not None or req.json_schema is not None or (
            req.response_format is not None and req.response_format.type != "text"):
        raise APIError(f"tool_choice {_choice_name(choice)} constrains the output itself: drop response_format / "
                       "regex / json_schema / ebnf", 400, param="tool_choice", code="invalid_value")
    return ToolPlan(list(req.tools), parser, parser.grammar(forced))


# OpenAI's rule for a function name; it also keeps a name from closing a format's tags ("x</tool_call>y")
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_MAX_SCHEMA_ERROR_CHARS = 200


def check_tools(tools: list[Tool]) -> None:
    """Each function name matches OpenAI's ^[a-zA-Z0-9_-]{1,64}$ and each `parameters` is a JSON schema of
    an object (a call's arguments are one) that llguidance compiles (the grammar a forced call uses),
    whatever tool_choice is.

    Raises:
        APIError: 400 with param "tools[i].function.name" or "tools[i].function.parameters".
    """
    for i, tool in enumerate(tools):
        fn = tool.function
        if not FUNCTION_NAME.fullmatch(fn.name):
            raise APIError(f"function name {fn.name!r} must be 1 to 64 of a-z, A-Z, 0-9, _ and -", 400,
                           param=f"tools[{i}].function.name", code="invalid_value")
        if fn.parameters is None:
            continue
        kind = fn.parameters.get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            # the arguments are a JSON object (OpenAI's rule; every call format writes an object)
            raise APIError(f"parameters must be a JSON schema of an object (type \"object\"), got type {kind!r}", 400,
                           param=f"tools[{i}].function.parameters", code="invalid_value")
        # tokenizer-free: the schema's own errors ("Invalid type: bogus", "Unsatisfiable schema: ...")
        try:
            error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(fn.parameters))
        except (TypeError, ValueError) as e:
            error = str(e) or type(e).__name__
        if error:
            error = " ".join(error.split())  # llguidance's regex errors span lines
            if len(error) > _MAX_SCHEMA_ERROR_CHARS:
                error = error[:_MAX_SCHEMA_ERROR_CHARS] + " ..."
            raise APIError(f"invalid JSON schema: {error}", 400, param=f"tools[{i}].function.parameters",
                           code="invalid_value")


def _choice_name(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def tool_calls_out(calls: Iterable[ParsedCall]) -> list[ToolCall]:
    return [ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]
