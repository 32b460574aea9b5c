"""/v1/responses' request as a chat: the checks made before it is one (each a 400 naming the field in
this API's names), its input items as chat messages, and the `ChatCompletionRequest` that
`chat_completions.submit_chat` runs (responses/api.py). Item mapping: messages as they are (text parts
joined), function_call items onto an assistant message's `tool_calls` (consecutive calls: one
message), function_call_output items onto `tool` messages, reasoning items left out (as chat
templates leave out earlier reasoning).
"""

from __future__ import annotations

from typing import Any

import pydantic

from jaxserve.core.field_types import describe
from jaxserve.core.size_limits import METADATA_MAX_KEY_CHARS, METADATA_MAX_PAIRS, METADATA_MAX_VALUE_CHARS
from jaxserve.server.errors import APIError, from_validation_error
from jaxserve.server.openai.chat_completions import MAX_TOP_LOGPROBS
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    ResponseFunctionCallInput,
    ResponseFunctionCallOutput,
    ResponseInputMessage,
    ResponseInputReasoning,
    ResponseInputText,
    ResponsesRequest,
)

# chat names -> Responses names, for the 400s the chat path raises
# (a response_format error is the schema's: `_response_format` checks the rest)
FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format.schema",
               "rid": "request_id"}
# chat fields a user of this API may send by mistake: refused with the name to use (others are ignored)
CHAT_ONLY_FIELDS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
                    "response_format": "text.format"}
# the one `include` value served: token logprobs of the reply's output_text parts
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# fields a chat request takes under the same name and meaning
_CHAT_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                "stop", "seed", "user", "parallel_tool_calls")
_INPUT_ITEMS = {"message": ResponseInputMessage, "reasoning": ResponseInputReasoning,
                "function_call": ResponseFunctionCallInput, "function_call_output": ResponseFunctionCallOutput}

Message = dict[str, Any]  # a chat message, as /v1/chat/completions takes it

def check_input_items(body: dict[str, Any]) -> None:
    """Check each input item on its own, so that a 400 names it (the schema's validation of the union
    of item types would only name `input`): item types other than `_INPUT_ITEMS` and message parts
    other than text are not served.

    Raises:
        APIError: 400 naming `input[i]` and the field in it.
    """
    items = body.get("input")
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(f"input[{i}]: an item must be an object (a message or a typed item), got {describe(item)}",
                           400, param=f"input[{i}]", code="invalid_type")
        kind = item.get("type", "message")
        if not isinstance(kind, str):  # a list or an object: not even hashable, and no item type
            raise APIError(f"input[{i}].type: must be a string, got {describe(kind)}", 400,
                           param=f"input[{i}].type", code="invalid_type")
        if kind not in _INPUT_ITEMS:
            raise APIError(f"input[{i}].type: {kind!r} items are not served (served: {', '.join(_INPUT_ITEMS)})",
                           400, param=f"input[{i}].type", code="unsupported_parameter")
        content = item.get("content")
        for j, part in enumerate(content if kind == "message" and isinstance(content, list) else []):
            where = f"input[{i}].content[{j}]"
            if not isinstance(part, dict):
                raise APIError(f"{where}: a content part must be an object, got {describe(part)}", 400, param=where,
                               code="invalid_type")
            if part.get("type") not in ("input_text", "output_text"):
                raise APIError(f"{where}.type: {part.get('type')!r} parts are not served (text only: input_text, "
                               "output_text)", 400, param=f"{where}.type", code="unsupported_parameter")
            _validate(ResponseInputText, part, where)
        _validate(_INPUT_ITEMS[kind], item, f"input[{i}]")


def _validate(model: type[pydantic.BaseModel], value: dict[str, Any], where: str) -> None:
    """Validate `value` as `model`; a 400 names the field under `where`."""
    try:
        model.model_validate(value)
    except pydantic.ValidationError as e:
        error = from_validation_error(e)
        error.param = f"{where}.{error.param}" if error.param else where
        error.message = f"{where}.{error.message}"
        raise error from None


def check_metadata(metadata: Any) -> None:
    """OpenAI's limits: at most 16 pairs, keys of at most 64 characters, string values of at most 512.

    Raises:
        APIError: 400 naming `metadata` (or the key).
    """
    if not isinstance(metadata, dict):
        return  # a wrong type: the schema's 400
    if len(metadata) > METADATA_MAX_PAIRS:
        raise APIError(f"metadata: at most {METADATA_MAX_PAIRS} pairs, got {len(metadata)}", 400, param="metadata",
                       code="invalid_value")
    for key, value in metadata.items():
        if len(key) > METADATA_MAX_KEY_CHARS:
            raise APIError(f"metadata: keys are at most {METADATA_MAX_KEY_CHARS} characters, got {len(key)}", 400,
                           param="metadata", code="invalid_value")
        if isinstance(value, str) and len(value) > METADATA_MAX_VALUE_CHARS:
            raise APIError(f"metadata.{key}: values are at most {METADATA_MAX_VALUE_CHARS} characters, got {len(value)}",
                           400, param=f"metadata.{key}", code="invalid_value")


def check_chat_only_fields(body: dict[str, Any]) -> None:
    """Refuse the chat completions' names of this API's fields (`CHAT_ONLY_FIELDS`), which would
    otherwise be ignored (a `max_tokens` that limits nothing).

    Raises:
        APIError: 400 naming the field, with the name to use.
    """
    for name, ours in CHAT_ONLY_FIELDS.items():
        if name in body:
            raise APIError(f"{name} is a chat completions field; /v1/responses takes {ours}", 400, param=name,
                           code="unknown_parameter")


def check_supported(req: ResponsesRequest) -> None:
    if req.background and not req.store:
        raise APIError("background responses need store: true", 400, param="store", code="invalid_value")
    if req.background and req.stream:
        raise APIError("background responses are not streamed here: create it, then poll GET /v1/responses/{id}", 400,
                       param="stream", code="unsupported_parameter")
    for i, name in enumerate(req.include or []):
        if name != INCLUDE_LOGPROBS:
            raise APIError(f"include[{i}]: {name!r} is not served (only {INCLUDE_LOGPROBS!r})", 400, param=f"include[{i}]",
                           code="unsupported_parameter")
    if wants_logprobs(req) and req.stream:
        raise APIError(f"include {INCLUDE_LOGPROBS!r} is served without stream only", 400, param="include",
                       code="unsupported_parameter")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:  # alone it returns nothing
        raise APIError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}", 400, param="top_logprobs",
                       code="invalid_value")


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether `include` asks for the output_text parts' token logprobs."""
    return INCLUDE_LOGPROBS in (req.include or [])


def check_call_outputs(history: list[Message], req: ResponsesRequest) -> None:
    """Refuse a function_call_output whose call_id no function call before it carries (in `input` or in
    the conversation `previous_response_id` continues), as OpenAI's API does: the chat would otherwise
    get a tool message that answers nothing.

    Raises:
        APIError: 400 naming `input[i].call_id`.
    """
    if isinstance(req.input, str):
        return
    known = {call["id"] for message in history for call in message.get("tool_calls") or ()}
    for i, item in enumerate(req.input):
        if isinstance(item, ResponseFunctionCallInput):
            known.add(item.call_id)
        elif isinstance(item, ResponseFunctionCallOutput) and item.call_id not in known:
            raise APIError(f"input[{i}]: no function call found for the function_call_output with call_id "
                           f"{item.call_id!r}", 400, param=f"input[{i}].call_id", code="invalid_value")


def input_messages(req: ResponsesRequest) -> list[Message]:
    """`input` as chat messages: text parts joined, consecutive function calls one assistant message
    with `tool_calls`, call outputs `tool` messages, reasoning items left out."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[Message] = []
    for item in req.input:
        if isinstance(item, ResponseInputMessage):
            content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, ResponseFunctionCallInput):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, ResponseFunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not messages:
        raise APIError("input must contain at least one message", 400, param="input", code="invalid_value")
    return messages


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError("text.format of type json_schema needs schema (an object)", 400, param="text.format.schema",
                       code="invalid_value")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_}}


def chat_request(req: ResponsesRequest, conversation: list[Message], rid: str) -> ChatCompletionRequest:
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools or []]
    choice = req.tool_choice
    fields = {name: getattr(req, name) for name in _CHAT_FIELDS}
    fields.update({
        "messages": system + conversation,
        "max_tokens": req.max_output_tokens,
        "rid": rid,
        "response_format": _response_format(req),
        "tools": tools or None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}} if choice is not None and not isinstance(choice, str) else choice,
    })
    if wants_logprobs(req):
        fields.update({"logprobs": True, "top_logprobs": req.top_logprobs or 0})
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


def responses_param(error: APIError) -> APIError:
    """A chat path's tool error in the Responses API's names: tools[i].function.name -> tools[i].name."""
    if error.param is not None and error.param.startswith(("tools", "tool_choice")):
        error.param = error.param.replace(".function.", ".")
        error.message = error.message.replace(".function.", ".")
    return error
