"""`--reasoning-parser`: split a reasoning model's `<think>...</think>` section from its answer.

Chat replies then carry the reasoning in `message.reasoning_content` (streamed: `delta.reasoning_content`)
and only the answer in `content`, as SGLang 0.5.23 does (sglang/srt/parser/reasoning_parser.py, whose
parser names `REASONING_PARSERS` keeps). Two kinds of `<think>` formats are served:

- the reply starts inside the reasoning (DeepSeek-R1: its chat template opens `<think>`, so the model
  writes `reasoning</think>answer`; a `<think>` it writes itself first is dropped): `deepseek-r1` and the
  names SGLang maps to the same detector, plus `qwen3-thinking` and `minimax`, which SGLang forces into
  reasoning;
- the reply may open with `<think>` (Qwen3, whose `enable_thinking: false` leaves it out): `qwen3` and
  its aliases. A reply that does not start with `<think>` is all answer.

A reply whose `</think>` never comes (cut by max_tokens) is all reasoning, with content "".
The Qwen3 formats also end the reasoning at a `<tool_call>` that comes before any `</think>` (SGLang's
Qwen3Detector `tool_start_token`: Qwen3.5 may open a call without closing its reasoning); the
`<tool_call>` stays in the content, for the tool-call parser. A `</think>` already in the text
seen wins over a later `<tool_call>`, as in SGLang.
The streaming split holds back the text that may be the start of a tag, so a tag split over two
deltas is never sent as text; `ReasoningSplitter.finish` hands the held-back rest out. With
`stream_reasoning=False` (the chat request's field, SGLang's, default true) the splitter hands out no
reasoning until the reasoning ends: then all of it in one piece (at `</think>` or `<tool_call>`, or
from `finish` when the reply ends inside it), as SGLang's detectors do.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    """Tags of a reasoning section; `starts_in_reasoning`: the reply begins inside it (SGLang's
    `force_reasoning`); `tool_start`: a tag that also ends the reasoning and begins the content
    (SGLang's `tool_start_token`), None for none."""

    think_start: str
    think_end: str
    starts_in_reasoning: bool
    tool_start: str | None = None
    # SGLang's detector `reasoning_default`: "always" (every request reasons) or "enable_thinking" (unless
    # chat_template_kwargs sets enable_thinking false); decides whether a grammar waits for think_end
    reasoning_default: str = "always"


_STARTS_INSIDE = ReasoningFormat("<think>", "</think>", starts_in_reasoning=True)  # DeepSeekR1Detector
# Qwen3Detector: forced into reasoning (qwen3-thinking, minimax) or not; both end it at <tool_call>
_QWEN3_STARTS_INSIDE = ReasoningFormat("<think>", "</think>", starts_in_reasoning=True, tool_start="<tool_call>",
                                       reasoning_default="enable_thinking")
_MAY_OPEN = ReasoningFormat("<think>", "</think>", starts_in_reasoning=False, tool_start="<tool_call>",
                            reasoning_default="enable_thinking")

# SGLang 0.5.23's names whose detector is DeepSeekR1Detector or Qwen3Detector (`ReasoningParser.DetectorMap`);
# qwen3-thinking and minimax are Qwen3Detector with force_reasoning set, as SGLang sets it
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek-r1": _STARTS_INSIDE,
    "step3": _STARTS_INSIDE,
    "step3p5": _STARTS_INSIDE,
    "gigachat35": _STARTS_INSIDE,
    "qwen3-thinking": _QWEN3_STARTS_INSIDE,
    "minimax": _QWEN3_STARTS_INSIDE,
    "qwen3": _MAY_OPEN,
    "dots": _MAY_OPEN,
    "nanbeige": _MAY_OPEN,
    "interns1": _MAY_OPEN,
}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    """The format of `--reasoning-parser NAME` (None for no flag).

    Raises:
        ValueError: a name not in REASONING_PARSERS (the message lists them).
    """
    if name is None:
        return None
    fmt = REASONING_PARSERS.get(name.lower())
    if fmt is None:
        raise ValueError(f"--reasoning-parser {name!r} is not one of: {', '.join(REASONING_PARSERS)}")
    return fmt


def grammar_think_end_ids(fmt: ReasoningFormat | None, chat_template_kwargs: dict | None, tokenizer) -> tuple[int, ...]:
    """The token ids after which a chat request's grammar applies; () for a grammar from the first token.

    SGLang 0.5.23 wraps the grammar backend in `ReasonerGrammarBackend` under `--reasoning-parser` when
    the parser's think_end_token encodes to ids, and defers the grammar of a request that reasons
    (`require_reasoning`: `OpenAIServingChat._get_reasoning_from_request`, from the detector's
    `reasoning_default` when the template gives no toggle) until those ids (constrained/reasoner.py).
    """
    if fmt is None:
        return ()
    if fmt.reasoning_default == "enable_thinking" and (chat_template_kwargs or {}).get("enable_thinking") is False:
        return ()
    return tuple(tokenizer.encode(fmt.think_end, add_special_tokens=False))


@dataclasses.dataclass(frozen=True)
class ReasoningSplit:
    """A piece of a reply split in two: reasoning text and answer text (either may be "")."""

    reasoning: str
    content: str


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (0 when none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits one reply, fed as text deltas, into reasoning and content (see the module docstring).

    `stream_reasoning`: False holds all reasoning back until it ends (SGLang's `stream_reasoning`)."""

    def __init__(self, fmt: ReasoningFormat, stream_reasoning: bool = True):
        self._fmt = fmt
        self._stream_reasoning = stream_reasoning
        self._in_reasoning = fmt.starts_in_reasoning
        self._at_start = True  # nothing handed out yet: a leading <think> may still come
        self._done = False  # </think> seen, or the reply did not open reasoning: the rest is content
        self._buffer = ""

    def feed(self, delta: str) -> ReasoningSplit:
        """The reasoning and content that `delta` completes (text that may start a tag is held back)."""
        self._buffer += delta
        reasoning = content = ""
        start, end = self._fmt.think_start, self._fmt.think_end
        if self._at_start:
            if start.startswith(self._buffer) and self._buffer != start:
                return ReasoningSplit("", "")  # may still become <think>
            if self._buffer.startswith(start):
                self._buffer = self._buffer[len(start):]
                self._in_reasoning = True
            elif not self._in_reasoning:
                self._done = True
            self._at_start = False
        if self._in_reasoning:
            tool = self._fmt.tool_start
            idx = self._buffer.find(end)
            tool_idx = self._buffer.find(tool) if tool is not None and idx < 0 else -1
            if idx >= 0:
                reasoning, self._buffer = self._buffer[:idx], self._buffer[idx + len(end):]
                self._in_reasoning, self._done = False, True
            elif tool_idx >= 0:  # the tag is the content's: the tool-call parser reads it
                reasoning, self._buffer = self._buffer[:tool_idx], self._buffer[tool_idx:]
                self._in_reasoning, self._done = False, True
            elif not self._stream_reasoning:
                return ReasoningSplit("", "")
            else:
                keep = max(_partial_suffix(self._buffer, end), _partial_suffix(self._buffer, tool) if tool else 0)
                reasoning, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                return ReasoningSplit(reasoning, "")
        if self._done:
            content, self._buffer = self._buffer, ""
        return ReasoningSplit(reasoning, content)

    def finish(self) -> ReasoningSplit:
        """What is still held back, once the reply has ended."""
        rest, self._buffer = self._buffer, ""
        if self._in_reasoning:
            return ReasoningSplit(rest, "")
        return ReasoningSplit("", rest)


def split_reasoning(fmt: ReasoningFormat, text: str) -> ReasoningSplit:
    """A whole reply split once (the same split as feeding it in pieces)."""
    splitter = ReasoningSplitter(fmt)
    head, tail = splitter.feed(text), splitter.finish()
    return ReasoningSplit(head.reasoning + tail.reasoning, head.content + tail.content)
