"""`SamplingParams`: how to sample one request (SGLang's fields and defaults), and the checks of their
values: SGLang's and OpenAI's limits, each refusal a `SamplingParamsError` naming the field. The JSON
types are field_types.py's table; the sizes of stop strings are size_limits.py's; `validate` checks both,
once per request.

The seed (`seed`, and SGLang's `sampling_seed`): OpenAI's published API schema and vLLM's request
models bound it to a signed 64-bit integer; SGLang does not bound it. jaxserve accepts that range, on
every route and in-process, so no client that follows OpenAI's schema is refused. The sampler keys its
random stream with a uint32 (`runner/sampler.py`: `fold_in(fold_in(key(0), seed mod 2**32), step)`),
so a seed is honoured mod 2**32: -1 draws as 4294967295, and two seeds that differ by a multiple of
2**32 draw the same tokens. Sequence i of `n` uses seed + i (mod 2**32 as well). -1 is an ordinary
seed, not "random" (llama.cpp's meaning): leave the field out for a random one.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import regex

from jaxserve.core.errors import SamplingParamsError
from jaxserve.core.field_types import SAMPLING_FIELD_TYPES, describe, first_type_error
from jaxserve.core.size_limits import check_stop_sizes

SEED_MIN = -(2**63)  # OpenAI's schema and vLLM: a signed 64-bit integer
SEED_MAX = 2**63 - 1
SAMPLER_SEED_MODULUS = 2**32  # runner/sampler.py reduces each seed to a uint32


def check_seed(value: Any, field: str = "seed") -> None:
    """Refuse an integer seed outside [SEED_MIN, SEED_MAX]; None and non-integers pass (the type
    check names a wrong type).

    Raises:
        SamplingParamsError: naming `field` (`seed` or `sampling_seed`), code invalid_value.
    """
    if isinstance(value, int) and not isinstance(value, bool) and not SEED_MIN <= value <= SEED_MAX:
        raise SamplingParamsError(field, f"must be a 64-bit signed integer, in [-2**63, 2**63 - 1], got {value}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Names and defaults follow SGLang's `SamplingParams`.

    `max_new_tokens` None: not given, so the request's route decides (`GenerateInput.default_max_new_tokens`:
    SGLang's 128 on /generate, OpenAI's 16 on /v1/completions, the context's room on chat); a value given
    must fit the context. temperature 0 is greedy; top_k -1 and top_p 1 disable those filters. Lengths
    are in tokens. `stop_regex`: patterns (Python `regex` syntax) that stop the request like stop
    strings. `stream_interval`: a stream sends an event every N tokens (None: every step).
    `sampling_seed` (SGLang's name) is accepted by `from_dict` as `seed`.

    Built from JSON (`from_dict`, or an OpenAI route's fields) or in code, it takes the forms JSON has: a
    string `stop` / `stop_regex` is one stop (not its characters), lists become tuples, and OpenAI's
    {"token id": bias} object becomes sorted `logit_bias` pairs. It is checked once per request, types and
    values, by `validate` (the request's one check calls it).

    Raises:
        SamplingParamsError: a `logit_bias` object whose keys are no token ids (or spell one twice).
    """

    max_new_tokens: int | None = None
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

    def __post_init__(self) -> None:
        for name in ("stop", "stop_regex"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))
        for name in ("stop", "stop_token_ids", "stop_regex", "choices"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.logit_bias, dict):
            check_logit_bias_keys(self.logit_bias)
            object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))
        elif isinstance(self.logit_bias, (list, tuple)) and all(_is_pair(p) for p in self.logit_bias):
            # pairs given in code: sorted by token id, as the sampler and the vocabulary check read them
            object.__setattr__(self, "logit_bias", tuple(sorted((tuple(p) for p in self.logit_bias), key=lambda p: p[0])))

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> "SamplingParams":
        """Build from SGLang's JSON-like dict (None values mean the default): unknown fields are refused,
        `sampling_seed` becomes `seed`, lists become tuples and OpenAI's {"token id": bias} object becomes
        `logit_bias` pairs. Nothing else is checked here: a value of the wrong type is kept as it is, for
        `validate` to name (the request's one check runs it).

        Raises:
            SamplingParamsError: an unknown field, a `sampling_seed` that is no integer or differs from
                `seed`, a `logit_bias` that is no object of token ids.
        """
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        alias = d.pop("sampling_seed", None)
        if alias is not None and (not isinstance(alias, int) or isinstance(alias, bool)):
            raise SamplingParamsError("sampling_seed", f"must be an integer, got {describe(alias)}", code="invalid_type")
        check_seed(alias, "sampling_seed")  # named as given: validate sees it as seed
        unknown = sorted(set(d) - names)
        if unknown:
            raise SamplingParamsError(unknown[0], "unknown sampling parameter", code="unknown_parameter")
        if alias is not None:
            if d.get("seed") is not None and d["seed"] != alias:
                raise SamplingParamsError("sampling_seed", f"is another name of seed; both given and different ({alias} != {d['seed']})")
            d["seed"] = alias
        kwargs = {k: v for k, v in d.items() if v is not None}
        if "logit_bias" in kwargs and not isinstance(kwargs["logit_bias"], dict):
            logit_bias_pairs(kwargs["logit_bias"])  # raises: JSON's logit_bias is an object
        return SamplingParams(**kwargs)

    def validate(self) -> None:
        """Raise `SamplingParamsError` naming the first invalid field: its JSON type first (the one table,
        core/field_types.py, worded as every route words it), then its value (ranges, lengths, stop strings
        and regexes, logit_bias; `check_values`). The request's one check calls it, once per request."""
        values = {name: getattr(self, name) for name in SAMPLING_FIELD_TYPES if name in _FIELD_NAMES}
        if (problem := first_type_error(values)) is not None:
            raise SamplingParamsError(*problem, code="invalid_type")
        check_values(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


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
_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "seed", "stream_interval")


def check_values(params: SamplingParams) -> None:
    """Raise `SamplingParamsError` naming the first invalid value of `params`."""
    for name in _INT_FIELDS:
        value = getattr(params, name)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _INT_MAX and name not in ("seed", "n"):
            raise SamplingParamsError(name, f"must be {_INT_RANGES.get(name, f'between -{_INT_MAX} and {_INT_MAX}')}, got {value}")
    check_seed(params.seed)
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if not math.isfinite(getattr(params, name)):
            raise SamplingParamsError(name, f"must be a finite number, got {getattr(params, name)}")
    if params.max_new_tokens is not None and params.max_new_tokens < 0:
        raise SamplingParamsError("max_new_tokens", f"must be >= 0, got {params.max_new_tokens}")
    if params.min_new_tokens < 0:
        raise SamplingParamsError("min_new_tokens", f"must be >= 0, got {params.min_new_tokens}")
    if params.max_new_tokens is not None and params.min_new_tokens > params.max_new_tokens:
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
    if params.choices is not None and not isinstance(params.choices, tuple):
        raise SamplingParamsError("choices", "must be a list", code="invalid_type")
    if params.choices is not None and (not params.choices or not all(isinstance(c, str) and c for c in params.choices)):
        raise SamplingParamsError("choices", "must be a non-empty list of non-empty strings")
    for key in ("regex", "ebnf", "json_schema"):  # a lone surrogate reached the grammar compiler's codec error
        if isinstance(getattr(params, key), str):
            _check_unicode(key, getattr(params, key))

    if params.logit_bias is not None:
        if not isinstance(params.logit_bias, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in params.logit_bias):
            raise SamplingParamsError("logit_bias", "must map token ids to biases: an object, or (token id, bias) pairs")
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


def _is_pair(p: Any) -> bool:
    """A (token id, bias) pair whose id sorts (the rest is `check_values`')."""
    return isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], int)


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
