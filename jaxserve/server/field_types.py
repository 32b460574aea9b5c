"""The JSON types of the sampling fields every generation route takes, with one wording for a wrong one.

`/generate` (in `sampling_params`), `/v1/completions` and `/v1/chat/completions` (at the top level)
check these fields here before their own validation (the engine's `SamplingParams.from_dict`, the
OpenAI routes' pydantic models), so that the same wrong value gets the same 400 on every route:

    {"message": "seed: must be an integer, got true (a boolean)", "param": "seed", "code": "invalid_type"}

Before, the OpenAI routes answered with pydantic's text ("Input should be a valid integer") and
/generate with the engine's ("must be a number, got True"). The table holds each API's names (the
OpenAI `max_tokens` and the native `max_new_tokens`); a JSON null passes (it means the default).
Ranges stay with the engine (`SamplingParams.validate`) and `request_checks`.
"""

from __future__ import annotations

import enum
import json
from typing import Any, Mapping

from jaxserve.server.errors import APIError


class FieldType(enum.Enum):
    """A field's JSON type; the value is how the message says it."""

    INTEGER = "an integer"
    NUMBER = "a number"
    BOOLEAN = "a boolean"
    STRING_OR_STRINGS = "a string or a list of strings"
    INTEGERS = "a list of integers"


_INTEGER_FIELDS = ("seed", "sampling_seed", "n", "max_tokens", "max_completion_tokens", "max_new_tokens",
                   "min_tokens", "min_new_tokens", "top_k")
_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_BOOLEAN_FIELDS = ("ignore_eos", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens")

SAMPLING_FIELD_TYPES: dict[str, FieldType] = {
    **dict.fromkeys(_INTEGER_FIELDS, FieldType.INTEGER),
    **dict.fromkeys(_NUMBER_FIELDS, FieldType.NUMBER),
    **dict.fromkeys(_BOOLEAN_FIELDS, FieldType.BOOLEAN),
    "stop": FieldType.STRING_OR_STRINGS,
    "stop_token_ids": FieldType.INTEGERS,
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not 1


def _matches(value: Any, expected: FieldType) -> bool:
    if expected is FieldType.INTEGER:
        return _is_int(value)
    if expected is FieldType.NUMBER:
        return _is_int(value) or isinstance(value, float)
    if expected is FieldType.BOOLEAN:
        return isinstance(value, bool)
    if expected is FieldType.STRING_OR_STRINGS:
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))
    return isinstance(value, list) and all(_is_int(t) for t in value)


_JSON_TYPE_NAMES = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                    (list, "a list"), (dict, "an object"))


def describe(value: Any, max_chars: int = 40) -> str:
    """`value` as the client wrote it (JSON, cut to `max_chars` characters) and its JSON type:
    'true (a boolean)', '"5" (a string)'."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    if len(text) > max_chars:
        text = text[: max_chars - 3] + "..."
    kind = next((name for t, name in _JSON_TYPE_NAMES if isinstance(value, t)), type(value).__name__)
    return f"{text} ({kind})"


def check_field_types(values: Mapping[str, Any], types: Mapping[str, FieldType] = SAMPLING_FIELD_TYPES) -> None:
    """Refuse the first field of `values` (a request body or a `sampling_params` object) whose value
    has the wrong JSON type for `types`; fields not in `types`, and nulls, pass.

    Raises:
        APIError: 400 naming the field, code invalid_type ("seed: must be an integer, got true (a boolean)").
    """
    for name, expected in types.items():
        value = values.get(name)
        if value is not None and not _matches(value, expected):
            raise APIError(f"{name}: must be {expected.value}, got {describe(value)}", 400, param=name,
                           code="invalid_type")
