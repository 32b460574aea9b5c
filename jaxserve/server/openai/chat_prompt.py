"""The prompt of a chat request: messages (and tools) through the model's chat template.

- Content parts are joined (text only). Assistant `tool_calls` and `tool` results are rendered as
  `function_call.tool_prompt` says: given to a tools-aware template as they are, otherwise as text.
- Tools (unless tool_choice is "none") go to a template that has a tools section, else into the
  system message as the default tool prompt.
- Assistant prefill (vLLM's and SGLang's `continue_final_message`): the last message, which must be the
  assistant's, is left open so the reply continues it (transformers' `continue_final_message`). Without
  it, `add_generation_prompt` (default true) opens a new assistant turn.
- `chat_template_kwargs` (SGLang's and vLLM's field) become variables of the template.

Every rejection is an `APIError` (400) naming the field.
"""

from __future__ import annotations

from typing import Any

from jaxserve.server.errors import APIError
from jaxserve.server.openai.tools import ToolCallParser
from jaxserve.server.openai.tools.tool_prompt import (
    default_tool_prompt,
    render_tool_turn,
    template_has_tools,
    with_default_tool_prompt,
)
from jaxserve.server.protocol import ChatCompletionRequest, Tool


def check_prefill(req: ChatCompletionRequest) -> None:
    """Raise APIError for a continue_final_message that cannot apply."""
    if not req.continue_final_message:
        return
    if req.add_generation_prompt:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true", 400,
                       param="continue_final_message", code="invalid_value")
    if not req.messages or req.messages[-1].role != "assistant":
        raise APIError("continue_final_message needs the last message to be the assistant's", 400,
                       param="continue_final_message", code="invalid_value")


def chat_prompt(tokenizer: Any, req: ChatCompletionRequest, parser: ToolCallParser, tools: list[Tool] | None,
                template: str | None = None) -> str:
    """The prompt text of `req` (`tools`: those to show the model, None for none); `template` is the
    `--chat-template` text that replaces the tokenizer's own (None: the tokenizer's).

    Raises:
        APIError: no messages, non-text content, no chat template, or the template rejects the
            conversation.
    """
    if not req.messages:
        raise APIError("messages must contain at least one message", 400, param="messages", code="invalid_value")
    if template is None:
        template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise APIError("the model has no chat template; use /v1/completions", 400, param="messages", code="invalid_value")
    check_prefill(req)
    template_tools = template_has_tools(template)
    messages = []
    for i, m in enumerate(req.messages):
        message: dict[str, Any] = {"role": m.role, "content": _text_of(m.content, i)}
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls or m.role == "tool":
            message = render_tool_turn(message, parser, template_tools)
        messages.append(message)
    kwargs: dict[str, Any] = _template_kwargs(req.chat_template_kwargs)
    if tools:
        if template_tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        else:
            messages = with_default_tool_prompt(messages, default_tool_prompt(tools, parser))
    if req.continue_final_message:
        kwargs.update(add_generation_prompt=False, continue_final_message=True)
    else:
        kwargs["add_generation_prompt"] = req.add_generation_prompt is not False
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template, **kwargs)
    except Exception as e:  # the template rejects the conversation (roles out of order, ...)
        raise APIError(f"the chat template rejected the messages: {e}", 400, param="messages", code="invalid_value") from None


# what the request's own fields (or the renderer) set; as template variables they would contradict them
_RESERVED_TEMPLATE_KWARGS = ("messages", "conversation", "tools", "documents", "tokenize", "add_generation_prompt",
                             "continue_final_message", "return_dict", "chat_template")


def _template_kwargs(extra: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` (SGLang's and vLLM's field): extra variables of the chat template, e.g.
    `{"enable_thinking": false}` for Qwen3's; a template ignores the ones it does not read.

    Raises:
        APIError: a key that the request's own fields set (add_generation_prompt, tools, ...).
    """
    for key in extra or {}:
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise APIError(f"chat_template_kwargs: {key!r} cannot be set here (it is set by the request's own fields "
                           f"or the server)", 400, param="chat_template_kwargs", code="invalid_value")
    return dict(extra or {})


def _text_of(content: Any, i: int) -> str:
    if not isinstance(content, list):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise APIError(f"content parts of type {part.type!r} are not supported (text only)", 400,
                           param=f"messages[{i}].content", code="unsupported_parameter")
        if part.text is None:
            raise APIError("a content part of type 'text' needs a 'text' field", 400,
                           param=f"messages[{i}].content[{j}].text", code="missing_required_parameter")
        parts.append(part.text)
    return "\n".join(parts)
