"""Split a streamed reply into content and tool-call events as the text arrives.

Text that cannot start a call goes out at once; text that may be the start of a call is held back
until it is one or cannot be one (then it is content). A call is announced (`CallStart`: its name)
and its argument text follows (`CallArguments`):
- `incremental=True` (forced calls, whose grammar guarantees a well-formed call of a declared
  function): the name as soon as `{"name": "...", "arguments": ` is complete, then the arguments
  object's text as it is decoded, up to its closing brace;
- otherwise (tool_choice "auto", where a started call may still turn out malformed and then is
  content): the whole call once its closing marker arrives.
Either way the concatenated argument text equals the non-streamed `arguments`. A call's end is found
by its structure, as `TaggedJsonParser.parse` finds it: the end marker counts only after the call's
JSON object has closed, so argument strings may hold the markers' text. (A call whose braces never
balance is held until the reply ends, then parsed whole.)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence, Union

from jaxserve.server.openai.tools.parsers import (
    CALL_HEADER,
    ParsedCall,
    ParseResult,
    PlainJsonParser,
    TaggedJsonParser,
    ToolCallParser,
)
from jaxserve.server.protocol import Tool


@dataclasses.dataclass(frozen=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True)
class CallStart:
    name: str


@dataclasses.dataclass(frozen=True)
class CallArguments:
    """More argument text of the call started last."""

    text: str


StreamEvent = Union[Content, CallStart, CallArguments]


class _ObjectScanner:
    """Finds where a JSON object ends, fed piece by piece (braces inside strings do not count)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """Index in `text` just past the object's closing brace, or None if it has not closed yet."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


NOT_A_CALL = -1  # what _CallScanner.feed returns for text that cannot be a call


class _CallScanner:
    """Reads a tagged call after its start marker by the format's structure, as
    `TaggedJsonParser.parse` does: whitespace, one JSON object (braces inside its strings do not
    count), whitespace, the end marker. Fed piece by piece."""

    def __init__(self, end_marker: str):
        self._end_marker = end_marker
        self._object = _ObjectScanner()
        self._opened = False
        self._fed = 0
        self._space = 0  # whitespace after the object
        self._tail = ""  # what came after that whitespace (at most the end marker's length)
        self.object_end: int | None = None  # offset (in the text fed) just past the object

    def feed(self, text: str) -> int | None:
        """The offset (in all the text fed) just past the end marker; None while undecided;
        NOT_A_CALL once the text cannot be a call's."""
        base, self._fed = self._fed, self._fed + len(text)
        at = 0
        if not self._opened:
            while at < len(text) and text[at].isspace():
                at += 1
            if at == len(text):
                return None
            if text[at] != "{":
                return NOT_A_CALL
            self._opened = True
        if self.object_end is None:
            closed = self._object.feed(text[at:])
            if closed is None:
                return None
            at += closed
            self.object_end = base + at
        rest = self._tail + text[at:]
        if not self._tail:
            stripped = rest.lstrip()
            self._space += len(rest) - len(stripped)
            rest = stripped
        self._tail = rest
        if rest.startswith(self._end_marker):
            return self.object_end + self._space + len(self._end_marker)
        return None if self._end_marker.startswith(rest) else NOT_A_CALL


class ToolCallStreamer:
    """Feed text deltas with `feed`; call `finish` once the reply has ended. Both return events in order."""

    def __init__(self, parser: ToolCallParser, tools: Sequence[Tool], incremental: bool = False):
        self._parser = parser
        self._tools = tools
        self._known = {t.function.name for t in tools}
        self._incremental = incremental and isinstance(parser, TaggedJsonParser)
        self._buffer = ""
        self._call: _CallScanner | None = None  # the call the buffer starts with (its start marker)
        self._call_fed = 0  # how much of the buffer the call scanner has read
        self._whole_reply: bool | None = None  # PlainJsonParser: does the reply look like JSON?
        # incremental call state: where its arguments start in the buffer, how far they were sent
        self._args_at: int | None = None
        self._sent: int = 0
        self._args_done = False
        self._scanner = _ObjectScanner()

    def feed(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        if isinstance(self._parser, TaggedJsonParser):
            return self._feed_tagged(self._parser)
        return self._feed_whole(self._parser)

    def finish(self) -> list[StreamEvent]:
        rest, self._buffer = self._buffer, ""
        if self._args_at is not None:  # a streamed call that never closed: nothing more to send
            return []
        if not rest:
            return []
        return _events_of(self._parser.parse(rest, self._tools))

    def _feed_tagged(self, parser: TaggedJsonParser) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while True:
            if self._call is None:
                start = self._buffer.find(parser.start_marker)
                if start < 0:
                    cut = len(self._buffer) - _partial_marker_len(self._buffer, parser.start_marker)
                    _add_content(events, self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    return events
                _add_content(events, self._buffer[:start])
                self._buffer = self._buffer[start:]
                self._call, self._call_fed = _CallScanner(parser.end_marker), len(parser.start_marker)
            if self._incremental:
                events += self._stream_arguments(parser)
            end = self._call.feed(self._buffer[self._call_fed :])
            self._call_fed = len(self._buffer)
            if end is None:
                return events
            marker_len = len(parser.start_marker)
            if self._args_at is not None:  # announced already: the call ends with its object, or its end marker
                self._buffer = self._buffer[marker_len + (self._call.object_end if end == NOT_A_CALL else end) :]
                self._args_at, self._sent, self._args_done, self._scanner = None, 0, False, _ObjectScanner()
                self._call = None
                continue
            parsed = None if end == NOT_A_CALL else parser.parse(self._buffer[: marker_len + end], self._tools)
            if parsed is None or not parsed.calls:
                # no call here: the marker is text, and the search goes on after it (as `parse` does)
                _add_content(events, self._buffer[:marker_len])
                self._buffer = self._buffer[marker_len:]
            else:
                events += _events_of(parsed)
                self._buffer = self._buffer[marker_len + end :]
            self._call = None

    def _stream_arguments(self, parser: TaggedJsonParser) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._args_at is None:
            offset = len(parser.start_marker)
            body = self._buffer[offset:]
            stripped = len(body) - len(body.lstrip())
            m = CALL_HEADER.match(body, stripped)
            if m is None or not body[m.end() :].startswith("{"):
                return events
            name = json.loads(f'"{m.group(1)}"')
            if name not in self._known:
                return events
            events.append(CallStart(name))
            self._args_at = self._sent = offset + m.end()
        if not self._args_done:
            closed = self._scanner.feed(self._buffer[self._sent :])
            upto = len(self._buffer) if closed is None else self._sent + closed
            self._args_done = closed is not None
            if upto > self._sent:
                events.append(CallArguments(self._buffer[self._sent : upto]))
                self._sent = upto
        return events

    def _feed_whole(self, parser: ToolCallParser) -> list[StreamEvent]:
        assert isinstance(parser, PlainJsonParser)
        if self._whole_reply is None:
            head = self._buffer.lstrip()
            if not head:
                return []
            tag = parser.python_tag
            if head.startswith(("{", "[")) or head.startswith(tag):
                self._whole_reply = True
            elif tag.startswith(head):
                return []  # maybe the tag: wait for more
            else:
                self._whole_reply = False
        if self._whole_reply:
            return []  # parsed in `finish`
        out, self._buffer = self._buffer, ""
        return [Content(out)] if out else []


def read_reply(parser: ToolCallParser, tools: Sequence[Tool], text: str, incremental: bool) -> ParseResult:
    """A whole reply read as a stream of it reads it (`ToolCallStreamer` fed `text` in one piece, then
    finished), so a reply reads the same streamed or not: with `incremental` (a forced call), a call
    cut short (max_tokens) is a call with the argument text decoded so far."""
    streamer = ToolCallStreamer(parser, tools, incremental)
    content, calls = "", []
    for event in streamer.feed(text) + streamer.finish():
        if isinstance(event, Content):
            content += event.text
        elif isinstance(event, CallStart):
            calls.append([event.name, ""])
        else:
            calls[-1][1] += event.text
    return ParseResult(content if content.strip() or not calls else None, tuple(ParsedCall(*c) for c in calls))


def _events_of(result) -> list[StreamEvent]:
    events: list[StreamEvent] = [Content(result.content)] if result.content else []
    for call in result.calls:
        events += [CallStart(call.name), CallArguments(call.arguments)]
    return events


def _add_content(events: list[StreamEvent], text: str) -> None:
    if text:
        events.append(Content(text))


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
