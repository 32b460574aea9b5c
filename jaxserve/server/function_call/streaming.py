"""Split a streamed reply into content deltas and whole tool calls as the text arrives.

Text that cannot start a call goes out at once; text that may be the start of a call is held back
until it is one (then the call is emitted when its closing marker arrives) or cannot be one (then it is
content). A call is sent as soon as it is complete, so its argument text arrives in one fragment.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxserve.server.function_call.parsers import ParsedCall, PlainJsonParser, TaggedJsonParser, ToolCallParser
from jaxserve.server.protocol import Tool


@dataclasses.dataclass
class StreamPiece:
    """What one chunk of model text released: content text (possibly empty) and completed calls."""

    content: str = ""
    calls: list[ParsedCall] = dataclasses.field(default_factory=list)


class ToolCallStreamer:
    """Feed text deltas with `feed`; call `finish` once the reply has ended."""

    def __init__(self, parser: ToolCallParser, tools: Sequence[Tool]):
        self._parser = parser
        self._tools = tools
        self._buffer = ""
        self._in_call = False
        self._whole_reply: bool | None = None  # PlainJsonParser: does the reply look like JSON?

    def feed(self, text: str) -> StreamPiece:
        self._buffer += text
        if isinstance(self._parser, TaggedJsonParser):
            return self._feed_tagged(self._parser)
        return self._feed_whole(self._parser)

    def finish(self) -> StreamPiece:
        rest, self._buffer = self._buffer, ""
        if not rest:
            return StreamPiece()
        result = self._parser.parse(rest, self._tools)
        return StreamPiece(result.content or "", list(result.calls))

    def _feed_tagged(self, parser: TaggedJsonParser) -> StreamPiece:
        piece = StreamPiece()
        while True:
            if not self._in_call:
                start = self._buffer.find(parser.start_marker)
                if start < 0:
                    keep = _partial_marker_len(self._buffer, parser.start_marker)
                    cut = len(self._buffer) - keep
                    piece.content += self._buffer[:cut]
                    self._buffer = self._buffer[cut:]
                    return piece
                piece.content += self._buffer[:start]
                self._buffer = self._buffer[start:]
                self._in_call = True
            end = self._buffer.find(parser.end_marker)
            if end < 0:
                return piece
            end += len(parser.end_marker)
            call_text, self._buffer = self._buffer[:end], self._buffer[end:]
            self._in_call = False
            result = parser.parse(call_text, self._tools)
            piece.calls += result.calls
            piece.content += result.content or ""

    def _feed_whole(self, parser: ToolCallParser) -> StreamPiece:
        assert isinstance(parser, PlainJsonParser)
        if self._whole_reply is None:
            head = self._buffer.lstrip()
            if not head:
                return StreamPiece()
            tag = parser.python_tag
            if head.startswith(("{", "[")) or head.startswith(tag):
                self._whole_reply = True
            elif tag.startswith(head):
                return StreamPiece()  # maybe the tag: wait for more
            else:
                self._whole_reply = False
        if self._whole_reply:
            return StreamPiece()  # parsed in `finish`
        out, self._buffer = self._buffer, ""
        return StreamPiece(out)


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
