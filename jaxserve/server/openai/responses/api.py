"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{response_id}, POST
/v1/responses/{response_id}/cancel, GET /v1/responses/{response_id}/input_items.

A request is a chat: `instructions` (a system message), the conversation that `previous_response_id`
ended with, then `input`, run through the chat path (`chat_completions.submit_chat`), so the chat template,
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
GET /v1/responses/{id}, for its input items (GET .../input_items) and for `previous_response_id`;
an unknown id is a 404 naming it.
`background` responses return at once ("queued") and run on (`BackgroundResponses`; polled with GET,
stopped with POST .../cancel or DELETE). `include` "message.output_text.logprobs" puts the chat's
token logprobs on the output_text parts. `truncation` "auto" drops the oldest messages of a
conversation over the context. Not served (400 naming the field): tools other than functions, other
`include` values, input parts other than text, background with stream.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import time
from typing import Any, AsyncIterator, NamedTuple

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from jaxserve.core.errors import RequestError
from jaxserve.core.size_limits import check_request_sizes
from jaxserve.engine.outputs import StepOutput
from jaxserve.server.engine_client import abort_on_disconnect, preprocess
from jaxserve.server.errors import APIError, error_response, parse_json_body
from jaxserve.server.metrics import mark_streaming
from jaxserve.server.native.generate import failure_of
from jaxserve.server.openai.chat_completions import ChatRun, chat_prompt_tokens, submit_chat
from jaxserve.server.openai.responses.input import (
    FIELD_NAMES,
    Message,
    chat_request,
    check_call_outputs,
    check_chat_only_fields,
    check_input_items,
    check_metadata,
    check_supported,
    input_messages,
    responses_param,
    wants_logprobs,
)
from jaxserve.server.openai.responses.output import (
    ReplyStream,
    attach_logprobs,
    input_items,
    new_id,
    output_items,
    reply_message,
    status_of,
)
from jaxserve.server.protocol import ResponsesRequest
from jaxserve.server.sse import SSEResponse, sse_event

logger = logging.getLogger(__name__)

MAX_STORED_RESPONSES = 1024
# most items a page of GET .../input_items returns (OpenAI's `limit` range)
MAX_LIST_LIMIT = 100
# statuses of a background response that has not finished
UNFINISHED = ("queued", "in_progress")
# the store's bound on the JSON size of what it keeps (responses echo tools and schemas of any size)
MAX_STORED_BYTES = 256 * 2**20


class StoredResponse(NamedTuple):
    """A stored response, the conversation it ended (chat messages: the input, then the reply as an
    assistant message with its tool calls; instructions left out) and its request's input items
    (`output.input_items`)."""

    response: dict[str, Any]
    conversation: list[Message]
    input_items: list[dict[str, Any]]


class ResponseStore:
    """Stored responses by id (`StoredResponse`), the newest `max_entries` within `max_bytes` of JSON.
    A later request's `previous_response_id` continues a stored conversation. A response larger than
    `max_bytes` on its own is not kept."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        # id -> (stored response, JSON size of its parts)
        self._entries: collections.OrderedDict[str, tuple[StoredResponse, int]] = collections.OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[Message], input_items: list[dict[str, Any]]) -> None:
        self.delete(response["id"])
        stored = StoredResponse(response, conversation, input_items)
        size = sum(len(json.dumps(part, ensure_ascii=False)) for part in stored)
        if size > self.max_bytes:
            return
        self._entries[response["id"]] = (stored, size)
        self.num_bytes += size
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            self.num_bytes -= self._entries.popitem(last=False)[1][1]

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        return None if entry is None else entry[0]

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry[1]
        return entry is not None


class _Reply:
    """What one request's Response object says."""

    def __init__(self, request: Request, req: ResponsesRequest):
        self.id = req.request_id or new_id("resp")  # SGLang's: the response id is the engine's request id
        self.req = req
        self.model = request.app.state.model_name
        self.tokenizer = request.app.state.engine_loop.engine.tokenizer
        self.created_at = int(time.time())
        self.input_items = input_items(req)

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
            "top_logprobs": req.top_logprobs,
            "usage": self.usage(out, output) if out is not None else None, "user": req.user,
            "metadata": req.metadata or {}, "background": req.background,
        }

    def usage(self, out: StepOutput, output: list[dict[str, Any]]) -> dict[str, Any]:
        meta = out.meta
        reasoning = "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])
        reasoning_tokens = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {"input_tokens": meta.prompt_tokens, "input_tokens_details": {"cached_tokens": meta.cached_tokens},
                "output_tokens": meta.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, meta.completion_tokens)},
                "total_tokens": meta.prompt_tokens + meta.completion_tokens}


async def _instructions_alone_too_long(request: Request, req: ResponsesRequest, limit: int) -> bool:
    """Whether `instructions` by themselves leave no room for a reply: `limit` tokens or more (then a
    context error names them, not `input`; truncation cannot help)."""
    if not req.instructions:
        return False
    try:
        ids = await preprocess(request, lambda: request.app.state.engine_loop.engine.checker.tokenize(req.instructions, False))
    except RequestError:  # refused by its length in characters before it is tokenized
        return True
    return len(ids) >= limit


async def _submit(request: Request, req: ResponsesRequest, conversation: list[Message], rid: str) -> ChatRun:
    """Submit the conversation as a chat. With `truncation` "auto", a conversation longer than the
    context (or than the KV pool holds for one request) drops its oldest messages until it fits, as
    OpenAI's API does (a tool message left at the front without the call it answers goes too); the
    last message is always kept. The stored
    conversation stays whole. The first start that fits is found by a binary search over prompt
    lengths (each a render and a tokenization of what is left: O(n log n) for n messages, where
    trying each start in turn was O(n^2)).

    Raises:
        APIError: 400 in the Responses API's names (`instructions` when they alone fill the context,
            `input` when even the last message does not fit).
        ClientDisconnect: the client left while the search ran.
    """
    engine_loop = request.app.state.engine_loop
    context, limit = engine_loop.engine.limits.context_length, engine_loop.engine.limits.max_prompt_tokens  # a prompt has fewer than limit tokens
    try:
        return await submit_chat(request, chat_request(req, conversation, rid), FIELD_NAMES)
    except APIError as e:
        if e.code == "context_length_exceeded" and await _instructions_alone_too_long(request, req, limit):
            raise APIError(f"instructions alone leave no room: a prompt must have fewer than {limit} tokens", 400,
                           param="instructions", code="context_length_exceeded") from None
        if req.truncation != "auto" or e.code != "context_length_exceeded" or len(conversation) == 1:
            raise responses_param(e) from None

    def kept(start: int) -> list[Message]:
        while start < len(conversation) - 1 and conversation[start]["role"] == "tool":
            start += 1
        return conversation[start:]

    async def fits(start: int) -> bool:
        if await request.is_disconnected():
            raise ClientDisconnect()
        try:
            tokens = await chat_prompt_tokens(request, chat_request(req, kept(start), rid))
        except APIError as e:  # a prompt refused before it is tokenized, by its length in characters
            if e.code == "context_length_exceeded":
                return False
            raise
        max_out = req.max_output_tokens  # a wrong type: the chat path's one check names it
        return tokens < limit and (not isinstance(max_out, int) or tokens + max_out <= context)

    low, high = 1, len(conversation) - 1  # the first start that fits, or the last message alone
    try:
        while low < high:
            mid = (low + high) // 2
            if await fits(mid):
                high = mid
            else:
                low = mid + 1
        return await submit_chat(request, chat_request(req, kept(low), rid), FIELD_NAMES)
    except APIError as e:
        raise responses_param(e) from None


# ---- routes ---------------------------------------------------------------------------------------
async def create_response(request: Request) -> Response:
    """POST /v1/responses."""
    body = parse_json_body(await request.body())
    check_chat_only_fields(body)
    check_request_sizes(body, "request_id")
    check_input_items(body)
    check_metadata(body.get("metadata"))
    req = ResponsesRequest.model_validate(body)
    check_supported(req)
    store: ResponseStore = request.app.state.response_store
    history: list[Message] = []
    if req.previous_response_id is not None:
        stored = store.get(req.previous_response_id)
        if stored is None:
            raise APIError(f"previous response with id {req.previous_response_id!r} not found", 404,
                           param="previous_response_id", code="not_found")
        if stored.response["status"] in UNFINISHED:
            raise APIError(f"previous response {req.previous_response_id!r} is still {stored.response['status']}", 400,
                           param="previous_response_id", code="invalid_value")
        history = stored.conversation
    check_call_outputs(history, req)
    conversation = history + input_messages(req)
    reply = _Reply(request, req)
    run = await _submit(request, req, conversation, reply.id)
    if req.stream:
        mark_streaming(request, run.group.rids)
        return SSEResponse(_stream(run, reply, store, conversation))
    if req.background:
        queued = reply.response("queued", [])
        store.put(queued, conversation, reply.input_items)
        request.app.state.background_responses.start(reply, run, conversation)
        return JSONResponse(queued)
    async with abort_on_disconnect(request, run.group):
        (out,) = await run.group.wait()
    if (failure := failure_of(out)) is not None:
        return error_response(failure[1], failure[0], code="engine_error")
    return JSONResponse(_finished_response(run, reply, store, conversation, out))


def _finished_response(run: ChatRun, reply: _Reply, store: ResponseStore, conversation: list[Message], out: StepOutput) -> dict[str, Any]:
    """The Response of a finished reply `out`, stored with its conversation when `store` is set."""
    status, incomplete, error = status_of(out)
    output = output_items(run, reply.req.parallel_tool_calls, out.text, "completed" if status == "completed" else "incomplete")
    if wants_logprobs(reply.req):
        attach_logprobs(output, out, reply.tokenizer)
    response = reply.response(status, output, out, incomplete, error)
    if reply.req.store:
        store.put(response, conversation + [reply_message(output)], reply.input_items)
    return response


async def _run_background(run: ChatRun, reply: _Reply, store: ResponseStore, conversation: list[Message]) -> None:
    """A background response's run: "in_progress" once the engine starts it, then the finished
    response (an engine failure as status "failed"). Not tied to the HTTP client that created it;
    `BackgroundResponses` records a cancelled or crashed run."""
    out, started = None, False
    async for out in run.group:
        if not started:
            started = True
            store.put(reply.response("in_progress", []), conversation, reply.input_items)
    if (failure := failure_of(out)) is not None:
        error = {"code": "engine_error", "message": failure[1]}
        store.put(reply.response("failed", [], out, error=error), conversation, reply.input_items)
        return
    _finished_response(run, reply, store, conversation, out)


class BackgroundResponses:
    """The runs of unfinished background responses, by response id (the app's
    `state.background_responses`). However a run ends, its engine request is aborted if it still
    runs, and a response it left unfinished in the store is recorded as "cancelled" (the task was
    cancelled, even before its first step) or "failed" (it raised; logged)."""

    def __init__(self, store: ResponseStore):
        self.store = store
        self._tasks: dict[str, asyncio.Task] = {}

    def start(self, reply: _Reply, run: ChatRun, conversation: list[Message]) -> None:
        """Run the submitted `run` to its end in a task of the running event loop (`_run_background`)."""
        task = asyncio.get_running_loop().create_task(_run_background(run, reply, self.store, conversation))
        self._tasks[reply.id] = task
        task.add_done_callback(lambda t: self._ended(t, reply, run, conversation))

    def _ended(self, task: asyncio.Task, reply: _Reply, run: ChatRun, conversation: list[Message]) -> None:
        self._tasks.pop(reply.id, None)
        run.group.abort()
        found = self.store.get(reply.id)  # None: evicted while it ran (DELETE cancels before it forgets)
        if found is not None and found.response["status"] not in UNFINISHED:
            return
        if task.cancelled():
            self.store.put(reply.response("cancelled", []), conversation, reply.input_items)
            return
        logger.error("background response %s failed", reply.id, exc_info=task.exception())
        error = {"code": "server_error", "message": f"the response failed: {task.exception()!r}"}
        self.store.put(reply.response("failed", [], error=error), conversation, reply.input_items)

    async def cancel(self, response_id: str) -> bool:
        """Cancel the response's run and wait until it has ended (`_ended` has recorded it); False when
        none is running."""
        task = self._tasks.get(response_id)
        if task is None:
            return False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True


async def stored_response(request: Request) -> Response:
    """GET /v1/responses/{response_id}: a stored response; DELETE: forget it. An unknown id: 404 naming
    response_id."""
    response_id = request.path_params["response_id"]
    store: ResponseStore = request.app.state.response_store
    if request.method == "DELETE":
        await request.app.state.background_responses.cancel(response_id)
    found = store.delete(response_id) if request.method == "DELETE" else store.get(response_id)
    if not found:
        return error_response(f"response with id {response_id!r} not found", 404, param="response_id", code="not_found")
    if request.method == "DELETE":
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
    return JSONResponse(found.response)


async def list_input_items(request: Request) -> Response:
    """GET /v1/responses/{response_id}/input_items: the input items of a stored response's request
    (`output.input_items`), a page of OpenAI's cursor list: `order` "desc" (the default,
    last item first) or "asc", `limit` 1-100 (default 20), `after` an item id (the page starts past it).
    `include` is accepted and changes nothing (no input item served here has a field it adds).

    Errors: an unknown response id, 404 naming response_id; a bad `limit`, `order` or `after`, 400
    naming it."""
    response_id = request.path_params["response_id"]
    found = request.app.state.response_store.get(response_id)
    if found is None:
        return error_response(f"response with id {response_id!r} not found", 404, param="response_id", code="not_found")
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        return error_response(f"order must be 'asc' or 'desc', got {order!r}", 400, param="order", code="invalid_value")
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIST_LIMIT:
        return error_response(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got {limit!r}", 400, param="limit",
                              code="invalid_value")
    items = found.input_items if order == "asc" else found.input_items[::-1]
    start = 0
    if "after" in query:
        ids = [item["id"] for item in items]
        if query["after"] not in ids:
            return error_response(f"after: no input item {query['after']!r} in response {response_id!r}", 400,
                                  param="after", code="invalid_value")
        start = ids.index(query["after"]) + 1
    page = items[start : start + int(limit)]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < len(items)})


async def cancel_response(request: Request) -> Response:
    """POST /v1/responses/{response_id}/cancel: stop a background response (its engine request is
    aborted) and return it, status "cancelled"; a finished one is returned as it is. An unknown id:
    404 naming response_id; a response not created with `background`: 400."""
    response_id = request.path_params["response_id"]
    cancelled = await request.app.state.background_responses.cancel(response_id)
    found = request.app.state.response_store.get(response_id)
    if found is None:
        return error_response(f"response with id {response_id!r} not found", 404, param="response_id", code="not_found")
    if not cancelled and not found.response["background"]:
        return error_response("only background responses can be cancelled", 400, param="response_id", code="invalid_value")
    return JSONResponse(found.response)


# ---- streaming ------------------------------------------------------------------------------------
async def _stream(run: ChatRun, reply: _Reply, store: ResponseStore, conversation: list[Message]) -> AsyncIterator[str]:
    sequence = itertools.count()

    def event(event_type: str, fields: dict[str, Any]) -> str:
        return sse_event({"type": event_type, "sequence_number": next(sequence), **fields}, event=event_type)

    stream = ReplyStream(run, reply.req.parallel_tool_calls)
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
        status, incomplete, error = status_of(out)
        for event_type, fields in stream.items.finish("completed" if status == "completed" else "incomplete"):
            yield event(event_type, fields)
        response = reply.response(status, stream.items.items, out, incomplete, error)
        if reply.req.store:
            store.put(response, conversation + [reply_message(stream.items.items)], reply.input_items)
        yield event({"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed"),
                    {"response": response})
    finally:
        run.group.abort()
