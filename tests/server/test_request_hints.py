"""Request mistakes get a hint and the documented error code; one access log line per request.
Against the app over a fake engine (no model)."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

from jaxserve.engine.engine_loop import EngineLoop
from jaxserve.server.app import create_app
from jaxserve.server_args import ServerArgs
from tests.server.fakes import FakeEngine


@pytest.fixture(scope="module")
def client():
    loop = EngineLoop(FakeEngine()).start()
    with TestClient(create_app(loop, ServerArgs(model_path="/models/fake-model"))) as c:
        yield c
    loop.shutdown()


def _error(r, status=400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_max_tokens_in_sampling_params_suggests_max_new_tokens(client):
    err = _error(client.post("/generate", json={"text": "hi", "sampling_params": {"max_tokens": 3}}))
    assert err["param"] == "sampling_params.max_tokens" and err["code"] == "unknown_parameter"
    assert "did you mean max_new_tokens" in err["message"]


def test_top_level_max_new_tokens_goes_inside_sampling_params(client):
    err = _error(client.post("/generate", json={"text": "hi", "max_new_tokens": 3}))
    assert err["param"] == "max_new_tokens" and err["code"] == "unknown_parameter"
    assert "goes inside sampling_params" in err["message"]
    err = _error(client.post("/generate", json={"text": "hi", "temperature": 0}))
    assert "temperature goes inside sampling_params" in err["message"]


def test_get_on_a_post_route_is_a_405_naming_post(client):
    r = client.get("/generate")
    err = _error(r, 405)
    assert err["message"] == "GET /generate is not allowed: use POST" and r.headers["allow"] == "POST"


@pytest.mark.parametrize("params, field", [
    ({"temperature": "0.5"}, "temperature"), ({"max_new_tokens": "5"}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"), ({"stop_token_ids": 3}, "stop_token_ids"),
])
def test_a_wrong_type_is_invalid_type(client, params, field):
    err = _error(client.post("/generate", json={"text": "hi", "sampling_params": params}))
    assert err["param"] == f"sampling_params.{field}" and err["code"] == "invalid_type", err


def test_a_value_out_of_range_stays_invalid_value(client):
    err = _error(client.post("/generate", json={"text": "hi", "sampling_params": {"top_p": 1.5}}))
    assert err["param"] == "sampling_params.top_p" and err["code"] == "invalid_value"


def test_one_token_reads_singular(client):
    err = _error(client.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 64}}))
    assert "the prompt has 1 token and 64 new tokens are asked for" in err["message"]
    # one new token always fits beside a prompt the context takes (the prompt is refused first)
    err = _error(client.post("/generate", json={"input_ids": [5] * 63, "sampling_params": {"max_new_tokens": 2}}))
    assert "the prompt has 63 tokens and 2 new tokens are asked for" in err["message"]


def test_one_access_line_per_request(client, caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.access")
    r = client.post("/generate", json={"text": "abc", "sampling_params": {"max_new_tokens": 3, "n": 2}})
    assert r.status_code == 200
    client.get("/generate")
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "jaxserve.access"]
    assert len(lines) == 2, lines
    method, path, status, prompt, completion, latency = lines[0].split()
    assert (method, path, status) == ("POST", "/generate", "200")
    assert prompt == "prompt_tokens=3" and completion == "completion_tokens=6"  # the prompt once, both sequences
    assert latency.startswith("latency=") and latency.endswith("s") and float(latency[8:-1]) >= 0
    assert lines[1].startswith("GET /generate 405 prompt_tokens=0 completion_tokens=0 latency=")
