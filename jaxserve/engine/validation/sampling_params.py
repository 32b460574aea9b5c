"""The value checks of `SamplingParams` (ranges, lengths, stop strings and regexes, logit_bias): SGLang's
and OpenAI's limits, each refusal a `SamplingParamsError` naming the field. `SamplingParams.validate`
and `from_dict` call them; types are field_types.py's, the seed's range seed.py's.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import regex

from jaxserve.engine.validation.errors import SamplingParamsError
from jaxserve.engine.validation.field_types import SAMPLING_FIELD_TYPES, first_type_error
from jaxserve.engine.validation.size_limits import check_stop_sizes

if TYPE_CHECKING:
    from jaxserve.engine.request import SamplingParams

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


def validate_sampling_params(params: SamplingParams) -> None:
    """Raise `SamplingParamsError` naming the first invalid field of `params` (types: the table of
    field_types.py, the same message as from_dict and the HTTP routes)."""
    values = {name: getattr(params, name) for name in SAMPLING_FIELD_TYPES if hasattr(params, name)}
    if (problem := first_type_error(values)) is not None:
        raise SamplingParamsError(*problem, code="invalid_type")
    for name, value in values.items():
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _INT_MAX and name not in ("seed", "n"):
            raise SamplingParamsError(name, f"must be {_INT_RANGES.get(name, f'between -{_INT_MAX} and {_INT_MAX}')}, got {value}")
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if not math.isfinite(getattr(params, name)):
            raise SamplingParamsError(name, f"must be a finite number, got {getattr(params, name)}")
    if params.max_new_tokens < 0:
        raise SamplingParamsError("max_new_tokens", f"must be >= 0, got {params.max_new_tokens}")
    if params.min_new_tokens < 0:
        raise SamplingParamsError("min_new_tokens", f"must be >= 0, got {params.min_new_tokens}")
    if params.min_new_tokens > params.max_new_tokens:
        raise SamplingParamsError(
            "min_new_tokens", f"must be <= max_new_tokens ({params.max_new_tokens}), got {params.min_new_tokens}"
        )
    if params.temperature < 0:
        raise SamplingParamsError("temperature", f"must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise SamplingParamsError("top_p", f"must be in (0, 1], got {params.top_p}")
    if not 0 <= params.min_p <= 1:
        raise SamplingParamsError("min_p", f"must be in [0, 1], got {params.min_p}")
    if params.top_k == 0 or params.top_k < -1:
        raise SamplingParamsError("top_k", f"must be -1 (disabled) or >= 1, got {params.top_k}")
    if not -2 <= params.frequency_penalty <= 2:
        raise SamplingParamsError("frequency_penalty", f"must be in [-2, 2], got {params.frequency_penalty}")
    if not -2 <= params.presence_penalty <= 2:
        raise SamplingParamsError("presence_penalty", f"must be in [-2, 2], got {params.presence_penalty}")
    if not 0 < params.repetition_penalty <= 2:
        raise SamplingParamsError("repetition_penalty", f"must be in (0, 2], got {params.repetition_penalty}")
    if not 1 <= params.n <= MAX_N:
        raise SamplingParamsError("n", f"must be in [1, {MAX_N}], got {params.n}")
    check_stop_sizes(params.stop)  # how many and how long: size_limits.py
    for s in params.stop:
        if not isinstance(s, str):
            raise SamplingParamsError("stop", "must be strings", code="invalid_type")
        if s == "":
            raise SamplingParamsError("stop", "stop strings must not be empty")
        _check_unicode("stop", s)
    for t in params.stop_token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise SamplingParamsError("stop_token_ids", "must be non-negative integers")
    if params.stream_interval is not None:
        if params.stream_interval < 1:
            raise SamplingParamsError("stream_interval", f"must be >= 1, got {params.stream_interval}")
    _check_stop_regex(params.stop_regex)
    constraints = [k for k in ("regex", "json_schema", "ebnf", "choices") if getattr(params, k) is not None]
    if len(constraints) > 1:
        raise SamplingParamsError(constraints[1], f"only one of regex, json_schema, ebnf, choices may be set, got {constraints}")
    if params.choices is not None and (not params.choices or not all(isinstance(c, str) and c for c in params.choices)):
        raise SamplingParamsError("choices", "must be a non-empty list of non-empty strings")
    for key in ("regex", "ebnf", "json_schema"):  # a lone surrogate reached the grammar compiler's codec error
        if isinstance(getattr(params, key), str):
            _check_unicode(key, getattr(params, key))

    if params.logit_bias is not None:
        if len(params.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(params.logit_bias)}")
        for token, bias in params.logit_bias:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise SamplingParamsError("logit_bias", f"keys must be non-negative token ids, got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise SamplingParamsError("logit_bias", f"values must be numbers, got {bias!r} for token {token}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise SamplingParamsError("logit_bias", f"values must be in [-100, 100], got {bias} for token {token}")


def _check_unicode(name: str, text: str) -> None:
    """Refuse a lone UTF-16 surrogate (JSON's \\uXXXX escapes can carry one): no tokenizer or detokenized
    text can contain it, so it would silently never match (the prompt is refused the same way)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SamplingParamsError(
            name, f"{text!r} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}"
        ) from None


STOP_REGEX_CHECK_TIMEOUT_S = 0.05  # the check's one search, on the empty string

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
            # bounded: "(?R)" recurses on the empty string until MemoryError
            matches_empty = compiled.search("", timeout=STOP_REGEX_CHECK_TIMEOUT_S) is not None
        except (regex.error, RecursionError, OverflowError) as e:
            raise SamplingParamsError("stop_regex", f"invalid regex {p!r}: {e}") from None
        except (MemoryError, TimeoutError):
            raise SamplingParamsError("stop_regex", f"{p!r} cannot be searched: it takes over "
                                      f"{STOP_REGEX_CHECK_TIMEOUT_S * 1000:g} ms on the empty string") from None
        if matches_empty:
            raise SamplingParamsError("stop_regex", f"{p!r} matches the empty string, so it would stop every request at once")


def check_logit_bias_keys(value: Any) -> None:
    """Refuse a `logit_bias` object whose keys spell one token id twice ("028" and "28"): JSON keeps
    both, and one bias would silently replace the other. Other mistakes pass (`logit_bias_pairs`
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


def logit_bias_pairs(value: Any) -> tuple[tuple[Any, Any], ...]:
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
