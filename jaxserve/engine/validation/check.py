"""`RequestChecker.check`: the one check of a request against the model, on every path.

The server runs it in `EngineLoop.submit`, in the caller's thread (so a bad request raises there and never
reaches the loop thread, which queues the `CheckedInput` as it is); research code runs it in
`Engine.add_request`. It reads the model only through `ModelLimits` and the tokenizer, and compiles the
request's grammar (the engine's cache), so that an invalid one is a 400 naming its field, not an aborted
request later. Every refusal is a `RequestError` naming its field (the server's HTTP 400).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Callable, Sequence

import numpy as np

from jaxserve.constrained import GrammarSpec, InvalidGrammarError
from jaxserve.core.errors import ContextLengthError, RequestError, SamplingParamsError
from jaxserve.core.field_types import describe
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.request_input import GenerateInput
from jaxserve.engine.validation.limits import ModelLimits
from jaxserve.engine.validation.logprob_start import check_logprob_start_len, is_checked

MAX_TOKEN_IDS_LOGPROB = 128  # a bound of ours: the sampler gathers a padded [S, L] block of logprobs
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top logprobs, on every route


@dataclasses.dataclass(frozen=True)
class CheckedInput:
    """A `GenerateInput` that passed `RequestChecker.check`: its prompt's token ids and its sampling
    params with `max_new_tokens` resolved (the route's default, or the value given) and cut to what the
    context and the KV pool leave. Only `check` makes one; `Engine.add_request` queues it as it is."""

    request: GenerateInput
    input_ids: list[int]
    params: SamplingParams


class RequestChecker:
    """The checks of one request against its model (read-only, thread-safe).

    Args:
        tokenizer: the model's tokenizer (`encode`, `get_vocab`); None with --skip-tokenizer-init (then a
            prompt must be token ids).
        limits: the model's and the pool's bounds.
        compile_grammar: compiles a `GrammarSpec` (cached), raising `InvalidGrammarError`; None: no
            grammar is compiled here (an invalid one then aborts its request in the engine's queue).
    """

    def __init__(self, tokenizer: Any, limits: ModelLimits, compile_grammar: Callable[[GrammarSpec], Any] | None = None):
        self.tokenizer = tokenizer
        self.limits = limits
        self.compile_grammar = compile_grammar

    def check(self, request: GenerateInput) -> CheckedInput:
        """The request's values, its prompt (tokenized), adapter, ids, length, logprob fields and grammar.

        `max_new_tokens` not given (None) takes the route's `request.default_max_new_tokens` (None: all
        the context leaves), cut to what the context leaves; one given must fit the context. Either is then
        cut to what the KV pool holds for one request (`ModelLimits.fit_pool`).

        Raises:
            SamplingParamsError: an invalid sampling value (`SamplingParams.validate`; names it).
            RequestError: empty or too long prompt, bad token ids, an adapter not loaded, top_logprobs_num
                outside [0, 20], bad token_ids_logprob, an invalid regex / json_schema / ebnf (its field),
                a `logprob_start_len` below -1 or past the prompt (`logprob_start.py`).
            ContextLengthError: the prompt, or prompt + max_new_tokens, over the context or the pool.
        """
        self._check_request_fields(request)
        params = request.sampling_params
        params.validate()
        limits = self.limits
        input_ids = self.tokenize(request.prompt, request.add_special_tokens)
        if request.lora_path is not None:
            self.check_adapter(request.lora_path)
        self.check_input_ids(input_ids)
        if params.logit_bias and params.logit_bias[-1][0] >= limits.vocab_size:  # sorted by id
            raise RequestError("logit_bias", f"logit_bias: token id {params.logit_bias[-1][0]} is outside the vocabulary "
                                             f"[0, {limits.vocab_size})")
        if (bad := next((t for t in params.stop_token_ids if t >= limits.vocab_size), None)) is not None:
            raise RequestError("stop_token_ids", f"stop_token_ids: token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
        params = dataclasses.replace(params, max_new_tokens=self._max_new_tokens(request, params, len(input_ids)))
        top = request.top_logprobs_num
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError("top_logprobs_num", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        self._compile_grammar(params)
        self.check_token_ids_logprob(request.token_ids_logprob)
        if is_checked(request.return_logprob, top):
            check_logprob_start_len(request.logprob_start_len, len(input_ids))
        return CheckedInput(request, input_ids, limits.fit_pool(params, len(input_ids)))

    @staticmethod
    def _check_request_fields(request: GenerateInput) -> None:
        """The types of the request's own fields (the HTTP routes' models parse them already; research
        code may give anything)."""
        for name, ok, kind in (("return_logprob", lambda v: isinstance(v, bool), "a boolean"),
                               ("top_logprobs_num", _is_int, "an integer"),
                               ("logprob_start_len", _is_int, "an integer"),
                               ("rid", lambda v: v is None or isinstance(v, str), "a string"),
                               ("lora_path", lambda v: v is None or isinstance(v, str), "a string")):
            value = getattr(request, name)
            if not ok(value):
                raise RequestError(name, f"{name}: must be {kind}, got {describe(value)}", code="invalid_type")

    def _max_new_tokens(self, request: GenerateInput, params: SamplingParams, prompt_len: int) -> int:
        room = self.limits.context_length - prompt_len
        given = params.max_new_tokens
        if given is None:
            default = request.default_max_new_tokens
            wanted = room if default is None else default
            if params.min_new_tokens > wanted:
                raise SamplingParamsError("min_new_tokens", f"must be <= max_new_tokens ({wanted}), got {params.min_new_tokens}")
            return min(wanted, room)
        if given > room:
            raise ContextLengthError(
                "max_new_tokens",
                f"the prompt has {_tokens(prompt_len)} and {_tokens(given, 'new token')} "
                f"{'is' if given == 1 else 'are'} asked for: together over the context length {self.limits.context_length}",
            )
        return given

    def tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text, or a copy of a list of ids. `add_special_tokens`: the tokenizer's own (a
        BOS where the model wants one, as Gemma does; none for SmolLM2 or Qwen), as SGLang encodes a text
        prompt; False for text a chat template rendered, which holds them already.

        Raises:
            RequestError: a list holding something other than integers (field "input_ids"); a text so long
                that it cannot fit the context whatever its tokens (field "prompt"): no token covers more
                than `max_token_chars` characters, so such a text is refused before tokenizing it (a 20 MB
                prompt took ~16 s of the one preprocessing thread, stalling every other request's submit);
                a text that is not valid Unicode (a lone UTF-16 surrogate, which JSON's \\uXXXX escapes can
                carry; the tokenizer cannot take it).
        """
        if not isinstance(prompt, str):
            if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (Sequence, np.ndarray)):
                raise RequestError("prompt", f"must be a text or a list of token ids, got {type(prompt).__name__}",
                                   code="invalid_type")
            if not all(_is_int(t) for t in prompt):
                raise RequestError("input_ids", "token ids must be integers")
            return [int(t) for t in prompt]
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(
                "prompt", f"the text is not valid Unicode: a lone surrogate U+{ord(prompt[e.start]):04X} at character {e.start}"
            ) from None
        at_least = len(prompt) // self.max_token_chars
        if at_least >= self.limits.context_length:
            raise ContextLengthError(
                "prompt",
                f"the prompt has at least {at_least} tokens ({len(prompt)} characters), the context length "
                f"is {self.limits.context_length}",
            )
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its longest vocabulary entry (byte-level
        and sentencepiece entries hold at least one character per character covered)."""
        return max(1, max((len(t) for t in self.tokenizer.get_vocab()), default=1))

    def check_adapter(self, name: str) -> None:
        """Raise RequestError (naming lora_path) unless adapter `name` is loaded."""
        adapters = self.limits.adapters
        if adapters is None:
            raise RequestError("lora_path", "LoRA is not enabled; start the server with --enable-lora")
        if not isinstance(name, str) or not adapters.has(name):
            raise RequestError("lora_path", f"LoRA adapter {name!r} is not loaded; loaded: {sorted(adapters.loaded())}")

    def check_input_ids(self, input_ids: Sequence[int]) -> None:
        """Raise RequestError for an empty prompt, ids outside the vocabulary, or one that does not fit the
        context or the pool (ContextLengthError), or one prefill with chunking off."""
        limits = self.limits
        if not input_ids:
            raise RequestError("prompt", "the prompt is empty")
        if min(input_ids) < 0 or max(input_ids) >= limits.vocab_size:
            raise RequestError("input_ids", f"token ids must be in [0, {limits.vocab_size})")
        if len(input_ids) >= limits.context_length:
            raise ContextLengthError(
                "prompt",
                f"the prompt has {len(input_ids)} tokens, the context length is {limits.context_length} "
                f"(prompt + at least one new token must fit)",
            )
        limits.check_prompt_fits_pool(len(input_ids))
        if limits.max_prefill_tokens is not None and len(input_ids) > limits.max_prefill_tokens:
            raise RequestError("prompt", f"the prompt has {len(input_ids)} tokens, over --max-prefill-tokens "
                                         f"{limits.max_prefill_tokens} (chunked prefill is off)")

    def check_token_ids_logprob(self, ids: Sequence[int]) -> None:
        """Raise RequestError("token_ids_logprob") for more than MAX_TOKEN_IDS_LOGPROB ids or one outside the vocabulary."""
        vocab = self.limits.vocab_size
        if len(ids) > MAX_TOKEN_IDS_LOGPROB:
            raise RequestError("token_ids_logprob", f"at most {MAX_TOKEN_IDS_LOGPROB} ids, got {len(ids)}")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise RequestError("token_ids_logprob", f"token ids must be integers in [0, {vocab}), got {t!r}")

    def _compile_grammar(self, params: SamplingParams) -> None:
        spec = GrammarSpec.of_sampling_params(params)
        if spec is None or self.compile_grammar is None:
            return
        try:
            self.compile_grammar(spec)
        except InvalidGrammarError as e:
            raise RequestError(spec.kind, str(e)) from None


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _tokens(n: int, noun: str = "token") -> str:
    """"1 token", "2 tokens": counts in user-facing messages read as English."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
