"""jaxserve.log_safe: the values formatted into a log line are escaped, the format and numbers not."""

from __future__ import annotations

import logging

from jaxserve.log_safe import LogSafeFormatter, log_safe

FORGED = "x\n09:50:00 ERROR jaxserve: forged\r\x00\x1b[31m\x7f\x85\u2028\ud800"


def _record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("jaxserve.access", logging.INFO, __file__, 1, msg, args, None)


def test_log_safe_escapes_controls_separators_and_lone_surrogates():
    assert log_safe(FORGED) == "x\\x0a09:50:00 ERROR jaxserve: forged\\x0d\\x00\\x1b[31m\\x7f\\x85\\u2028\\ud800"
    assert log_safe("/v1/models/caf\u00e9 \u4e2d\t") == "/v1/models/caf\u00e9 \u4e2d\\x09"
    assert log_safe(3) == "3"


def test_the_formatter_escapes_every_argument_and_keeps_numbers():
    fmt = LogSafeFormatter("%(levelname)s %(name)s: %(message)s")
    record = _record("%s %s %d latency=%.3fs err=%s", "GET", "/v1/responses/" + FORGED, 401, 0.25, ValueError("a\nb"))
    line = fmt.format(record)
    assert line.splitlines() == [line]
    assert line == ("INFO jaxserve.access: GET /v1/responses/" + log_safe(FORGED) + " 401 latency=0.250s err=a\\x0ab")
    line.encode("utf-8")  # no lone surrogate left
    assert record.args[1] == "/v1/responses/" + FORGED  # the record is unchanged, for any other handler
    named = _record("rid=%(rid)s n=%(n)d", {"rid": "r\n1", "n": 2})
    assert fmt.format(named) == "INFO jaxserve.access: rid=r\\x0a1 n=2"


def test_the_format_string_and_a_traceback_keep_their_lines():
    fmt = LogSafeFormatter("%(message)s")
    assert fmt.format(_record("two\nlines %s", "a\nb")) == "two\nlines a\\x0ab"
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed %s", ("r\n1",), sys.exc_info())
    text = fmt.format(record)
    assert text.startswith("failed r\\x0a1\nTraceback (most recent call last):") and text.endswith("RuntimeError: boom")
