"""How a chat request uses tools: `tool_plan` checks `tools` / `tool_choice` and decides what the model
is shown, how its reply is parsed and which grammar forces a call; `tool_calls_out` gives parsed calls
their OpenAI ids."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Iterable

from jaxserve.server.errors import APIError
from jaxserve.server.function_call.parsers import ParsedCall, ToolCallParser, get_parser
from jaxserve.server.protocol import ChatCompletionRequest, FunctionCall, Tool, ToolCall


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How a chat request uses tools: those shown to the model (none for tool_choice "none"), the
    parser of the reply, and the grammar that forces a call (tool_choice "required" or named)."""

    tools: list[Tool] | None
    parser: ToolCallParser
    grammar: str | None


def tool_plan(req: ChatCompletionRequest, parser_name: str | None) -> ToolPlan:
    """Check tools / tool_choice. Raises APIError (400) naming the field."""
    parser = get_parser(parser_name)
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    if choice == "none" or (choice == "auto" and not req.tools):  # "auto" with nothing to call: no calls
        return ToolPlan(None, parser, None)
    if not req.tools:
        raise APIError(f"tool_choice {_choice_name(choice)} needs tools", 400, param="tool_choice", code="invalid_value")
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise APIError("tools declare the same function name twice", 400, param="tools", code="invalid_value")
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


def _choice_name(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def tool_calls_out(calls: Iterable[ParsedCall]) -> list[ToolCall]:
    return [ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]
