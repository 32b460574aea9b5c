"""/v1/responses' output items, from a chat reply: a "reasoning" item (with --reasoning-parser), a
"message" item with one "output_text" part when the reply has text (or nothing else), one
"function_call" item per call; whole (`output_items`) or as OpenAI's stream events (`ReplyStream`).
"""

from __future__ import annotations

import uuid
from typing import Any

from jaxserve.engine.outputs import StepOutput
from jaxserve.server.openai.chat_completions import ChatRun
from jaxserve.server.openai.logprobs import chat_token_logprobs
from jaxserve.server.openai.reasoning import ReasoningSplitter
from jaxserve.server.openai.responses.input import Message
from jaxserve.server.openai.tools.streaming import CallArguments, CallStart, Content, ToolCallStreamer
from jaxserve.server.protocol import (
    ResponseFunctionCallInput,
    ResponseFunctionCallOutput,
    ResponseInputMessage,
    ResponseInputReasoning,
    ResponsesRequest,
)

Event = tuple[str, dict[str, Any]]  # a stream event: (type, fields)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(out: StepOutput) -> tuple[str, dict[str, str] | None, dict[str, str] | None]:
    """(status, incomplete_details, error) of a finished output."""
    reason = out.meta.finish_reason
    if reason is not None and reason.kind == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if reason is not None and reason.kind == "abort":
        return "failed", None, {"code": "server_error", "message": reason.message or "the request was aborted"}
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


def reply_message(output: list[dict[str, Any]]) -> Message:
    """The reply as the assistant message a continuation's chat sees: its text, and its calls."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: Message = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as the API's item objects, in input order (what GET
    /v1/responses/{id}/input_items lists): a string is one user message; messages keep their parts
    (text parts as `input_text`, an assistant's as `output_text`), function calls, their outputs and
    reasoning items their fields. Each has the `id` the client sent with it, or a new one, and status
    "completed"."""
    if isinstance(req.input, str):
        return [{"type": "message", "id": new_id("msg"), "status": "completed", "role": "user",
                 "content": [{"type": "input_text", "text": req.input}]}]
    items = []
    for item in req.input:
        if isinstance(item, ResponseInputMessage):
            kind = "output_text" if item.role == "assistant" else "input_text"
            texts = [item.content] if isinstance(item.content, str) else [p.text for p in item.content]
            extra = {"annotations": []} if kind == "output_text" else {}
            items.append({"type": "message", "id": item.id or new_id("msg"), "status": "completed", "role": item.role,
                          "content": [{"type": kind, "text": text, **extra} for text in texts]})
        elif isinstance(item, ResponseFunctionCallInput):
            items.append({"type": "function_call", "id": item.id or new_id("fc"), "call_id": item.call_id,
                          "name": item.name, "arguments": item.arguments, "status": "completed"})
        elif isinstance(item, ResponseFunctionCallOutput):
            items.append({"type": "function_call_output", "id": item.id or new_id("fco"), "call_id": item.call_id,
                          "output": item.output, "status": "completed"})
        elif isinstance(item, ResponseInputReasoning):
            items.append({"type": "reasoning", "id": item.id or new_id("rs"), "summary": item.summary,
                          "status": "completed"})
    return items


def output_items(run: ChatRun, parallel_tool_calls: bool, text: str, status: str) -> list[dict[str, Any]]:
    """The output items of a whole reply `text`, the last one with `status`: those a stream of it
    would end with (`ReplyStream` over the text in one piece), so a reply reads the same streamed
    or not, a forced call cut by the length limit included (a function_call item with the
    arguments decoded so far)."""
    stream = ReplyStream(run, parallel_tool_calls)
    stream.feed(text, True)
    stream.items.finish(status)
    return stream.items.items


def attach_logprobs(output: list[dict[str, Any]], out: StepOutput, tokenizer: Any) -> None:
    """Give each message item's output_text part the logprobs of the tokens its text was decoded from
    (include "message.output_text.logprobs"). A reply of one message gets every output token's, as
    the chat's `logprobs.content` (a token cut by a stop string included); beside reasoning or calls,
    a part gets the tokens whose text starts inside its span of the reply text, and the last part,
    when it ends the reply, also those after it."""
    tokens = chat_token_logprobs(out, tokenizer)
    parts = [item["content"][0] for item in output if item["type"] == "message"]
    if len(parts) == 1 and len(output) == 1:
        parts[0]["logprobs"] = [t.model_dump() for t in tokens]
        return
    starts, at = [], 0
    for token in tokens:
        starts.append(at)
        at += len(token.token)
    cursor = 0
    for part in parts:
        begin = out.text.find(part["text"], cursor) if part["text"] else -1
        if begin < 0:
            continue
        cursor = begin + len(part["text"])
        end = max(at, cursor) if part is parts[-1] and output[-1]["type"] == "message" else cursor
        part["logprobs"] = [t.model_dump() for t, start in zip(tokens, starts) if begin <= start < end]


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
    def in_message(self) -> bool:
        return self._kind == "message"

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
        self._kind, self._id, self._name, self._text = kind, new_id(prefix), name, ""
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


class ReplyStream:
    """Turns a reply's text deltas into item events: the reasoning split off first (--reasoning-parser),
    then, with tools, the calls parsed out of the rest (`ToolCallStreamer`, as the chat stream does)."""

    def __init__(self, run: ChatRun, parallel_tool_calls: bool):
        self.items = _ItemStream()
        self._splitter = ReasoningSplitter(run.reasoning, True) if run.reasoning is not None else None
        self._calls = ToolCallStreamer(run.plan.parser, run.plan.tools, run.plan.grammar is not None) if run.plan.tools else None
        self._parallel = parallel_tool_calls
        self._num_calls = 0
        self._skipping = False  # parallel_tool_calls false: a second call is not sent
        self._held = ""  # whitespace outside a message: it joins one only if text follows

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
                events += self._content(piece.text)
            elif isinstance(piece, CallStart):
                self._skipping = not self._parallel and self._num_calls >= 1
                if not self._skipping:
                    self._num_calls += 1
                    events += self.items.call(piece.name)
            elif isinstance(piece, CallArguments) and not self._skipping:
                events += self.items.arguments(piece.text)
        if finished and self._held and not self._num_calls:  # a reply of whitespace alone is its text
            events += self.items.text("message", self._held)
        return events

    def _content(self, text: str) -> list[Event]:
        """Message text beside calls. Whitespace outside a message (around calls: a format's newlines)
        waits in `_held`, and is dropped if no text follows, as the parsed reply drops it."""
        if not self.items.in_message and not text.strip():
            self._held += text
            return []
        text, self._held = self._held + text, ""
        return self.items.text("message", text) if text else []
