"""A client cannot forge log lines: the request path of the access log (of a 401 too) and the rid of
`--log-requests` are escaped (jaxserve.log_safe), one line per request, no raw control character."""

from __future__ import annotations

import dataclasses
import io
import logging
import re
import time
import uuid

import pytest
from starlette.testclient import TestClient

from jaxserve.engine.engine_loop import EngineLoop
from jaxserve.log_safe import LogSafeFormatter
from jaxserve.server.app import create_app
from jaxserve.server_args import ServerArgs
from tests.server.fakes import FakeEngine

# each decodes to something that would break or forge a line: LF, CR, NUL, invalid UTF-8, ESC, NEL, U+2028
HOSTILE = ["%0a09:50:00%20ERROR%20jaxserve:%20forged", "%0d", "%00", "%ff%fe", "%1b[2J", "%c2%85", "%e2%80%a8"]
# anything but the newline ending each line: the C0 and C1 controls, DEL, the Unicode line separators
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def _assert_one_clean_line(log: str, marker: str, head: str, tail: str) -> None:
    """`log` has no raw control character, and one line with `marker`, holding `head` then `tail`."""
    assert not RAW_CONTROL.search(log), repr(log)
    lines = [line for line in log.split("\n") if marker in line]
    assert len(lines) == 1, repr(log)
    assert head in lines[0] and tail in lines[0].split(head, 1)[1], lines[0]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_the_access_log_escapes_the_request_path(server, http, hostile):
    marker = uuid.uuid4().hex
    seen = server.log_path.stat().st_size
    r = http.get(f"/v1/responses/{marker}{hostile}end")
    assert r.status_code == 404
    deadline = time.monotonic() + 10
    while marker not in (log := server.log_path.read_bytes()[seen:].decode("utf-8")):  # strict: valid UTF-8
        assert time.monotonic() < deadline, log
        time.sleep(0.05)
    time.sleep(0.2)  # anything the request wrote after its access line
    log = server.log_path.read_bytes()[seen:].decode("utf-8")
    _assert_one_clean_line(log, marker, f" INFO jaxserve.access: GET /v1/responses/{marker}", "end 404 ")


@pytest.fixture
def captured():
    """What the `jaxserve` loggers write through the server's formatter, at info."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(LogSafeFormatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("jaxserve")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def test_a_401_is_logged_escaped(captured):
    loop = EngineLoop(FakeEngine()).start()
    try:
        with TestClient(create_app(loop, ServerArgs(model_path="/models/fake-model", api_key="secret"))) as client:
            for hostile in HOSTILE:
                marker = uuid.uuid4().hex
                seen = len(captured.getvalue())
                assert client.get(f"/v1/responses/{marker}{hostile}end").status_code == 401
                _assert_one_clean_line(captured.getvalue()[seen:], marker, f"GET /v1/responses/{marker}", "end 401 ")
    finally:
        loop.shutdown()


def test_log_requests_escapes_the_rid(captured):
    engine = FakeEngine()
    engine.args = dataclasses.replace(engine.args, log_requests=True)
    loop = EngineLoop(engine).start()
    try:
        with TestClient(create_app(loop, engine.args)) as client:
            r = client.post("/generate", json={"text": "hi", "rid": "r1\n09:50:00 ERROR forged\x00",
                                               "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200
    finally:
        loop.shutdown()
    log = captured.getvalue()
    _assert_one_clean_line(log, "request finished", "request finished rid=r1", "\\x0a09:50:00 ERROR forged\\x00 ")
    assert "\nERROR" not in log and "\n09:50" not in log
