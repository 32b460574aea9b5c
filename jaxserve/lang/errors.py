"""The exceptions a program raises for its own mistakes and for the backend's refusals."""

from __future__ import annotations

from typing import Iterable


class BackendError(RuntimeError):
    """The backend refused or failed a request: an HTTP 4xx/5xx from a server, or the in-process
    engine's validation error / abort. Carries the server's own message.

    Attributes:
        status_code: the HTTP status (400 for invalid input, 5xx for a server failure); in-process
            validation errors are reported as 400 and engine failures as 500, like the HTTP server.
        message: the server's message (for jaxserve and SGLang, `error.message` of the JSON body).
        param: the offending field when the server names one, as the program named it (e.g. "regex"
            for `gen(regex=...)`, where /generate says `sampling_params.regex`), else None.
    """

    def __init__(self, status_code: int, message: str, param: str | None = None):
        where = f" (param {param})" if param else ""
        super().__init__(f"the backend returned {status_code}{where}: {message}")
        self.status_code = status_code
        self.message = message
        self.param = param


class UnknownVariableError(KeyError):
    """`s[name]` for a name no `gen` / `select` of this state has set; lists the names it knows."""

    def __init__(self, name: str, known: Iterable[str]):
        self.name = name
        self.known = sorted(known)
        listed = ", ".join(repr(k) for k in self.known) if self.known else "none yet"
        self.message = f"unknown variable {name!r}; the state's variables are: {listed}"
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would show the repr of the message, quotes and all
        return self.message


class ChatTemplateError(ValueError):
    """A role the chat template cannot express, or a template the roles cannot be derived from."""


class ProgramError(RuntimeError):
    """A program used the state wrongly (an `assistant_end()` with no `assistant_begin()`, ...)."""
