"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{response_id}.

A request is a chat: `instructions` (a system message), the conversation that `previous_response_id`
ended with, then `input`, run through the chat path (`openai_api.submit_chat`), so the chat template,
sampling, JSON output (`text.format`), --reasoning-parser and the 400s are the chat's (a 400 names the
Responses field: `input`, `max_output_tokens`, `text.format`).

The reply is a Response object (`object: "response"`): a "reasoning" output item when the reply reasons
(with --reasoning-parser), then one "message" item with one "output_text" part. `status` is
"completed"; "incomplete" with `incomplete_details.reason` "max_output_tokens" when the length limit
cut the reply; "failed" when the request was aborted (/abort_request). `usage` counts input, cached
and output tokens (reasoning tokens: the reasoning text re-tokenized).

A stream sends OpenAI's named events, each with a `sequence_number`: response.created,
response.in_progress, then per output item response.output_item.added, response.content_part.added,
its text deltas (response.reasoning_text.delta or response.output_text.delta), the matching .done
events, and last response.completed, response.incomplete or response.failed with the whole Response.
No `[DONE]` (OpenAI sends none on this API).

Stored responses (`store`, default true) are kept in memory, the newest `MAX_STORED_RESPONSES`, for
GET /v1/responses/{id} and for `previous_response_id`; an unknown id is a 404 naming it. Not served
(400 naming the field): function tools (use /v1/chat/completions), `background`, `include`.
"""

from __future__ import annotations

import collections
import itertools
import time
import uuid
from typing import Any, AsyncIterator

import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.engine import StepOutput
from jaxserve.server.errors import APIError, error_response, from_validation_error, parse_json_body
from jaxserve.server.engine_client import abort_on_disconnect
from jaxserve.server.field_types import check_field_types
from jaxserve.server.metrics import mark_streaming
from jaxserve.server.native_api import failure_of
from jaxserve.server.openai_api import ChatRun, submit_chat
from jaxserve.server.protocol import ChatCompletionRequest, ResponseInputMessage, ResponseInputReasoning, ResponsesRequest
from jaxserve.server.reasoning import ReasoningSplitter, split_reasoning
from jaxserve.server.sse import SSEResponse, sse_event

MAX_STORED_RESPONSES = 1024
# chat names -> Responses names, for the 400s the chat path raises
FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


class ResponseStore:
    """Stored responses by id, the newest `max_entries`: each with the conversation it ended (input
    messages, then the reply as an assistant message; instructions left out), which a later request's
    `previous_response_id` continues."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES):
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, tuple[dict[str, Any], list[dict[str, str]]]] = collections.OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, str]]) -> None:
        self._entries[response["id"]] = (response, conversation)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, str]]] | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


# ---- request -> chat ------------------------------------------------------------------------------
def check_input_items(body: dict[str, Any]) -> None:
    """Check each input item on its own, so that a 400 names it (the schema's validation of the union
    of item types would only name `input`): items other than messages and reasoning (function calls
    and their outputs, files, ...) and parts other than text are not served.

    Raises:
        APIError: 400 naming `input[i]` and the field in it.
    """
    items = body.get("input")
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind not in ("message", "reasoning"):
            raise APIError(f"input[{i}].type: {kind!r} items are not served (messages only; function calling is "
                           "served by /v1/chat/completions)", 400, param=f"input[{i}].type", code="unsupported_parameter")
        content = item.get("content")
        for j, part in enumerate(content if kind == "message" and isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") not in ("input_text", "output_text"):
                raise APIError(f"input[{i}].content[{j}].type: {part.get('type')!r} parts are not served (text only: "
                               "input_text, output_text)", 400, param=f"input[{i}].content[{j}].type",
                               code="unsupported_parameter")
        try:
            (ResponseInputMessage if kind == "message" else ResponseInputReasoning).model_validate(item)
        except pydantic.ValidationError as e:
            error = from_validation_error(e)
            error.param = f"input[{i}].{error.param}" if error.param else f"input[{i}]"
            error.message = f"input[{i}].{error.message}"
            raise error from None


def _check_supported(req: ResponsesRequest) -> None:
    if req.tools:
        raise APIError("function tools are not supported on /v1/responses; use /v1/chat/completions", 400,
                       param="tools", code="unsupported_parameter")
    if req.tool_choice not in (None, "auto", "none"):
        raise APIError("tool_choice needs tools, which /v1/responses does not serve", 400, param="tool_choice",
                       code="unsupported_parameter")
    if req.background:
        raise APIError("background responses are not supported", 400, param="background", code="unsupported_parameter")
    if req.include:
        raise APIError(f"include is not supported (got {req.include})", 400, param="include", code="unsupported_parameter")


def _input_messages(req: ResponsesRequest) -> list[dict[str, str]]:
    """`input` as chat messages (text parts joined; reasoning items left out)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages = []
    for item in req.input:
        if isinstance(item, ResponseInputMessage):
            content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": content})
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


def _chat_request(req: ResponsesRequest, conversation: list[dict[str, str]]) -> ChatCompletionRequest:
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    fields = {
        "messages": system + conversation,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty,
        "stop": req.stop,
        "seed": req.seed,
        "user": req.user,
        "rid": req.request_id,
        "response_format": _response_format(req),
    }
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


# ---- chat output -> Response ----------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _status(out: StepOutput) -> tuple[str, dict[str, str] | None, dict[str, str] | None]:
    """(status, incomplete_details, error) of a finished output."""
    reason = (out.meta.finish_reason or {}).get("type")
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if reason == "abort":
        return "failed", None, {"code": "server_error", "message": (out.meta.finish_reason or {}).get("message") or "the request was aborted"}
    return "completed", None, None


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


class _Reply:
    """What one request's Response object says, filled in as its output arrives."""

    def __init__(self, request: Request, req: ResponsesRequest):
        self.id = _new_id("resp")
        self.req = req
        self.model = request.app.state.model_name
        self.tokenizer = request.app.state.engine_loop.tokenizer
        self.created_at = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], out: StepOutput | None = None,
                 incomplete: dict[str, str] | None = None, error: dict[str, str] | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": error, "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": None, "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": [], "truncation": req.truncation,
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


# ---- routes ---------------------------------------------------------------------------------------
async def create_response(request: Request) -> Response:
    """POST /v1/responses."""
    body = parse_json_body(await request.body())
    check_field_types(body)
    check_input_items(body)
    req = ResponsesRequest.model_validate(body)
    _check_supported(req)
    store: ResponseStore = request.app.state.response_store
    history: list[dict[str, str]] = []
    if req.previous_response_id is not None:
        stored = store.get(req.previous_response_id)
        if stored is None:
            raise APIError(f"previous response with id {req.previous_response_id!r} not found", 404,
                           param="previous_response_id", code="not_found")
        history = stored[1]
    conversation = history + _input_messages(req)
    chat = _chat_request(req, conversation)
    run = await submit_chat(request, chat, FIELD_NAMES)
    reply = _Reply(request, req)
    if req.stream:
        mark_streaming(request, run.group.rids)
        return SSEResponse(_stream(run, reply, store, conversation))
    async with abort_on_disconnect(request, run.group):
        (out,) = await run.group.wait()
    if (failure := failure_of(out)) is not None:
        return error_response(failure[1], failure[0], code="engine_error")
    reasoning, text = ("", out.text) if run.reasoning is None else _split(run, out.text)
    status, incomplete, error = _status(out)
    item_status = "incomplete" if status != "completed" else "completed"
    output = ([_reasoning_item(_new_id("rs"), reasoning, item_status)] if reasoning else []) + [
        _message_item(_new_id("msg"), text, item_status)]
    response = reply.response(status, output, out, incomplete, error)
    if req.store:
        store.put(response, conversation + [{"role": "assistant", "content": text}])
    return JSONResponse(response)


def _split(run: ChatRun, text: str) -> tuple[str, str]:
    split = split_reasoning(run.reasoning, text)
    return split.reasoning, split.content


async def retrieve_response(request: Request) -> Response:
    """GET /v1/responses/{response_id}: a stored response; 404 naming response_id otherwise."""
    response_id = request.path_params["response_id"]
    stored = request.app.state.response_store.get(response_id)
    if stored is None:
        return error_response(f"response with id {response_id!r} not found", 404, param="response_id", code="not_found")
    return JSONResponse(stored[0])


async def delete_response(request: Request) -> Response:
    """DELETE /v1/responses/{response_id}: forget a stored response; 404 naming response_id if unknown."""
    response_id = request.path_params["response_id"]
    if not request.app.state.response_store.delete(response_id):
        return error_response(f"response with id {response_id!r} not found", 404, param="response_id", code="not_found")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


# ---- streaming ------------------------------------------------------------------------------------
class _ItemStream:
    """The output items of a stream, one open at a time: text of another kind (reasoning, message)
    closes the open item and opens the next. Each method returns the events to send, as
    (type, fields) pairs."""

    def __init__(self):
        self.items: list[dict[str, Any]] = []  # finished items, in output order
        self._kind: str | None = None
        self._id = ""
        self._text = ""

    def feed(self, kind: str, delta: str) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if kind != self._kind:
            events += self.close("completed")
            events += self._open(kind)
        if delta:
            self._text += delta
            events.append((f"response.{self._text_kind}.delta", {**self._where, "delta": delta}
                           | ({"logprobs": []} if kind == "message" else {})))
        return events

    def finish(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        """Close the open item; a reply with no message text still gets an (empty) message item."""
        events = [] if self.items and self.items[-1]["type"] == "message" or self._kind == "message" else self.feed("message", "")
        return events + self.close(status)

    @property
    def _text_kind(self) -> str:
        return "output_text" if self._kind == "message" else "reasoning_text"

    @property
    def _where(self) -> dict[str, Any]:
        return {"item_id": self._id, "output_index": len(self.items), "content_index": 0}

    def _item(self, text: str, status: str) -> dict[str, Any]:
        return (_message_item if self._kind == "message" else _reasoning_item)(self._id, text, status)

    def _open(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        self._kind, self._id, self._text = kind, _new_id("msg" if kind == "message" else "rs"), ""
        item = self._item("", "in_progress")
        part = item["content"][0]
        item["content"] = []
        return [("response.output_item.added", {"output_index": len(self.items), "item": item}),
                ("response.content_part.added", {**self._where, "part": part})]

    def close(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        if self._kind is None:
            return []
        item = self._item(self._text, status)
        done = {**self._where, "text": self._text} | ({"logprobs": []} if self._kind == "message" else {})
        events = [(f"response.{self._text_kind}.done", done),
                  ("response.content_part.done", {**self._where, "part": item["content"][0]}),
                  ("response.output_item.done", {"output_index": len(self.items), "item": item})]
        self.items.append(item)
        self._kind = None
        return events


async def _stream(run: ChatRun, reply: _Reply, store: ResponseStore, conversation: list[dict[str, str]]) -> AsyncIterator[str]:
    sequence = itertools.count()

    def event(event_type: str, fields: dict[str, Any]) -> str:
        return sse_event({"type": event_type, "sequence_number": next(sequence), **fields}, event=event_type)

    items = _ItemStream()
    splitter = ReasoningSplitter(run.reasoning, True) if run.reasoning is not None else None
    answer: list[str] = []
    try:
        started = reply.response("in_progress", [])
        yield event("response.created", {"response": started})
        yield event("response.in_progress", {"response": started})
        out = None
        async for out in run.group:
            if (failure := failure_of(out)) is not None:
                error = {"code": "engine_error", "message": failure[1]}
                for event_type, fields in items.finish("incomplete"):
                    yield event(event_type, fields)
                yield event("response.failed", {"response": reply.response("failed", items.items, out, error=error)})
                return
            if splitter is None:
                pieces = [("message", out.text_delta)]
            else:
                fed = splitter.feed(out.text_delta)
                pieces = [("reasoning", fed.reasoning), ("message", fed.content)]
                if out.finished:  # the text held back in case it began a tag
                    rest = splitter.finish()
                    pieces += [("reasoning", rest.reasoning), ("message", rest.content)]
            for kind, text in pieces:
                if text:
                    answer += [text] if kind == "message" else []
                    for event_type, fields in items.feed(kind, text):
                        yield event(event_type, fields)
        status, incomplete, error = _status(out)
        for event_type, fields in items.finish("completed" if status == "completed" else "incomplete"):
            yield event(event_type, fields)
        response = reply.response(status, items.items, out, incomplete, error)
        if reply.req.store:
            store.put(response, conversation + [{"role": "assistant", "content": "".join(answer)}])
        yield event({"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed"),
                    {"response": response})
    finally:
        run.group.abort()
