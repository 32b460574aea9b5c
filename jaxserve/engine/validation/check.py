"""Checks a request passes before it reaches the scheduler: its text, ids and fields against the model.

Two paths, each checking a `GenerateInput` once and turning it into a `CheckedInput`:
`Engine.add_request` (in-process callers) runs `RequestValidator.check`, which holds the model's
vocabulary, context length and pool bounds; `EngineLoop.submit` (the server) runs `check_submit` in the
caller's thread through the engine's read-only, thread-safe methods, so a bad request raises there and
never reaches the loop thread, which queues the `CheckedInput` as it is. Every refusal is a
`RequestError` naming its field (the server's HTTP 400).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

from jaxserve.constrained import InvalidGrammarError
from jaxserve.engine.outputs import ContextLengthError, RequestError
from jaxserve.engine.request import SamplingParams
from jaxserve.engine.request_input import GenerateInput
from jaxserve.engine.validation.logprob_start import check_logprob_start_len, is_checked
from jaxserve.engine.validation.pool_limits import PoolLimits

MAX_TOKEN_IDS_LOGPROB = 128  # a bound of ours: the sampler gathers a padded [S, L] block of logprobs
MAX_TOP_LOGPROBS = 20
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "choices")


@dataclasses.dataclass(frozen=True)
class CheckedInput:
    """A `GenerateInput` that passed every check of its values: its prompt's token ids and its built
    `SamplingParams` (max_new_tokens cut to what the context and the KV pool leave). Only this module
    makes one; `Engine.add_request` queues it without checking it again."""

    request: GenerateInput
    input_ids: list[int]
    params: SamplingParams


class RequestValidator:
    """The engine's checks of one request against its model (read-only, thread-safe).

    Args:
        tokenizer: the model's tokenizer (`encode`, `get_vocab`).
        vocab_size: token ids are in [0, vocab_size).
        context_length: prompt + at least one new token must fit (tokens).
        pool_limits: the KV pool's bound on one request (`pool_limits.py`).
        chunked_prefill_size, max_prefill_tokens: the flags; with chunking off (<= 0) a prompt
            must fit one prefill of `max_prefill_tokens`.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, context_length: int, pool_limits: PoolLimits,
                 chunked_prefill_size: int, max_prefill_tokens: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.pool_limits = pool_limits
        self.chunked_prefill_size = chunked_prefill_size
        self.max_prefill_tokens = max_prefill_tokens

    def check(self, request: GenerateInput) -> CheckedInput:
        """The checks of `Engine.add_request` (in-process callers): as `check_submit`, except that a
        max_new_tokens over the context is left to the context's bound and a grammar is compiled later
        (an invalid one aborts its request).

        Raises:
            SamplingParamsError: an invalid sampling parameter (names it).
            RequestError: empty prompt, prompt longer than the context, bad token ids, top_logprobs_num
                outside [0, 20], with logprobs asked for a `logprob_start_len` below -1 or past the
                prompt (`logprob_start.py`).
        """
        sp = request.sampling_params
        params = sp if isinstance(sp, SamplingParams) else SamplingParams.from_dict(sp)
        input_ids = self.tokenize(request.prompt)
        self.validate_input_ids(input_ids, params.max_new_tokens)
        params = self.pool_limits.fit(params, len(input_ids))
        self.validate_logit_bias(params)
        self.validate_stop_token_ids(params)
        top = request.top_logprobs_num
        if top < 0 or top > MAX_TOP_LOGPROBS:
            raise RequestError("top_logprobs_num", f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        self.validate_token_ids_logprob(request.token_ids_logprob)
        if is_checked(request.return_logprob, top):
            check_logprob_start_len(request.logprob_start_len, len(input_ids))
        return CheckedInput(request, input_ids, params)

    def tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text, or the ids of a list as ints. `add_special_tokens`: the tokenizer's own
        (a BOS where the model wants one, as Gemma does; none for SmolLM2 or Qwen), as SGLang encodes a
        text prompt; False for text a chat template rendered, which holds them already.

        Raises:
            RequestError: a text so long that it cannot fit the context whatever its tokens (field
                "prompt"): no token covers more than `max_token_chars` characters, so such a text is
                refused before tokenizing it (a 20 MB prompt took ~16 s of the one preprocessing
                thread, stalling every other request's submit); a text that is not valid Unicode (a lone
                UTF-16 surrogate, which JSON's \\uXXXX escapes can carry; the tokenizer cannot take it).
        """
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(
                    "prompt", f"the text is not valid Unicode: a lone surrogate U+{ord(prompt[e.start]):04X} at character {e.start}"
                ) from None
            at_least = len(prompt) // self.max_token_chars
            if at_least >= self.context_length:
                raise ContextLengthError(
                    "prompt",
                    f"the prompt has at least {at_least} tokens ({len(prompt)} characters), the context length "
                    f"is {self.context_length}",
                )
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        return [int(t) for t in prompt]

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its longest vocabulary entry (byte-level
        and sentencepiece entries hold at least one character per character covered)."""
        return max(1, max((len(t) for t in self.tokenizer.get_vocab()), default=1))

    def validate_logit_bias(self, params: SamplingParams) -> None:
        """Raise RequestError("logit_bias") for a biased token id outside the vocabulary."""
        if params.logit_bias and params.logit_bias[-1][0] >= self.vocab_size:  # sorted by id
            raise RequestError("logit_bias", f"logit_bias: token id {params.logit_bias[-1][0]} is outside the vocabulary [0, {self.vocab_size})")

    def validate_stop_token_ids(self, params: SamplingParams) -> None:
        """Raise RequestError("stop_token_ids") for an id outside the vocabulary [0, vocab_size)."""
        vocab = self.vocab_size
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise RequestError("stop_token_ids", f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")

    def validate_input_ids(self, input_ids: Sequence[int], max_new_tokens: int = 0) -> None:
        """Raise RequestError for an empty prompt, bad ids, or one that does not fit the context/pool."""
        if not input_ids:
            raise RequestError("prompt", "the prompt is empty")
        if min(input_ids) < 0 or max(input_ids) >= self.vocab_size:
            raise RequestError("input_ids", f"token ids must be in [0, {self.vocab_size})")
        if len(input_ids) >= self.context_length:
            raise ContextLengthError(
                "prompt",
                f"the prompt has {len(input_ids)} tokens, the context length is {self.context_length} "
                f"(prompt + at least one new token must fit)",
            )
        self.pool_limits.check_prompt(len(input_ids))
        if self.chunked_prefill_size <= 0 and len(input_ids) > self.max_prefill_tokens:
            raise RequestError("prompt", f"the prompt has {len(input_ids)} tokens, over --max-prefill-tokens {self.max_prefill_tokens} (chunked prefill is off)")

    def validate_token_ids_logprob(self, ids: Sequence[int]) -> None:
        """Raise RequestError("token_ids_logprob") for more than MAX_TOKEN_IDS_LOGPROB ids or one outside the vocabulary."""
        vocab = self.vocab_size
        if len(ids) > MAX_TOKEN_IDS_LOGPROB:
            raise RequestError("token_ids_logprob", f"at most {MAX_TOKEN_IDS_LOGPROB} ids, got {len(ids)}")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise RequestError("token_ids_logprob", f"token ids must be integers in [0, {vocab}), got {t!r}")


def _tokens(n: int, noun: str = "token") -> str:
    """"1 token", "2 tokens": counts in user-facing messages read as English."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def tokenize_for_submit(engine: Any, prompt: str | Sequence[int], add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text (`RequestValidator.tokenize`), or a validated copy of a list of ids.

    Raises:
        RequestError: a list holding something other than integers (field "input_ids").
    """
    if isinstance(prompt, str):
        return engine.tokenize(prompt, add_special_tokens)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError("input_ids", "token ids must be integers")
    return list(prompt)


def check_submit(engine: Any, request: GenerateInput) -> CheckedInput:
    """`EngineLoop.submit`'s checks of a request, in the caller's thread, through the engine's read-only,
    thread-safe methods.

    A `max_new_tokens` absent from a dict `sampling_params` defaults to SGLang's 128, cut to what the
    context leaves; one given explicitly must fit the context. Either is then cut to what the KV pool
    holds for one request (`PoolLimits.fit`).

    Raises:
        SamplingParamsError: an invalid sampling parameter (names it).
        RequestError: empty or too long prompt, bad token ids (`tokenize_for_submit`), bad top_logprobs_num or logprob_start_len,
            an invalid regex / json_schema / ebnf (its field; compiled here, in the caller's thread).
    """
    sampling_params = request.sampling_params
    params = sampling_params if isinstance(sampling_params, SamplingParams) else SamplingParams.from_dict(sampling_params)
    explicit_max = isinstance(sampling_params, SamplingParams) or (sampling_params or {}).get("max_new_tokens") is not None
    input_ids = tokenize_for_submit(engine, request.prompt)
    if request.lora_path is not None:
        engine.validate_lora_path(request.lora_path)
    engine.validate_input_ids(input_ids, params.max_new_tokens)
    if params.logit_bias:
        engine.validate_logit_bias(params)
    if params.stop_token_ids:
        engine.validate_stop_token_ids(params)
    room = engine.context_length - len(input_ids)
    if params.max_new_tokens > room:
        if explicit_max:
            raise ContextLengthError(
                "max_new_tokens",
                f"the prompt has {_tokens(len(input_ids))} and {_tokens(params.max_new_tokens, 'new token')} "
                f"{'is' if params.max_new_tokens == 1 else 'are'} asked for: together over the context length "
                f"{engine.context_length}",
            )
        params = dataclasses.replace(params, max_new_tokens=room)
    top_logprobs_num = request.top_logprobs_num
    if not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise RequestError("top_logprobs_num", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs_num}")
    check_grammar(engine, params)
    engine.validate_token_ids_logprob(request.token_ids_logprob)
    if is_checked(request.return_logprob, top_logprobs_num):
        check_logprob_start_len(request.logprob_start_len, len(input_ids))
    return CheckedInput(request, input_ids, engine.pool_limits.fit(params, len(input_ids)))


def check_grammar(engine: Any, params: SamplingParams) -> None:
    """Compile the request's constraint now (the engine caches it) so that a bad one is a
    RequestError naming the field, not an aborted request later."""
    field = next((k for k in CONSTRAINT_FIELDS if getattr(params, k) is not None), None)
    compile_grammar = getattr(engine, "compile_grammar", None)
    if field is None or compile_grammar is None:
        return
    try:
        compile_grammar(params)
    except InvalidGrammarError as e:
        raise RequestError(field, str(e)) from None
