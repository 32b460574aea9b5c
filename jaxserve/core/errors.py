"""The errors of a request's checks. Each names the offending field and carries the code of the HTTP
body (OpenAI's error shape): the server turns any of them into its 400 in one place (server/errors.py).

    RequestError("top_logprobs_num", "must be in [0, 20], got 25")         code invalid_value
    SamplingParamsError("seed", "must be an integer, got true (a boolean)", code="invalid_type")
    ContextLengthError("prompt", "the prompt has 9000 tokens, ...")        code context_length_exceeded
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot serve (too long, empty, a value out of range, ...).

    `field` names the offending input (the body's `param`); `code` is the body's code: invalid_value
    unless said otherwise (invalid_type for a wrong JSON type, unknown_parameter for an unknown field).
    """

    code = "invalid_value"

    def __init__(self, field: str, message: str, code: str | None = None):
        super().__init__(message)
        self.field = field
        if code is not None:
            self.code = code


class ContextLengthError(RequestError):
    """A request that does not fit: its prompt (or prompt + max_new_tokens) over the context length or
    over the KV pool's bound on one request (`engine/validation/limits.py`)."""

    code = "context_length_exceeded"


class SamplingParamsError(RequestError):
    """An invalid sampling parameter; the message starts with the field's name ("top_p: must be in
    (0, 1], got 2"), which the HTTP layer may rename (max_new_tokens -> max_tokens)."""

    def __init__(self, field: str, message: str, code: str | None = None):
        super().__init__(field, f"{field}: {message}", code)
