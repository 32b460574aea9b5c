"""Requests: `SamplingParams` (SGLang's fields and defaults), `Req` (one sequence's state) and `FinishReason`."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import re
from typing import Any, Literal

import numpy as np
import regex

from jaxserve.constrained import GrammarSpec
from jaxserve.engine.validation.errors import SamplingParamsError
from jaxserve.engine.validation.field_types import SAMPLING_FIELD_TYPES, first_type_error
from jaxserve.engine.validation.seed import check_seed

_INT_MAX = 2**31 - 1
# the valid range of an integer field, said when a value is past int32 (the other checks below agree)
_INT_RANGES = {
    "max_new_tokens": f"between 0 and {_INT_MAX}",
    "min_new_tokens": f"between 0 and {_INT_MAX}",
    "top_k": f"-1 (disabled) or between 1 and {_INT_MAX}",
    "stream_interval": f"between 1 and {_INT_MAX}",
}
# OpenAI's limits for logit_bias: at most 300 token ids, each biased by a value in [-100, 100].
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
MAX_N = 128  # sequences per request (OpenAI's limit for `n`); each one is a request in the scheduler
# SGLang's limits on stop_regex (MAX_STOP_REGEX_COUNT, MAX_STOP_REGEX_LEN in its sampling_params.py)
MAX_STOP_REGEX_COUNT = 32
MAX_STOP_REGEX_LEN = 256  # bytes of UTF-8


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Names and defaults follow SGLang's `SamplingParams`.

    `None` passed to `from_dict` means "the default". temperature 0 is greedy; top_k -1 and top_p 1
    disable those filters. Lengths are in tokens. `stop_regex`: patterns (Python `regex` syntax) that
    stop the request like stop strings. `stream_interval`: a stream sends an event every N tokens
    (None: every step). `sampling_seed` (SGLang's name) is accepted by `from_dict` as `seed`.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    choices: tuple[str, ...] | None = None
    stop_regex: tuple[str, ...] = ()
    spaces_between_special_tokens: bool = True
    stream_interval: int | None = None
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias); from_dict takes
    # OpenAI's {"token id": bias} object. Token ids are checked against the vocabulary by the engine.
    logit_bias: tuple[tuple[int, float], ...] | None = None

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> "SamplingParams":
        """Build and validate from a JSON-like dict (unknown keys raise).

        Raises:
            SamplingParamsError: a value is out of range or of the wrong type (names the field).
        """
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        if (problem := first_type_error(d)) is not None:  # the JSON types, as the HTTP routes word them
            raise SamplingParamsError(*problem, code="invalid_type")
        check_seed(d.get("sampling_seed"), "sampling_seed")  # named as given: validate sees it as seed
        check_seed(d.get("seed"))
        _check_logit_bias_keys(d.get("logit_bias"))
        alias = d.pop("sampling_seed", None)
        unknown = sorted(set(d) - names)
        if unknown:
            raise SamplingParamsError(unknown[0], "unknown sampling parameter", code="unknown_parameter")
        if alias is not None:
            if d.get("seed") is not None and d["seed"] != alias:
                raise SamplingParamsError("sampling_seed", f"is another name of seed; both given and different ({alias} != {d['seed']})")
            d["seed"] = alias
        kwargs = {k: v for k, v in d.items() if v is not None}
        for key in ("stop", "stop_regex"):
            if isinstance(kwargs.get(key), str):
                kwargs[key] = (kwargs[key],)
        for key in ("stop", "stop_token_ids", "choices", "stop_regex"):
            if key in kwargs:
                if not isinstance(kwargs[key], (list, tuple)):
                    raise SamplingParamsError(key, "must be a list", code="invalid_type")
                kwargs[key] = tuple(kwargs[key])
        if "logit_bias" in kwargs:
            kwargs["logit_bias"] = _logit_bias_pairs(kwargs["logit_bias"])
        params = SamplingParams(**kwargs)
        params.validate()
        return params

    def validate(self) -> None:
        """Raise `SamplingParamsError` naming the first invalid field (types: the table of
        `engine/validation/field_types.py`, the same message as from_dict and the HTTP routes)."""
        values = {name: getattr(self, name) for name in SAMPLING_FIELD_TYPES if hasattr(self, name)}
        if (problem := first_type_error(values)) is not None:
            raise SamplingParamsError(*problem, code="invalid_type")
        for name, value in values.items():
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _INT_MAX and name not in ("seed", "n"):
                raise SamplingParamsError(name, f"must be {_INT_RANGES.get(name, f'between -{_INT_MAX} and {_INT_MAX}')}, got {value}")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise SamplingParamsError(name, f"must be a finite number, got {getattr(self, name)}")
        if self.max_new_tokens < 0:
            raise SamplingParamsError("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise SamplingParamsError("min_new_tokens", f"must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise SamplingParamsError(
                "min_new_tokens", f"must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}"
            )
        if self.temperature < 0:
            raise SamplingParamsError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise SamplingParamsError("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        if not -2 <= self.frequency_penalty <= 2:
            raise SamplingParamsError("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise SamplingParamsError("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            raise SamplingParamsError("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if not 1 <= self.n <= MAX_N:
            raise SamplingParamsError("n", f"must be in [1, {MAX_N}], got {self.n}")
        for s in self.stop:
            if not isinstance(s, str):
                raise SamplingParamsError("stop", "must be strings", code="invalid_type")
            if s == "":
                raise SamplingParamsError("stop", "stop strings must not be empty")
            _check_unicode("stop", s)
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise SamplingParamsError("stop_token_ids", "must be non-negative integers")
        if self.stream_interval is not None:
            if self.stream_interval < 1:
                raise SamplingParamsError("stream_interval", f"must be >= 1, got {self.stream_interval}")
        _check_stop_regex(self.stop_regex)
        constraints = [k for k in ("regex", "json_schema", "ebnf", "choices") if getattr(self, k) is not None]
        if len(constraints) > 1:
            raise SamplingParamsError(constraints[1], f"only one of regex, json_schema, ebnf, choices may be set, got {constraints}")
        if self.choices is not None and (not self.choices or not all(isinstance(c, str) and c for c in self.choices)):
            raise SamplingParamsError("choices", "must be a non-empty list of non-empty strings")
        for key in ("regex", "ebnf", "json_schema"):  # a lone surrogate reached the grammar compiler's codec error
            if isinstance(getattr(self, key), str):
                _check_unicode(key, getattr(self, key))

        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise SamplingParamsError("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
            for token, bias in self.logit_bias:
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    raise SamplingParamsError("logit_bias", f"keys must be non-negative token ids, got {token!r}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                    raise SamplingParamsError("logit_bias", f"values must be numbers, got {bias!r} for token {token}")
                if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise SamplingParamsError("logit_bias", f"values must be in [-100, 100], got {bias} for token {token}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _check_unicode(name: str, text: str) -> None:
    """Refuse a lone UTF-16 surrogate (JSON's \\uXXXX escapes can carry one): no tokenizer or detokenized
    text can contain it, so it would silently never match (the prompt is refused the same way)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SamplingParamsError(
            name, f"{text!r} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}"
        ) from None


def _check_stop_regex(patterns: tuple[str, ...]) -> None:
    if len(patterns) > MAX_STOP_REGEX_COUNT:
        raise SamplingParamsError("stop_regex", f"at most {MAX_STOP_REGEX_COUNT} patterns, got {len(patterns)}")
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise SamplingParamsError("stop_regex", "must be non-empty strings")
        _check_unicode("stop_regex", p)
        if len(p.encode()) > MAX_STOP_REGEX_LEN:
            raise SamplingParamsError("stop_regex", f"a pattern may have at most {MAX_STOP_REGEX_LEN} bytes, got {len(p.encode())}")
        try:
            compiled = regex.compile(p)
        except (regex.error, RecursionError, OverflowError) as e:
            raise SamplingParamsError("stop_regex", f"invalid regex {p!r}: {e}") from None
        if compiled.search("") is not None:
            raise SamplingParamsError("stop_regex", f"{p!r} matches the empty string, so it would stop every request at once")
def _check_logit_bias_keys(value: Any) -> None:
    """Refuse a `logit_bias` object whose keys spell one token id twice ("028" and "28"): JSON keeps
    both, and one bias would silently replace the other. Other mistakes pass (`_logit_bias_pairs`
    names them)."""
    if not isinstance(value, dict):
        return
    seen: dict[int, str] = {}
    for key in value:
        if isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,10}", key):  # the keys read as ids
            token = int(key)
            if token in seen:
                raise SamplingParamsError("logit_bias", f"the keys {seen[token]!r} and {key!r} are the same token id "
                                          f"{token}; give each token once")
            seen[token] = key


def _logit_bias_pairs(value: Any) -> tuple[tuple[Any, Any], ...]:
    """OpenAI's {"token id": bias} (keys are strings in JSON; ints accepted) -> sorted (id, bias) pairs.

    Raises:
        SamplingParamsError: not an object, or a key that is not an integer.
    """
    if not isinstance(value, dict):
        raise SamplingParamsError("logit_bias", f"must be an object mapping token ids to biases, got {type(value).__name__}")
    pairs = []
    for key, bias in value.items():
        if isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,10}", key):
            token = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            token = key
        else:
            raise SamplingParamsError("logit_bias", f"keys must be integer token ids, got {key!r}")
        pairs.append((token, float(bias) if isinstance(bias, int) and not isinstance(bias, bool) else bias))
    return tuple(sorted(pairs, key=lambda p: p[0]))


def grammar_spec(params: SamplingParams) -> GrammarSpec | None:
    """The constraint of a request as a GrammarSpec, or None when it is unconstrained."""
    if params.regex is not None:
        return GrammarSpec.regex(params.regex)
    if params.json_schema is not None:
        return GrammarSpec.json_schema(params.json_schema)
    if params.ebnf is not None:
        return GrammarSpec.ebnf(params.ebnf)
    if params.choices is not None:
        return GrammarSpec.from_choices(list(params.choices))
    return None


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)  # identity: `req in running` must not compare every field (nor equate two requests)
class Req:
    """One sequence being served (host side).

    KV bookkeeping: `page_table` covers positions [0, kv_len); `kv_len` tokens of `fill_ids` have their
    K/V in the pool. `cached_tokens` is how many prompt tokens were reused from the prefix cache.
    """

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    token_ids_logprob: tuple[int, ...] = ()
    namespace: Any = None
    arrival_time: float = 0.0
    think_end_ids: tuple[int, ...] = ()  # non-empty: the grammar applies after these tokens (constrained/reasoner.py)

    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    page_table: list[int] = dataclasses.field(default_factory=list)
    kv_len: int = 0
    cached_tokens: int = 0
    last_node: Any = None
    num_retractions: int = 0
    seed: int = 0
    grammar: Any = None
    num_forced_tokens: int = 0
    draft_state: Any = None  # speculative decoding's acceptance history (speculative.policy.DraftState)

    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    output_token_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    output_token_ids_logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    input_token_logprobs: list[float | None] | None = None
    # per prompt position (None where not computed): its top-k (logprob, token_id) pairs, the
    # logprobs of token_ids_logprob (prompt_logprobs.py)
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_token_ids_logprobs: list[list[float] | None] | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Prompt + generated tokens: what must be in the KV cache before the next decode."""
        return self.input_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without concatenating prompt and output (start, end >= 0)."""
        n = len(self.input_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.input_ids[start:end] + (self.output_ids[: end - n] if end > n else [])

    @property
    def fill_len(self) -> int:
        """len(fill_ids) without building the list (the scheduler asks for it every step)."""
        return len(self.input_ids) + len(self.output_ids)

    @property
    def wants_input_logprobs(self) -> bool:
        """Prompt logprobs were asked for (`return_logprob` with `logprob_start_len >= 0`)."""
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def is_finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling_params.max_new_tokens - len(self.output_ids))


_rid_counter = itertools.count()


def new_rid() -> str:
    return f"{next(_rid_counter):x}-{np.random.randint(1 << 30):08x}"


@dataclasses.dataclass(frozen=True)
class FinishReason:
    """Why a request finished (SGLang's FINISH_MATCHED_TOKEN / _STR, FINISH_LENGTH, FINISH_ABORT).

    `kind`: "stop" (EOS, a stop token id, a stop string or regex), "length" (max_new_tokens or the
    room the context and the pool leave) or "abort". `matched`: with "stop", the token id or the
    string that matched (None: the grammar ended). `length`: with "length", the output tokens.
    `message`: with "abort", why. `status_code`: with an abort the engine (not the client) caused,
    the HTTP status of a non-streamed answer (500: an engine error, 503: shut down or queue timeout).
    The server writes it in SGLang's or OpenAI's words; the engine never builds their dicts.
    """

    kind: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None


def finish_stop(matched: int | str | None) -> FinishReason:
    """EOS, a stop token id or a stop string (`matched`; None when a grammar ended the output)."""
    return FinishReason("stop", matched=matched)


def finish_length(length: int) -> FinishReason:
    """The output reached `length` tokens, its bound."""
    return FinishReason("length", length=length)


def finish_abort(message: str, status_code: int | None = None) -> FinishReason:
    """Aborted, with why; `status_code` when the engine failed the request (see `FinishReason`)."""
    return FinishReason("abort", message=message, status_code=status_code)
