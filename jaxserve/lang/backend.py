"""Backend: what a program needs from a model server, and the process-wide default backend.

Two implementations: `RuntimeEndpoint` (HTTP, SGLang's native API) and `EngineBackend` (an
in-process `Engine`). Every method may be called from several threads at once (forks and
`run_batch` run programs in parallel).
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from typing import Any, Iterator, Sequence

from jaxserve.lang.chat_template import ChatTemplate
from jaxserve.lang.choices import ChoiceScores, token_length_normalized, tokenize_choices

# select asks for one new token: jaxserve finishes a max_new_tokens=0 request without running its
# prompt (so it would return no prompt logprobs and cache nothing); SGLang's server accepts either.
SCORING_MAX_NEW_TOKENS = 1
# `gen` parameters that are /generate request fields, not sampling params
REQUEST_FIELDS = ("lora_path",)


def split_request_fields(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A `gen`'s params as (sampling params, request fields such as `lora_path`)."""
    sampling = {k: v for k, v in params.items() if k not in REQUEST_FIELDS}
    return sampling, {k: v for k, v in params.items() if k in REQUEST_FIELDS}


@dataclasses.dataclass(frozen=True)
class GenResult:
    """One finished generation. `meta_info` is SGLang's dict (prompt_tokens, completion_tokens,
    cached_tokens, finish_reason, e2e_latency, ...), as the server returns it."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class GenChunk:
    """A piece of a streamed generation: the text it adds; the last chunk also carries the result."""

    text_delta: str
    result: GenResult | None = None


class Backend(abc.ABC):
    """A model server as programs see it.

    Args:
        chat_template: overrides the template derived from the tokenizer (see chat_template.py).
    """

    def __init__(self, chat_template: ChatTemplate | None = None):
        self._chat_template = chat_template
        self._template_lock = threading.Lock()

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer (select tokenizes choices with it)."""

    @property
    def chat_template(self) -> ChatTemplate:
        """The override given at construction, else derived once from the tokenizer's template."""
        with self._template_lock:
            if self._chat_template is None:
                self._chat_template = ChatTemplate.from_tokenizer(self.tokenizer)
            return self._chat_template

    @property
    def caches_prefixes(self) -> bool:
        """Whether the server keeps a prefix cache (fork then pre-fills the shared prefix once)."""
        return True

    @abc.abstractmethod
    def generate(self, prompt: str, params: dict[str, Any]) -> GenResult:
        """Generate after `prompt` with SGLang sampling params. Raises BackendError."""

    @abc.abstractmethod
    def generate_stream(self, prompt: str, params: dict[str, Any]) -> Iterator[GenChunk]:
        """Like `generate`, chunk by chunk as the server produces them. Raises BackendError."""

    @abc.abstractmethod
    def prompt_logprobs(self, input_ids: list[list[int]], logprob_start_len: int) -> list[list[float | None]]:
        """Per prompt (one batched request), log p(token | tokens before it) for the tokens from
        `logprob_start_len` on, greedy and with SCORING_MAX_NEW_TOKENS new tokens.
        Raises BackendError."""

    @abc.abstractmethod
    def cache_prefix(self, prompt: str) -> None:
        """Run `prompt` through the model so that its KV cache is kept for requests that extend it."""

    def select(self, prompt: str, choices: Sequence[str]) -> ChoiceScores:
        """The choice with the highest mean token log-probability after `prompt` (choices.py)."""
        tokens = tokenize_choices(self.tokenizer, prompt, choices)
        logprobs = self.prompt_logprobs(tokens.input_ids, tokens.logprob_start_len)
        return token_length_normalized(choices, tokens, logprobs)


_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """The backend `run`/`run_batch` use when none is passed (SGLang's `set_default_backend`)."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend
