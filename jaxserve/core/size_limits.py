"""Bounds on the size of a request's fields: how long an id or a stop string may be, how many stop
strings, tools or metadata pairs a request may carry. One table, each bound with its source: OpenAI's
published limit where it has one, SGLang's where it has one, ours otherwise (with why). A field past its
bound is a `RequestError` naming it (the server's 400); the body as a whole is bounded by the
--max-request-body-bytes flag (server/body_limit.py, a 413). The value bounds of the sampling fields
(logit_bias's 300 entries, stop_regex's 32 patterns, `n`) are in sampling_params.py.
"""

from __future__ import annotations

from typing import Any

from jaxserve.core.errors import RequestError, SamplingParamsError

# field -> (bound, source)
SIZE_LIMITS: dict[str, tuple[int, str]] = {
    # ours: an id, not a payload (a UUID is 36 characters); it is echoed in every streamed chunk and logged
    "rid_chars": (256, "ours"),
    # ours: every stop string is searched for in each new piece of text, per request and per step
    "stop_count": (64, "ours"),
    "stop_bytes": (1024, "ours"),  # UTF-8 bytes of one stop string; the text it ends is held back while it may match
    "metadata_pairs": (16, "OpenAI"),
    "metadata_key_chars": (64, "OpenAI"),
    "metadata_value_chars": (512, "OpenAI"),
    "tools": (128, "OpenAI"),
}
MAX_RID_CHARS = SIZE_LIMITS["rid_chars"][0]
MAX_STOP_COUNT = SIZE_LIMITS["stop_count"][0]
MAX_STOP_BYTES = SIZE_LIMITS["stop_bytes"][0]
METADATA_MAX_PAIRS = SIZE_LIMITS["metadata_pairs"][0]
METADATA_MAX_KEY_CHARS = SIZE_LIMITS["metadata_key_chars"][0]
METADATA_MAX_VALUE_CHARS = SIZE_LIMITS["metadata_value_chars"][0]
MAX_TOOLS = SIZE_LIMITS["tools"][0]


def check_request_sizes(body: dict[str, Any], id_field: str = "rid") -> None:
    """The bounds of this table on a request body's top-level fields (`id_field`, `tools`), checked before
    the request model reads it. Stop strings are bounded where the sampling params' values are checked
    (`SamplingParams.validate`), once per request.

    Raises:
        RequestError: naming the field (SamplingParamsError for `stop`).
    """
    check_request_id(body.get(id_field), id_field)
    check_tool_count(body.get("tools"))


def check_request_id(value: Any, field: str = "rid") -> None:
    """Refuse a request id (a string, or /generate's list of them) over MAX_RID_CHARS characters.
    Other types pass (the request model names them)."""
    for rid in value if isinstance(value, list) else [value]:
        if isinstance(rid, str) and len(rid) > MAX_RID_CHARS:
            raise RequestError(field, f"{field}: at most {MAX_RID_CHARS} characters, got {len(rid)}")


def check_stop_sizes(stop: Any, field: str = "stop") -> None:
    """Refuse over MAX_STOP_COUNT stop strings, or one over MAX_STOP_BYTES bytes of UTF-8 (a lone
    surrogate counts as 3 bytes). Other types pass (the type checks name them).

    Raises:
        SamplingParamsError: naming `field`.
    """
    strings = [stop] if isinstance(stop, str) else stop if isinstance(stop, (list, tuple)) else []
    if len(strings) > MAX_STOP_COUNT:
        raise SamplingParamsError(field, f"at most {MAX_STOP_COUNT} stop strings, got {len(strings)}")
    for s in strings:
        if isinstance(s, str) and len(s) * 4 > MAX_STOP_BYTES:  # UTF-8 takes at most 4 bytes a character
            size = len(s.encode("utf-8", "surrogatepass"))
            if size > MAX_STOP_BYTES:
                raise SamplingParamsError(field, f"a stop string may have at most {MAX_STOP_BYTES} bytes, got {size}")


def check_tool_count(tools: Any, field: str = "tools") -> None:
    """Refuse a list of over MAX_TOOLS tools."""
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise RequestError(field, f"{field}: at most {MAX_TOOLS} tools, got {len(tools)}")
