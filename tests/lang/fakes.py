"""A scripted Backend for testing the language without a model: replies are computed from the prompt."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

from jaxserve.lang.backend import Backend, GenChunk, GenResult
from jaxserve.lang.chat_template import ChatTemplate


class FakeBackend(Backend):
    """`reply(prompt, params) -> str` gives each generation; `token_logprob(token_id) -> float` scores
    select choices. Records every call (thread-safe)."""

    def __init__(
        self,
        tokenizer: Any = None,
        reply: Callable[[str, dict], str] | None = None,
        token_logprob: Callable[[int], float] | None = None,
        chat_template: ChatTemplate | None = None,
    ):
        super().__init__(chat_template)
        self._tokenizer = tokenizer
        self.reply = reply or (lambda prompt, params: f"<{len(prompt)}>")
        self.token_logprob = token_logprob or (lambda token_id: -1.0)
        self.calls: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def _record(self, kind: str, value: Any) -> None:
        with self._lock:
            self.calls.append((kind, value))

    def generate(self, prompt: str, params: dict[str, Any]) -> GenResult:
        self._record("generate", (prompt, dict(params)))
        text = self.reply(prompt, params)
        return GenResult(text, [], {"prompt": prompt, "params": dict(params)})

    def generate_stream(self, prompt: str, params: dict[str, Any]) -> Iterator[GenChunk]:
        self._record("generate_stream", (prompt, dict(params)))
        text = self.reply(prompt, params)
        for ch in text:
            yield GenChunk(ch)
        yield GenChunk("", GenResult(text, [], {"prompt": prompt}))

    def prompt_logprobs(self, input_ids: list[list[int]], logprob_start_len: int) -> list[list[float | None]]:
        self._record("prompt_logprobs", (input_ids, logprob_start_len))
        return [[self.token_logprob(t) for t in ids[logprob_start_len:]] for ids in input_ids]

    def cache_prefix(self, prompt: str) -> None:
        self._record("cache_prefix", prompt)
