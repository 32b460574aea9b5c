"""HTTP errors in OpenAI's shape, for every endpoint (native and OpenAI alike):

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": "invalid_value"}}

Bad input is a 400 naming the field in `param`, whatever layer finds it: pydantic (wrong type,
missing field: not FastAPI's 422), `SamplingParamsError` / `RequestError` from the engine (value out
of range, prompt too long or empty), or the API layer (`APIError`). A 500 is left for real bugs.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

import pydantic
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from jaxserve.core.errors import RequestError, SamplingParamsError
from jaxserve.engine.engine_loop import EngineUnavailableError

# Hints for the mistakes new users make most, keyed by (where, field): "sampling_params" for a key
# inside /generate's sampling_params, "generate" for a top-level field of /generate. The unknown-field
# checks (pydantic's extra="forbid", SamplingParams.from_dict) name the field; `hint_for` adds these.
FIELD_HINTS: dict[tuple[str, str], str] = {
    ("sampling_params", "max_tokens"): "did you mean max_new_tokens? (max_tokens is the OpenAI API's name)",
    ("sampling_params", "stop_sequences"): "did you mean stop?",
    ("sampling_params", "stream"): "stream goes at the top level of the request, next to sampling_params",
    ("generate", "max_new_tokens"): 'max_new_tokens goes inside sampling_params: {"sampling_params": {"max_new_tokens": 16}}',
    ("generate", "max_tokens"): 'did you mean max_new_tokens? It goes inside sampling_params: {"sampling_params": {"max_new_tokens": 16}}',
    ("generate", "prompt"): "did you mean text? (prompt is the OpenAI completions API's name)",
    ("generate", "messages"): "/generate takes text or input_ids; chat messages go to /v1/chat/completions",
}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "stop", "seed", "n", "frequency_penalty",
                    "presence_penalty", "repetition_penalty", "ignore_eos", "regex", "json_schema")
FIELD_HINTS.update({("generate", f): f"{f} goes inside sampling_params" for f in _SAMPLING_FIELDS})


def hint_for(where: str, field: str) -> str | None:
    """The hint for an unknown `field` (FIELD_HINTS), or None."""
    return FIELD_HINTS.get((where, field))


_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the API returns as-is. `param` names the offending request field (None when none)."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code


def error_body(message: str, status_code: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object. `type` follows the status (invalid_request_error for 400, ...)."""
    err_type = _TYPE_OF_STATUS.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class ErrorJSONResponse(JSONResponse):
    """A JSON error body in ASCII, non-ASCII characters as \\u escapes: a message quoting the client's
    value can carry a lone surrogate (valid in JSON text, not encodable as UTF-8), which JSONResponse's
    UTF-8 rendering turned into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(message: str, status_code: int = 400, param: str | None = None, code: str | None = None) -> JSONResponse:
    return ErrorJSONResponse(error_body(message, status_code, param, code), status_code=status_code)


def from_engine_error(e: RequestError, rename: Mapping[str, str] | None = None) -> APIError:
    """The 400 of a request check's error (the one place a `RequestError` becomes a body; its code is
    the error's own). `rename` maps engine field names to the API's (max_new_tokens -> max_tokens for
    OpenAI requests, for instance), in `param` and, for names with an underscore (identifiers, not
    words like "prompt"), in the message too."""
    field = (rename or {}).get(e.field, e.field)
    message = str(e)
    if isinstance(e, SamplingParamsError):  # its message starts with the engine's field name
        message = f"{field}: {message.split(': ', 1)[-1]}"
        if e.code == "unknown_parameter" and (hint := hint_for("sampling_params", field)) is not None:
            message += f"; {hint}"
    elif message.startswith("must "):  # a bare predicate ("must be in [0, 20], got 25"): say whose
        message = f"{field}: {message}"
    for engine_name, api_name in (rename or {}).items():
        if "_" in engine_name:  # a field name, not a word: "must be <= max_new_tokens" -> "<= max_tokens"
            message = re.sub(rf"\b{engine_name}\b", api_name, message)
    return APIError(message, 400, param=field, code=e.code)


def from_validation_error(e: pydantic.ValidationError) -> APIError:
    """A 400 naming the first invalid field (e.g. `messages[0].content`), pydantic's message included.
    Of a union field's errors (one per member tried), the one furthest into the value names the field
    (by its list indices, then its depth): for `input_ids` [[1, 2], [3, 1.5]] that is list[list[int]]'s
    `input_ids[1][1]`, not list[int]'s `input_ids[0]`; for `prompt` [1, true], `prompt[1]`."""
    errors = e.errors(include_url=False)
    first = errors[0].get("loc", ())[:1]
    if not first:  # an error of the whole body: a key that is not a valid string (a lone surrogate)
        return APIError(f"request body: {errors[0].get('msg', 'invalid value')}", 400, code="invalid_value")

    def progress(x) -> tuple:
        loc = x.get("loc", ())
        return tuple(p for p in loc if isinstance(p, int)), len(loc)

    err = max((x for x in errors if x.get("loc", ())[:1] == first), key=progress)
    loc = err.get("loc", ())
    param = _loc_to_param(loc)
    kind = err.get("type", "")
    # a union field reports one error per member it tried: name the members instead
    is_union = len(loc) > 1 and isinstance(loc[-1], str) and _loc_to_param(loc[:-1]) == param
    members = [x["loc"][len(loc) - 1] for x in errors if len(x["loc"]) >= len(loc) and x["loc"][: len(loc) - 1] == loc[:-1]]
    if is_union and len(members) > 1:
        # a string that a Literal member refuses has the right type and a wrong value: say the values
        literal = next((x for x in errors if x["loc"][: len(loc) - 1] == loc[:-1] and x.get("type") == "literal_error"
                        and isinstance(x.get("input"), str)), None)
        if literal is not None:
            return APIError(f"{param}: {literal['msg']}", 400, param=param, code="invalid_value")
        expected = ", ".join(dict.fromkeys(members))
        return APIError(f"{param}: has the wrong type; expected one of: {expected}", 400, param=param, code="invalid_type")
    if kind == "extra_forbidden" and isinstance(loc[-1], str):
        # the last part is the key as sent, never a union member: named whatever it looks like ("Text",
        # "", "a b"; quoted where it is no identifier)
        key, parent = loc[-1], _loc_to_param(loc[:-1])
        param = f"{parent}.{key}" if parent else key
        hint = hint_for("generate", key) if len(loc) == 1 else None
        shown = param if key.isidentifier() else json.dumps(param)
        return APIError(f"{shown}: unknown field" + (f"; {hint}" if hint else ""), 400, param=param, code="unknown_parameter")
    if param is None:
        return APIError(err.get("msg", "invalid request"), 400, code="invalid_type")
    if kind == "missing":
        return APIError(f"{param}: field required", 400, param=param, code="missing_required_parameter")
    return APIError(f"{param}: {err.get('msg', 'invalid value')}", 400, param=param, code="invalid_type")


def _loc_to_param(loc: tuple) -> str | None:
    """('messages', 0, 'content', 'str') -> 'messages[0].content'. Pydantic adds the member of a
    union it tried (`str`, `list[int]`, `function-after[...]`, a model class `NamedToolChoice`) to the
    path: those parts are dropped (field names are lower-case identifiers; union members contain
    brackets, are type names or are class names)."""
    type_names = {"str", "int", "float", "bool", "list", "dict", "none"}
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in type_names and not part[0].isupper():
            out += f".{part}" if out else part
    return out or None


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Parse a request body as a JSON object. Raises APIError (400) for an empty or malformed body
    or one that is not an object."""
    if not raw.strip():
        raise APIError("the request body is empty; send a JSON object", 400, code="invalid_json")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", 400, code="invalid_json") from None
    except ValueError:  # Python reads no integer of over 4300 digits (sys.get_int_max_str_digits)
        raise APIError("the request body has a number too long to read (over 4300 digits)", 400, code="invalid_json") from None
    except RecursionError:
        raise APIError("the request body is nested too deeply", 400, code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}", 400, code="invalid_json")
    if _MAYBE_SURROGATE.search(raw):
        _refuse_lone_surrogates(body)
    return body


# What a lone surrogate can come from: a \uD800-\uDFFF escape, a surrogate's UTF-8 bytes (json.loads
# decodes bytes with "surrogatepass"), or a UTF-16/32 body (it has NUL bytes, UTF-8 JSON none). A
# body without any of them (nearly every one) is not walked.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]|\x00")


def _refuse_lone_surrogates(body: dict[str, Any]) -> None:
    """A 400 naming a string, or key, of the body that holds a lone UTF-16 surrogate (legal JSON as a
    \\udcff escape, but no text). Checked here, before any route reads the body, because every string
    a route echoes or stores (rid, metadata, names, ids, ...) is written out as UTF-8, which cannot
    carry one: that was a 500, or a stream cut off mid-body after the request had started (its rid
    left in use), or a stored response that no GET could render."""
    stack: list[tuple[Any, tuple]] = [(body, ())]
    while stack:
        value, loc = stack.pop()
        if isinstance(value, str):
            _check_text(value, loc, "the text")
        elif isinstance(value, dict):
            for key in value:
                _check_text(key, (*loc, key), "the key")
            stack.extend((item, (*loc, key)) for key, item in reversed(value.items()) if isinstance(item, (str, dict, list)))
        elif isinstance(value, list):
            stack.extend((item, (*loc, i)) for i, item in reversed(list(enumerate(value))) if isinstance(item, (str, dict, list)))


def _check_text(text: str, loc: tuple, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if i else p for i, p in enumerate(loc))
        shown = param if all(isinstance(p, int) or p.isidentifier() for p in loc) else json.dumps(param)
        raise APIError(f"{shown}: {what} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character "
                       f"{e.start} (a \\uD800-\\uDFFF escape must be half of a pair)", 400, param=param,
                       code="invalid_value") from None


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.message, exc.status_code, exc.param, exc.code)


async def _engine_error(request: Request, exc: Exception) -> JSONResponse:
    err = from_engine_error(exc)  # type: ignore[arg-type]
    return error_response(err.message, err.status_code, err.param, err.code)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    err = from_validation_error(exc)  # type: ignore[arg-type]
    return error_response(err.message, err.status_code, err.param, err.code)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    message = exc.detail
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405 and exc.headers and exc.headers.get("Allow"):
        message = f"{request.method} {request.url.path} is not allowed: use {' or '.join(sorted(exc.headers['Allow'].split(', ')))}"
    return ErrorJSONResponse(error_body(message, exc.status_code), status_code=exc.status_code, headers=exc.headers)


def unavailable_response(message: str, retry_after_s: int | None = None) -> JSONResponse:
    """503 `unavailable`, with a Retry-After header (seconds) when retrying later can help."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return ErrorJSONResponse(error_body(message, 503, code="unavailable"), status_code=503, headers=headers)


async def _unavailable_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EngineUnavailableError)
    return unavailable_response(str(exc), exc.retry_after_s)


# nginx's code for "the client closed the request": the access log's status of a request whose client
# left before its body arrived or before its non-streamed reply was sent (nobody reads the response)
CLIENT_CLOSED_REQUEST = 499


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client disconnected while sending the body: nothing was submitted, nothing to answer, and not
    a server error (no 500, no traceback in the log)."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises the exception after this response, uvicorn logs its traceback and closes the
    # connection: `Connection: close` tells a keep-alive client not to send its next request on it
    response = error_response(f"internal server error: {type(exc).__name__}: {exc}", 500, code="internal_error")
    response.headers["Connection"] = "close"
    return response


EXCEPTION_HANDLERS = {
    APIError: _api_error,
    RequestError: _engine_error,  # SamplingParamsError and ContextLengthError too
    pydantic.ValidationError: _validation_error,
    HTTPException: _http_error,
    EngineUnavailableError: _unavailable_error,
    ClientDisconnect: _client_gone,
    Exception: _internal_error,
}
