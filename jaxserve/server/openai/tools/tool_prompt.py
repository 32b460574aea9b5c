"""Putting tools and earlier tool calls into the prompt.

A chat template that mentions `tools` renders them itself (transformers passes `tools=` to it) and is
given assistant `tool_calls` and `tool` messages as they are. For a template without a tools section
(SmolLM2's, for one) jaxserve writes the default tool prompt into the system message:

    You can call these functions:
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
    ...
    <the parser's instructions, e.g. <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>>

and renders an earlier assistant call as the parser's text for it, a tool result as a user message
`<tool_response>\\n{content}\\n</tool_response>` (Hermes' convention), so any template can show them.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from jaxserve.server.openai.tools.parsers import JSON_ERRORS, ToolCallParser
from jaxserve.server.protocol import Tool

DEFAULT_TOOL_PROMPT_HEADER = "You can call these functions:"


def template_has_tools(chat_template: str | None) -> bool:
    """Whether a Jinja chat template renders a `tools` variable itself."""
    return bool(chat_template) and "tools" in chat_template


def default_tool_prompt(tools: Sequence[Tool], parser: ToolCallParser) -> str:
    """The system-prompt text describing `tools` and how to call them (see the module docstring)."""
    lines = [DEFAULT_TOOL_PROMPT_HEADER]
    lines += [json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools]
    lines.append(parser.instructions())
    return "\n".join(lines)


def with_default_tool_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    """`messages` with `prompt` appended to the first system message (or in a new one at the front)."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}".strip())
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def render_tool_turn(message: dict[str, Any], parser: ToolCallParser, template_tools: bool) -> dict[str, Any]:
    """An assistant message with `tool_calls`, or a `tool` message, as the template will see it.

    `message` holds the request's fields (`tool_calls` entries with `function.arguments` as JSON text).
    For a tools-aware template the arguments become objects (what Qwen's and Llama's templates expect);
    otherwise the calls become text in the parser's format and a tool result a user message.
    """
    if message["role"] == "tool":
        if template_tools:
            return message
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = [(c["function"]["name"], _arguments(c["function"]["arguments"])) for c in message.get("tool_calls") or ()]
    if template_tools:
        tool_calls = [{"type": "function", "id": c.get("id"), "function": {"name": n, "arguments": a}}
                      for c, (n, a) in zip(message["tool_calls"], calls)]
        return {**message, "tool_calls": tool_calls}
    parts = ([message["content"]] if message["content"] else []) + [parser.format_call(n, a) for n, a in calls]
    return {"role": "assistant", "content": "\n".join(parts)}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except JSON_ERRORS:
        return text
