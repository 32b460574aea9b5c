"""Split a streamed reply into content and tool-call events as the text arrives.

Text that cannot start a call goes out at once; text that may be the start of a call is held back
until it is one or cannot be one (then it is content). A call is announced (`CallStart`: its name)
and its argument text follows (`CallArguments`):
- `incremental=True` (forced calls, whose grammar guarantees a well-formed call of a declared
  function): the name as soon as `{"name": "...", "arguments": ` is complete, then the arguments
  object's text as it is decoded, up to its closing brace;
- otherwise (tool_choice "auto", where a started call may still turn out malformed and then is
  content): the whole call once its closing marker arrives.
Either way the concatenated argument text equals the non-streamed `arguments`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence, Union

from jaxserve.server.openai.tools.parsers import CALL_HEADER, PlainJsonParser, TaggedJsonParser, ToolCallParser
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


class ToolCallStreamer:
    """Feed text deltas with `feed`; call `finish` once the reply has ended. Both return events in order."""

    def __init__(self, parser: ToolCallParser, tools: Sequence[Tool], incremental: bool = False):
        self._parser = parser
        self._tools = tools
        self._known = {t.function.name for t in tools}
        self._incremental = incremental and isinstance(parser, TaggedJsonParser)
        self._buffer = ""
        self._in_call = False
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
            if not self._in_call:
                start = self._buffer.find(parser.start_marker)
                if start < 0:
                    cut = len(self._buffer) - _partial_marker_len(self._buffer, parser.start_marker)
                    _add_content(events, self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    return events
                _add_content(events, self._buffer[:start])
                self._buffer = self._buffer[start:]
                self._in_call = True
            if self._incremental:
                events += self._stream_arguments(parser)
            end = self._buffer.find(parser.end_marker)
            if end < 0:
                return events
            end += len(parser.end_marker)
            call_text, self._buffer = self._buffer[:end], self._buffer[end:]
            self._in_call = False
            if self._args_at is not None:  # already streamed
                self._args_at, self._sent, self._args_done, self._scanner = None, 0, False, _ObjectScanner()
                continue
            events += _events_of(parser.parse(call_text, self._tools))

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
