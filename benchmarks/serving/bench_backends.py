"""bench_serving.py's backends: what each server API is sent (payloads) and how its stream is read.

A `Backend` is the path, the payload builder and the stream parser of one API: SGLang's native
/generate (jaxserve, SGLang), OpenAI completions (vLLM, llama-server, any OpenAI server) and OpenAI
chat completions. Parsers normalise each server-sent event into a `StreamChunk`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from benchmarks.serving.bench_datasets import DatasetRow

SSE_DONE = "[DONE]"


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """Parses one line of a server-sent event stream.

    Returns the JSON payload of a `data:` line, SSE_DONE for `data: [DONE]`, and None for anything
    else (blank lines, comments, `event:` / `id:` fields). Raises json.JSONDecodeError on a data
    line that is not JSON."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == SSE_DONE:
        return SSE_DONE
    return json.loads(data) if data else None


class RequestFailed(Exception):
    """The server refused or aborted a request (an HTTP error status or an error event)."""


class StreamChunk(NamedTuple):
    """What one streamed event says, normalised across backends. Token counts are in tokens and
    cumulative where reported; None where the event does not say."""

    text: str  # text generated since the previous event
    num_new_tokens: int  # output tokens carried by this event (0 for a usage- or meta-only event)
    completion_tokens: int | None
    prompt_tokens: int | None
    cached_tokens: int | None
    finish_reason: str | None
    error: str | None = None


def _error_of(data: dict[str, Any]) -> str | None:
    if err := data.get("error"):
        return err.get("message", json.dumps(err)) if isinstance(err, dict) else str(err)
    if data.get("object") == "error":  # vLLM's error body
        return str(data.get("message", data))
    return None


def _cached_from_usage(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details") or {}
    return details.get("cached_tokens", usage.get("cached_tokens"))


class NativeStreamParser:
    """SGLang's native /generate stream (also jaxserve's): `text` is cumulative, `meta_info`
    carries cumulative prompt_tokens, completion_tokens, cached_tokens and finish_reason (a string or
    SGLang's {"type": ...} dict). Token counts come from meta_info.completion_tokens, else from
    `output_ids` (cumulative or incremental), else one per event with new text."""

    def __init__(self) -> None:
        self._text = ""
        self._ids: list[int] = []
        self._num_tokens = 0

    def feed(self, data: dict[str, Any]) -> StreamChunk:
        if (error := _error_of(data)) is not None:
            return StreamChunk("", 0, None, None, None, None, error)
        text = data.get("text", self._text)
        delta = text[len(self._text):] if text.startswith(self._text) else text
        self._text = text
        meta = data.get("meta_info") or {}
        completion_tokens = meta.get("completion_tokens")
        ids = data.get("output_ids")
        if completion_tokens is None and isinstance(ids, list):
            is_cumulative = len(ids) >= len(self._ids) and ids[: len(self._ids)] == self._ids
            self._ids = ids if is_cumulative else self._ids + ids
            completion_tokens = len(self._ids)
        if completion_tokens is not None:
            num_new = max(completion_tokens - self._num_tokens, 0)
        else:
            num_new = 1 if delta else 0
        self._num_tokens += num_new
        finish = meta.get("finish_reason")
        if isinstance(finish, dict):
            finish = finish.get("type")
        return StreamChunk(
            delta, num_new, completion_tokens, meta.get("prompt_tokens"), meta.get("cached_tokens"), finish
        )


class OpenAIStreamParser:
    """OpenAI /v1/completions or /v1/chat/completions stream: incremental `choices[0].text` (or
    `choices[0].delta.content` for chat), and with stream_options.include_usage a `usage` object
    (prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens) in the last chunk. Each
    event with text counts as one token arrival, as in SGLang; the final count comes from usage."""

    def __init__(self, is_chat: bool) -> None:
        self.is_chat = is_chat

    def feed(self, data: dict[str, Any]) -> StreamChunk:
        if (error := _error_of(data)) is not None:
            return StreamChunk("", 0, None, None, None, None, error)
        text, finish = "", None
        if choices := data.get("choices"):
            choice = choices[0]
            if self.is_chat:
                delta = choice.get("delta") or {}
                text = (delta.get("reasoning_content") or "") + (delta.get("content") or "")
            else:
                text = choice.get("text") or ""
            finish = choice.get("finish_reason")
        usage = data.get("usage") or {}
        return StreamChunk(
            text, 1 if text else 0, usage.get("completion_tokens"), usage.get("prompt_tokens"),
            _cached_from_usage(usage), finish,
        )


@dataclass(frozen=True)
class RequestSettings:
    """How every request of a run is sent. extra_body is merged into each payload's top level."""

    backend: str
    base_url: str
    model: str | None
    api_key: str | None
    ignore_eos: bool
    use_prompt_ids: bool
    extra_body: dict[str, Any] = field(default_factory=dict)


def _native_payload(row: DatasetRow, s: RequestSettings) -> dict[str, Any]:
    sampling = {"max_new_tokens": row.output_len, "temperature": 0.0}
    if s.ignore_eos:
        sampling["ignore_eos"] = True
    prompt = {"input_ids": row.prompt_ids} if s.use_prompt_ids and row.prompt_ids else {"text": row.prompt}
    return {**prompt, "sampling_params": sampling, "stream": True, **s.extra_body}


def _openai_common(row: DatasetRow, s: RequestSettings) -> dict[str, Any]:
    payload = {
        "model": s.model, "temperature": 0.0, "max_tokens": row.output_len, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if s.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _completions_payload(row: DatasetRow, s: RequestSettings) -> dict[str, Any]:
    prompt = row.prompt_ids if s.use_prompt_ids and row.prompt_ids else row.prompt
    return {**_openai_common(row, s), "prompt": prompt, **s.extra_body}


def _chat_payload(row: DatasetRow, s: RequestSettings) -> dict[str, Any]:
    messages = [{"role": "user", "content": row.prompt}]
    return {**_openai_common(row, s), "messages": messages, **s.extra_body}


class Backend(NamedTuple):
    path: str
    build_payload: Callable[[DatasetRow, RequestSettings], dict[str, Any]]
    make_parser: Callable[[], NativeStreamParser | OpenAIStreamParser]
    spreads_itl: bool  # events may carry several tokens and say how many: spread each gap over them


BACKENDS: dict[str, Backend] = {
    "jaxserve": Backend("/generate", _native_payload, NativeStreamParser, True),
    "sglang": Backend("/generate", _native_payload, NativeStreamParser, True),
    "vllm": Backend("/v1/completions", _completions_payload, lambda: OpenAIStreamParser(False), False),
    "openai": Backend("/v1/completions", _completions_payload, lambda: OpenAIStreamParser(False), False),
    "openai-chat": Backend(
        "/v1/chat/completions", _chat_payload, lambda: OpenAIStreamParser(True), False
    ),
}
