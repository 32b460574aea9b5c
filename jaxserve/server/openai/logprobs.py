"""The OpenAI routes' logprobs objects from an engine output: the completions' legacy form
(`tokens`, `token_logprobs`, `top_logprobs` as {text: logprob}, `text_offset`) and the chat's
`logprobs.content` entries (`token`, `logprob`, `bytes`, `top_logprobs`), which /v1/responses reuses.
Token texts are each token decoded alone, as OpenAI's and SGLang's are; one that is part of a UTF-8
character is "bytes:" and its escaped bytes, as OpenAI writes it, and `bytes` holds its raw bytes.
"""

from __future__ import annotations

from typing import Any

from jaxserve.engine.outputs import StepOutput
from jaxserve.model.token_bytes import token_bytes_of
from jaxserve.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


class TokenTexts:
    """Single tokens' strings and raw bytes (`model/token_bytes.py`), cached per response (logprob
    entries repeat tokens). A token holding part of a UTF-8 character is "bytes:" and its escaped bytes,
    as OpenAI writes it; its `bytes` field holds the raw bytes, so a client can rebuild the text."""

    def __init__(self, tokenizer: Any):
        self._token_bytes = token_bytes_of(tokenizer)
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._token_bytes.text(token_id)
        return text

    def bytes(self, token_id: int) -> list[int]:
        return list(self._token_bytes.bytes(token_id))

    def text_length(self, token_id: int) -> int:
        """Characters the token adds to the text as it decodes alone (part of a character: 1, U+FFFD)."""
        return len(self._token_bytes.bytes(token_id).decode("utf-8", "replace"))


def completion_logprobs(out: StepOutput, start: int, texts: TokenTexts, offset: int, k: int,
                         prompt: bool = False) -> CompletionLogprobs:
    """Legacy logprobs of output tokens [start:], text offsets from `offset`; with `prompt`, the prompt's
    tokens first (`echo`): the first has null logprob and top_logprobs, the others their top `k`
    (SGLang's `input_top_logprobs`) when k > 0."""
    result = CompletionLogprobs()

    def add(token_id: int, logprob: float | None, top: dict[str, float] | None) -> None:
        nonlocal offset
        result.tokens.append(texts(token_id))
        result.token_logprobs.append(logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += texts.text_length(token_id)

    if prompt:
        prompt_tops = out.meta.input_top_logprobs or []
        for i, (logprob, token_id) in enumerate(out.meta.input_token_logprobs or []):
            top = prompt_tops[i] if k > 0 and i < len(prompt_tops) else None
            add(token_id, logprob, None if top is None else {texts(t): lp for lp, t in top})
    pairs = (out.meta.output_token_logprobs or [])[start:]
    tops = (out.meta.output_top_logprobs or [])[start:]
    for i, (logprob, token_id) in enumerate(pairs):
        add(token_id, logprob, {texts(t): lp for lp, t in tops[i]} if k > 0 and i < len(tops) else None)
    return result


def chat_logprobs(out: StepOutput, start: int, texts: TokenTexts) -> ChatLogprobs:
    """The chat's logprobs of output tokens [start:], each with its top alternatives."""
    pairs = (out.meta.output_token_logprobs or [])[start:]
    tops = (out.meta.output_top_logprobs or [])[start:]
    content = []
    for i, (logprob, token_id) in enumerate(pairs):
        text = texts(token_id)
        top = [TopLogprob(token=texts(t), logprob=lp, bytes=texts.bytes(t)) for lp, t in (tops[i] if i < len(tops) else [])]
        content.append(TokenLogprob(token=text, logprob=logprob, bytes=texts.bytes(token_id), top_logprobs=top))
    return ChatLogprobs(content=content)


def chat_token_logprobs(out: StepOutput, tokenizer: Any) -> list[TokenLogprob]:
    """The chat's logprobs entries of every output token of `out` (its request asked for logprobs)."""
    return chat_logprobs(out, 0, TokenTexts(tokenizer)).content
