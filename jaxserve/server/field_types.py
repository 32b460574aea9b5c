"""The sampling fields' JSON types on every generation route, with one wording for a wrong one.

`/generate` (in `sampling_params`), `/v1/completions` and `/v1/chat/completions` (at the top level)
check these fields here before their own validation (the OpenAI routes' pydantic models would answer
with pydantic's text, "Input should be a valid integer"), so that the same wrong value gets the same
400 on every route:

    {"message": "seed: must be an integer, got true (a boolean)", "param": "seed", "code": "invalid_type"}

The table is the engine's (`jaxserve/engine/validation/field_types.py`, which `SamplingParams` checks with, so
the in-process engine says the same), plus the OpenAI names of its fields (`max_tokens` for
`max_new_tokens`, ...). A JSON null passes (it means the default). Ranges stay with the engine
(`SamplingParams.validate`) and `request_checks`.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxserve.engine.validation.field_types import SAMPLING_FIELD_TYPES as NATIVE_FIELD_TYPES
from jaxserve.engine.validation.field_types import FieldType, describe, first_type_error
from jaxserve.server.errors import APIError

__all__ = ["FieldType", "NATIVE_FIELD_TYPES", "SAMPLING_FIELD_TYPES", "check_field_types", "describe"]

# the OpenAI routes' names of native fields (openai_api.sampling_params_of maps them)
OPENAI_NAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}

# the OpenAI routes take json_schema as JSON text or as an object (their request model types it), so
# it is not in their table; /generate's is SGLang's string
SAMPLING_FIELD_TYPES: dict[str, FieldType] = {
    **{name: t for name, t in NATIVE_FIELD_TYPES.items() if name != "json_schema"},
    **{name: NATIVE_FIELD_TYPES[native] for name, native in OPENAI_NAMES.items()},
}


def check_field_types(values: Mapping[str, Any], types: Mapping[str, FieldType] = SAMPLING_FIELD_TYPES) -> None:
    """Refuse the first field of `values` (a request body or a `sampling_params` object) whose value
    has the wrong JSON type for `types`; fields not in `types`, and nulls, pass.

    Raises:
        APIError: 400 naming the field, code invalid_type ("seed: must be an integer, got true (a boolean)").
    """
    if (problem := first_type_error(values, types)) is not None:
        name, message = problem
        raise APIError(f"{name}: {message}", 400, param=name, code="invalid_type")
