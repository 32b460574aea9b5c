"""Log lines a client cannot forge: every value formatted into a log message is escaped.

Clients control much of what the server logs: the decoded request path of the access log (also of
a 401), rids (`--log-requests`, retraction), model names, error messages quoting the request. A raw
`%0a` in a path would end the access line and start a fake one (`GET /x%0a09:50:00 ERROR ...`), a
`%00` would put a NUL in the log, a lone surrogate in a JSON string could not even be written out.

Rather than wrap each logger call that may carry client data (and miss the next one), the handler
that `jaxserve.launch.process.configure_logging` installs formats with `LogSafeFormatter`: it escapes
every argument of every record (jaxserve's, uvicorn's, the libraries') before it is put into the
message. The format string itself is the code's own and is left alone, so a message may still span
lines on purpose, and so may a traceback. The numbers of `%d`/`%f` are passed through as numbers.
An embedding program that configures logging itself can use the same formatter.
"""

from __future__ import annotations

import copy
import logging
import numbers
import re
from typing import Any

# C0 controls (CR, LF, NUL, tab, ESC...), DEL, C1 controls (NEL among them), the Unicode line and
# paragraph separators, and lone surrogates (what invalid UTF-8 decodes to with surrogateescape)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def log_safe(value: object) -> str:
    """`str(value)` with every control character, line separator and lone surrogate written as
    `\\xNN` / `\\uNNNN`: one line of printable text, encodable as UTF-8."""
    return _UNSAFE.sub(_escape, str(value))


def _safe_arg(arg: Any) -> Any:
    if arg is None or isinstance(arg, numbers.Number):
        return arg  # for %d / %f, and nothing a client can put a newline in
    text = str(arg)
    return _UNSAFE.sub(_escape, text) if _UNSAFE.search(text) else arg


class LogSafeFormatter(logging.Formatter):
    """A `logging.Formatter` that escapes each argument of a record with `log_safe` (see the module
    docstring). The record itself is left as it was, for any other handler."""

    def format(self, record: logging.LogRecord) -> str:
        if record.args:
            record = copy.copy(record)
            if isinstance(record.args, dict):
                record.args = {k: _safe_arg(v) for k, v in record.args.items()}
            else:
                record.args = tuple(_safe_arg(a) for a in record.args)
        return super().format(record)
