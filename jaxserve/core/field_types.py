"""The JSON types of the sampling fields, with one wording for a wrong one: the one table that both
`SamplingParams` (its `from_dict` and `validate`) and the HTTP routes check types with, so a wrong type
reads the same wherever it is found:

    seed: must be an integer, got true (a boolean)

Names are SGLang's `SamplingParams` names (`SAMPLING_FIELD_TYPES`, /generate's `sampling_params`);
`OPENAI_FIELD_TYPES` adds the OpenAI routes' names of them (`max_tokens` for `max_new_tokens`, ...).
The routes check a body with `check_field_types` before their request models (whose pydantic wording,
"Input should be a valid integer", would differ). A None passes (it means the default). Ranges and
values (empty strings, vocabulary ids) stay with `SamplingParams.validate`.
"""

from __future__ import annotations

import enum
import json
import numbers
from typing import Any, Mapping

from jaxserve.core.errors import SamplingParamsError


class FieldType(enum.Enum):
    """A field's JSON type; the value is how the message says it."""

    INTEGER = "an integer"
    NUMBER = "a number"
    BOOLEAN = "a boolean"
    STRING = "a string"
    STRING_OR_STRINGS = "a string or a list of strings"
    INTEGERS = "a list of integers"


_INTEGER_FIELDS = ("seed", "sampling_seed", "n", "max_new_tokens", "min_new_tokens", "top_k", "stream_interval")
_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_BOOLEAN_FIELDS = ("ignore_eos", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens")
# the grammar fields: SGLang 0.5.23's SamplingParams types them Optional[str] (json_schema too: JSON
# text, not an object; structural_tag is refused by the field table before types are checked)
GRAMMAR_FIELDS = ("regex", "ebnf", "json_schema", "structural_tag")

SAMPLING_FIELD_TYPES: dict[str, FieldType] = {
    **dict.fromkeys(_INTEGER_FIELDS, FieldType.INTEGER),
    **dict.fromkeys(_NUMBER_FIELDS, FieldType.NUMBER),
    **dict.fromkeys(_BOOLEAN_FIELDS, FieldType.BOOLEAN),
    **dict.fromkeys(GRAMMAR_FIELDS, FieldType.STRING),
    "stop": FieldType.STRING_OR_STRINGS,
    "stop_regex": FieldType.STRING_OR_STRINGS,
    "stop_token_ids": FieldType.INTEGERS,
}


def _is_int(v: Any) -> bool:
    # JSON true is not 1; a numpy integer (research code's) is an integer
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _matches(value: Any, expected: FieldType) -> bool:
    if expected is FieldType.INTEGER:
        return _is_int(value)
    if expected is FieldType.NUMBER:
        return _is_int(value) or (isinstance(value, numbers.Real) and not isinstance(value, bool))
    if expected is FieldType.BOOLEAN:
        return isinstance(value, bool)
    if expected is FieldType.STRING:
        return isinstance(value, str)
    # tuples: a built SamplingParams holds its lists as tuples
    if expected is FieldType.STRING_OR_STRINGS:
        return isinstance(value, str) or (isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value))
    return isinstance(value, (list, tuple)) and all(_is_int(t) for t in value)


# the OpenAI routes' names of native fields (openai.chat_completions.sampling_params_of maps them)
OPENAI_NAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}

# the OpenAI routes take json_schema as JSON text or as an object (their request model types it), so
# it is not in their table; /generate's is SGLang's string
OPENAI_FIELD_TYPES: dict[str, FieldType] = {
    **{name: t for name, t in SAMPLING_FIELD_TYPES.items() if name != "json_schema"},
    **{name: SAMPLING_FIELD_TYPES[native] for name, native in OPENAI_NAMES.items()},
}


_JSON_TYPE_NAMES = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                    ((list, tuple), "a list"), (dict, "an object"))


def describe(value: Any, max_chars: int = 40) -> str:
    """`value` as the client wrote it (JSON, cut to `max_chars` characters) and its JSON type:
    'true (a boolean)', '"5" (a string)'."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    if len(text) > max_chars:
        text = text[: max_chars - 3] + "..."
    kind = next((name for t, name in _JSON_TYPE_NAMES if isinstance(value, t)), type(value).__name__)
    return f"{text} ({kind})"


def first_type_error(values: Mapping[str, Any], types: Mapping[str, FieldType] = SAMPLING_FIELD_TYPES) -> tuple[str, str] | None:
    """(field, message after "field: ") of the first field of `values` whose value has the wrong JSON
    type for `types`, e.g. ("seed", "must be an integer, got true (a boolean)"); None when all match.
    Fields not in `types`, and None values, pass."""
    for name, expected in types.items():
        value = values.get(name)
        if value is not None and not _matches(value, expected):
            return name, f"must be {expected.value}, got {describe(value)}"
    return None


def check_field_types(values: Mapping[str, Any], types: Mapping[str, FieldType]) -> None:
    """Refuse the first field of `values` (a request body or a `sampling_params` object) whose value
    has the wrong JSON type for `types`; fields not in `types`, and None, pass.

    Raises:
        SamplingParamsError: naming the field, code invalid_type ("seed: must be an integer, got true
            (a boolean)").
    """
    if (problem := first_type_error(values, types)) is not None:
        raise SamplingParamsError(*problem, code="invalid_type")
