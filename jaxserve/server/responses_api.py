"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{response_id}.

A request is a chat: `instructions` (a system message), the conversation that `previous_response_id`
ended with, then `input`, run through the chat path (`openai_api.submit_chat`), so the chat template,
sampling, JSON output (`text.format`), function tools (`--tool-call-parser`), --reasoning-parser and
the 400s are the chat's (a 400 names the Responses field: `input`, `max_output_tokens`, `text.format`,
`tools[i].name`). Input items map onto chat messages: messages as they are (text parts joined),
function_call items onto an assistant message's `tool_calls`, function_call_output items onto `tool`
messages; reasoning items are left out, as chat templates leave out earlier reasoning.

The reply is a Response object (`object: "response"`): a "reasoning" output item when the reply
reasons (with --reasoning-parser), a "message" item with one "output_text" part when it has text
(or nothing else), then one "function_call" item per call. `status` is "completed"; "incomplete"
with `incomplete_details.reason` "max_output_tokens" when the length limit cut the reply; "failed"
when the request was aborted (/abort_request). `usage` counts input, cached and output tokens
(reasoning tokens: the reasoning text re-tokenized).

A stream sends OpenAI's named events, each with a `sequence_number`: response.created,
response.in_progress, then per output item response.output_item.added, for text items
response.content_part.added, the deltas (response.reasoning_text.delta, response.output_text.delta
or response.function_call_arguments.delta) and the matching .done events, response.output_item.done,
and last response.completed, response.incomplete or response.failed with the whole Response. No
`[DONE]` (OpenAI sends none on this API).

Stored responses (`store`, default true) are kept in memory, the newest `MAX_STORED_RESPONSES`, for
GET /v1/responses/{id} and for `previous_response_id`; an unknown id is a 404 naming it. Not served
(400 naming the field): tools other than functions, `background`, `include`, input parts other than
text.
"""

from __future__ import annotations

import collections
import itertools
import json
import time
import uuid
from typing import Any, AsyncIterator

import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.engine import StepOutput
from jaxserve.server.engine_client import abort_on_disconnect
from jaxserve.server.errors import APIError, error_response, from_validation_error, parse_json_body
from jaxserve.server.field_types import SAMPLING_FIELD_TYPES, check_field_types, describe
from jaxserve.server.function_call.parsers import ParsedCall
from jaxserve.server.function_call.streaming import CallArguments, CallStart, Content, ToolCallStreamer
from jaxserve.server.metrics import mark_streaming
from jaxserve.server.native_api import failure_of
from jaxserve.server.openai_api import ChatRun, submit_chat
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    ResponseFunctionCallInput,
    ResponseFunctionCallOutput,
    ResponseInputMessage,
    ResponseInputReasoning,
    ResponseInputText,
    ResponsesRequest,
)
from jaxserve.server.reasoning import ReasoningSplitter, split_reasoning
from jaxserve.server.sse import SSEResponse, sse_event

MAX_STORED_RESPONSES = 1024
# chat names -> Responses names, for the 400s the chat path raises
# (a response_format error is the schema's: `_response_format` checks the rest)
FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format.schema",
               "rid": "request_id"}
# the sampling fields' JSON types under this API's names (field_types: the same wording as the other routes)
FIELD_TYPES = {name: t for name, t in SAMPLING_FIELD_TYPES.items()
               if name in ResponsesRequest.model_fields and name != "input"} | {"max_output_tokens": SAMPLING_FIELD_TYPES["max_tokens"]}
# chat fields a user of this API may send by mistake: refused with the name to use (others are ignored)
CHAT_ONLY_FIELDS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
                    "response_format": "text.format"}
# OpenAI's limits on metadata (the store keeps it)
METADATA_MAX_PAIRS, METADATA_MAX_KEY_CHARS, METADATA_MAX_VALUE_CHARS = 16, 64, 512
# the store's bound on the JSON size of what it keeps (responses echo tools and schemas of any size)
MAX_STORED_BYTES = 256 * 2**20
# fields a chat request takes under the same name and meaning
_CHAT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                "stop", "seed", "user", "parallel_tool_calls")
_INPUT_ITEMS = {"message": ResponseInputMessage, "reasoning": ResponseInputReasoning,
                "function_call": ResponseFunctionCallInput, "function_call_output": ResponseFunctionCallOutput}

Message = dict[str, Any]  # a chat message, as /v1/chat/completions takes it


class ResponseStore:
    """Stored responses by id, the newest `max_entries` within `max_bytes` of JSON: each with the
    conversation it ended (chat messages: the input, then the reply as an assistant message with its
    tool calls; instructions left out), which a later request's `previous_response_id` continues. A
    response larger than `max_bytes` on its own is not kept."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        # id -> (response, conversation, JSON size of both)
        self._entries: collections.OrderedDict[str, tuple[dict[str, Any], list[Message], int]] = collections.OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[Message]) -> None:
        self.delete(response["id"])
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        if size > self.max_bytes:
            return
        self._entries[response["id"]] = (response, conversation, size)
        self.num_bytes += size
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            self.num_bytes -= self._entries.popitem(last=False)[1][2]

    def get(self, response_id: str) -> tuple[dict[str, Any], list[Message]] | None:
        entry = self._entries.get(response_id)
        return None if entry is None else entry[:2]

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry[2]
        return entry is not None


# ---- request -> chat ------------------------------------------------------------------------------
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


def _check_supported(req: ResponsesRequest) -> None:
    if req.background:
        raise APIError("background responses are not supported", 400, param="background", code="unsupported_parameter")
    if req.include:
        raise APIError(f"include is not supported (got {req.include})", 400, param="include", code="unsupported_parameter")


def _input_messages(req: ResponsesRequest) -> list[Message]:
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


def _chat_request(req: ResponsesRequest, conversation: list[Message], rid: str) -> ChatCompletionRequest:
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
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


def _responses_param(error: APIError) -> APIError:
    """A chat path's tool error in the Responses API's names: tools[i].function.name -> tools[i].name."""
    if error.param is not None and error.param.startswith(("tools", "tool_choice")):
        error.param = error.param.replace(".function.", ".")
        error.message = error.message.replace(".function.", ".")
    return error


# ---- chat output -> Response ----------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _status(out: StepOutput) -> tuple[str, dict[str, str] | None, dict[str, str] | None]:
    """(status, incomplete_details, error) of a finished output."""
    reason = out.meta.finish_reason or {}
    if reason.get("type") == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if reason.get("type") == "abort":
        return "failed", None, {"code": "server_error", "message": reason.get("message") or "the request was aborted"}
    return "completed", None, None


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": "call_" + item_id.partition("_")[2][:24],
            "name": name, "arguments": arguments, "status": status}


def _reply_message(output: list[dict[str, Any]]) -> Message:
    """The reply as the assistant message a continuation's chat sees: its text, and its calls."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: Message = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


class _Reply:
    """What one request's Response object says."""

    def __init__(self, request: Request, req: ResponsesRequest):
        self.id = req.request_id or _new_id("resp")  # SGLang's: the response id is the engine's request id
        self.req = req
        self.model = request.app.state.model_name
        self.tokenizer = request.app.state.engine_loop.tokenizer
        self.created_at = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], out: StepOutput | None = None,
                 incomplete: dict[str, str] | None = None, error: dict[str, str] | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        choice = req.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": error, "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": None, "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in req.tools or []], "truncation": req.truncation,
            "usage": self.usage(out, output) if out is not None else None, "user": req.user,
            "metadata": req.metadata or {}, "background": False,
        }

    def usage(self, out: StepOutput, output: list[dict[str, Any]]) -> dict[str, Any]:
        meta = out.meta
        reasoning = "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])
        reasoning_tokens = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {"input_tokens": meta.prompt_tokens, "input_tokens_details": {"cached_tokens": meta.cached_tokens},
                "output_tokens": meta.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, meta.completion_tokens)},
                "total_tokens": meta.prompt_tokens + meta.completion_tokens}


def _output_items(run: ChatRun, parallel_tool_calls: bool, text: str, status: str) -> list[dict[str, Any]]:
    """The output items of a whole reply `text`: reasoning, message text, function calls."""
    reasoning = ""
    if run.reasoning is not None:
        split = split_reasoning(run.reasoning, text)
        reasoning, text = split.reasoning, split.content
    calls: tuple[ParsedCall, ...] = ()
    if run.plan.tools:
        parsed = run.plan.parser.parse(text, run.plan.tools)
        text, calls = parsed.content or "", parsed.calls if parallel_tool_calls else parsed.calls[:1]
    items = [_reasoning_item(_new_id("rs"), reasoning, status)] if reasoning else []
    if text or not calls:
        items.append(_message_item(_new_id("msg"), text, status))
    return items + [_call_item(_new_id("fc"), c.name, c.arguments, status) for c in calls]


# ---- routes ---------------------------------------------------------------------------------------
async def create_response(request: Request) -> Response:
    """POST /v1/responses."""
    body = parse_json_body(await request.body())
    check_chat_only_fields(body)
    check_field_types(body, FIELD_TYPES)
    check_input_items(body)
    check_metadata(body.get("metadata"))
    req = ResponsesRequest.model_validate(body)
    _check_supported(req)
    store: ResponseStore = request.app.state.response_store
    history: list[Message] = []
    if req.previous_response_id is not None:
        stored = store.get(req.previous_response_id)
        if stored is None:
            raise APIError(f"previous response with id {req.previous_response_id!r} not found", 404,
                           param="previous_response_id", code="not_found")
        history = stored[1]
    conversation = history + _input_messages(req)
    reply = _Reply(request, req)
    try:
        run = await submit_chat(request, _chat_request(req, conversation, reply.id), FIELD_NAMES)
    except APIError as e:
        raise _responses_param(e) from None
    if req.stream:
        mark_streaming(request, run.group.rids)
        return SSEResponse(_stream(run, reply, store, conversation))
    async with abort_on_disconnect(request, run.group):
        (out,) = await run.group.wait()
    if (failure := failure_of(out)) is not None:
        return error_response(failure[1], failure[0], code="engine_error")
    status, incomplete, error = _status(out)
    output = _output_items(run, req.parallel_tool_calls, out.text, "completed" if status == "completed" else "incomplete")
    response = reply.response(status, output, out, incomplete, error)
    if req.store:
        store.put(response, conversation + [_reply_message(output)])
    return JSONResponse(response)


async def stored_response(request: Request) -> Response:
    """GET /v1/responses/{response_id}: a stored response; DELETE: forget it. An unknown id: 404 naming
    response_id."""
    response_id = request.path_params["response_id"]
    store: ResponseStore = request.app.state.response_store
    found = store.delete(response_id) if request.method == "DELETE" else store.get(response_id)
    if not found:
        return error_response(f"response with id {response_id!r} not found", 404, param="response_id", code="not_found")
    if request.method == "DELETE":
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
    return JSONResponse(found[0])


# ---- streaming ------------------------------------------------------------------------------------
Event = tuple[str, dict[str, Any]]  # (type, fields)


class _ItemStream:
    """The output items of a stream, one open at a time; text of another kind, or a new call, closes
    the open item and opens the next. Each method returns the events to send."""

    def __init__(self):
        self.items: list[dict[str, Any]] = []  # finished items, in output order
        self._kind: str | None = None  # of the open item: "reasoning", "message" or "function_call"
        self._id = ""
        self._name = ""  # of the open function call
        self._text = ""

    def text(self, kind: str, delta: str) -> list[Event]:
        """More reasoning or message text."""
        events = [] if kind == self._kind else self.close("completed") + self._open(kind)
        return events + self._delta(delta)

    def call(self, name: str) -> list[Event]:
        """A new function call; its arguments follow through `arguments`."""
        return self.close("completed") + self._open("function_call", name)

    def arguments(self, delta: str) -> list[Event]:
        return self._delta(delta)

    def finish(self, status: str) -> list[Event]:
        """Close the open item; a reply of no text and no call still gets an (empty) message item."""
        kinds = {item["type"] for item in self.items} | {self._kind}
        events = [] if kinds & {"message", "function_call"} else self.text("message", "")
        return events + self.close(status)

    def _delta(self, delta: str) -> list[Event]:
        if not delta:
            return []
        self._text += delta
        if self._kind == "function_call":
            return [("response.function_call_arguments.delta", {**self._where(), "delta": delta})]
        extra = {"logprobs": []} if self._kind == "message" else {}
        return [(f"response.{self._text_kind}.delta", {**self._where(content=True), "delta": delta, **extra})]

    @property
    def _text_kind(self) -> str:
        return "output_text" if self._kind == "message" else "reasoning_text"

    def _where(self, content: bool = False) -> dict[str, Any]:
        return {"item_id": self._id, "output_index": len(self.items), **({"content_index": 0} if content else {})}

    def _item(self, status: str) -> dict[str, Any]:
        if self._kind == "function_call":
            return _call_item(self._id, self._name, self._text, status)
        return (_message_item if self._kind == "message" else _reasoning_item)(self._id, self._text, status)

    def _open(self, kind: str, name: str = "") -> list[Event]:
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        self._kind, self._id, self._name, self._text = kind, _new_id(prefix), name, ""
        item = self._item("in_progress")
        if kind == "function_call":
            return [("response.output_item.added", {"output_index": len(self.items), "item": item})]
        part, item["content"] = item["content"][0], []
        return [("response.output_item.added", {"output_index": len(self.items), "item": item}),
                ("response.content_part.added", {**self._where(content=True), "part": part})]

    def close(self, status: str) -> list[Event]:
        if self._kind is None:
            return []
        item = self._item(status)
        if self._kind == "function_call":
            events = [("response.function_call_arguments.done", {**self._where(), "name": self._name, "arguments": self._text})]
        else:
            extra = {"logprobs": []} if self._kind == "message" else {}
            events = [(f"response.{self._text_kind}.done", {**self._where(content=True), "text": self._text, **extra}),
                      ("response.content_part.done", {**self._where(content=True), "part": item["content"][0]})]
        events.append(("response.output_item.done", {"output_index": len(self.items), "item": item}))
        self.items.append(item)
        self._kind = None
        return events


class _ReplyStream:
    """Turns a reply's text deltas into item events: the reasoning split off first (--reasoning-parser),
    then, with tools, the calls parsed out of the rest (`ToolCallStreamer`, as the chat stream does)."""

    def __init__(self, run: ChatRun, parallel_tool_calls: bool):
        self.items = _ItemStream()
        self._splitter = ReasoningSplitter(run.reasoning, True) if run.reasoning is not None else None
        self._calls = ToolCallStreamer(run.plan.parser, run.plan.tools, run.plan.grammar is not None) if run.plan.tools else None
        self._parallel = parallel_tool_calls
        self._num_calls = 0
        self._skipping = False  # parallel_tool_calls false: a second call is not sent

    def feed(self, delta: str, finished: bool) -> list[Event]:
        if self._splitter is None:
            return self._answer(delta, finished)
        split = self._splitter.feed(delta)
        events = self.items.text("reasoning", split.reasoning) if split.reasoning else []
        events += self._answer(split.content, False)
        if finished:  # the text held back in case it began a tag
            rest = self._splitter.finish()
            events += self.items.text("reasoning", rest.reasoning) if rest.reasoning else []
            events += self._answer(rest.content, True)
        return events

    def _answer(self, text: str, finished: bool) -> list[Event]:
        if self._calls is None:
            return self.items.text("message", text) if text else []
        events: list[Event] = []
        for piece in self._calls.feed(text) + (self._calls.finish() if finished else []):
            if isinstance(piece, Content):
                events += self.items.text("message", piece.text) if piece.text else []
            elif isinstance(piece, CallStart):
                self._skipping = not self._parallel and self._num_calls >= 1
                if not self._skipping:
                    self._num_calls += 1
                    events += self.items.call(piece.name)
            elif isinstance(piece, CallArguments) and not self._skipping:
                events += self.items.arguments(piece.text)
        return events


async def _stream(run: ChatRun, reply: _Reply, store: ResponseStore, conversation: list[Message]) -> AsyncIterator[str]:
    sequence = itertools.count()

    def event(event_type: str, fields: dict[str, Any]) -> str:
        return sse_event({"type": event_type, "sequence_number": next(sequence), **fields}, event=event_type)

    stream = _ReplyStream(run, reply.req.parallel_tool_calls)
    try:
        started = reply.response("in_progress", [])
        yield event("response.created", {"response": started})
        yield event("response.in_progress", {"response": started})
        out = None
        async for out in run.group:
            if (failure := failure_of(out)) is not None:
                for event_type, fields in stream.items.finish("incomplete"):
                    yield event(event_type, fields)
                error = {"code": "engine_error", "message": failure[1]}
                yield event("response.failed", {"response": reply.response("failed", stream.items.items, out, error=error)})
                return
            for event_type, fields in stream.feed(out.text_delta, out.finished):
                yield event(event_type, fields)
        status, incomplete, error = _status(out)
        for event_type, fields in stream.items.finish("completed" if status == "completed" else "incomplete"):
            yield event(event_type, fields)
        response = reply.response(status, stream.items.items, out, incomplete, error)
        if reply.req.store:
            store.put(response, conversation + [_reply_message(stream.items.items)])
        yield event({"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed"),
                    {"response": response})
    finally:
        run.group.abort()
