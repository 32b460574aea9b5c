"""A request's sampling fields are checked once: their JSON types once (where JSON becomes a `SamplingParams`:
`from_dict`, or an OpenAI route's body), their values once (`SamplingParams.validate`, from the request's one
check), its stop strings' sizes once, and the request against the model once (`RequestChecker.check`), on
/generate, /v1/completions, /v1/chat/completions and in process (`Engine.add_request`)."""

from __future__ import annotations

import collections

import pytest
from starlette.testclient import TestClient

from jaxserve.core import field_types, sampling_params, size_limits
from jaxserve.engine.engine_loop import EngineLoop
from jaxserve.engine.validation import check
from jaxserve.engine.validation.limits import ModelLimits
from jaxserve.server.app import create_app
from jaxserve.server_args import ServerArgs
from tests.server.fakes import FakeEngine

STOP = ["never-said"]


@pytest.fixture
def calls(monkeypatch) -> collections.Counter:
    """Counts of the checks' calls: "types" (the JSON type table, wherever it is called from), "values",
    "stop_sizes" and "request" (`RequestChecker.check`)."""
    counts: collections.Counter = collections.Counter()

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    types = counting("types", field_types.first_type_error)
    monkeypatch.setattr(field_types, "first_type_error", types)  # check_field_types' (the OpenAI routes')
    monkeypatch.setattr(sampling_params, "first_type_error", types)  # from_dict's
    monkeypatch.setattr(sampling_params, "check_values", counting("values", sampling_params.check_values))
    stop_sizes = counting("stop_sizes", size_limits.check_stop_sizes)
    monkeypatch.setattr(size_limits, "check_stop_sizes", stop_sizes)
    monkeypatch.setattr(sampling_params, "check_stop_sizes", stop_sizes)
    monkeypatch.setattr(check.RequestChecker, "check", counting("request", check.RequestChecker.check))
    return counts


class TokenizerEngine(FakeEngine):
    """The model-free engine with the default model's tokenizer (its chat template) and the real checks."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer
        self.limits = ModelLimits(len(tokenizer), context_length=512, pool_tokens=4096)
        self.checker = check.RequestChecker(tokenizer, self.limits)


@pytest.fixture(scope="module")
def client(default_tokenizer):
    loop = EngineLoop(TokenizerEngine(default_tokenizer)).start()
    with TestClient(create_app(loop, ServerArgs(model_path="/models/fake-model"))) as c:
        yield c
    loop.shutdown()


@pytest.mark.parametrize("route,body,num_prompts", [
    ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0, "stop": STOP}}, 1),
    ("/generate", {"text": ["Hello", "Bye"], "sampling_params": {"max_new_tokens": 2, "stop": STOP}}, 2),
    ("/v1/completions", {"model": "fake-model", "prompt": "Hello", "max_tokens": 2, "temperature": 0, "stop": STOP}, 1),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
                              "stop": STOP}, 1),
], ids=["generate", "generate-batch", "completions", "chat"])
def test_each_check_runs_once_per_prompt_on_the_http_routes(client, calls, route, body, num_prompts):
    r = client.post(route, json=body)
    assert r.status_code == 200, r.text
    assert dict(calls) == {"types": num_prompts if route == "/generate" else 1, "values": num_prompts,
                           "stop_sizes": num_prompts, "request": num_prompts}


def test_a_wrong_type_is_named_once_checked(client, calls):
    r = client.post("/generate", json={"text": "Hello", "sampling_params": {"temperature": "hot"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.temperature", r.text
    assert dict(calls) == {"types": 1, "request": 1}


@pytest.mark.slow
def test_each_check_runs_once_in_process(tiny_model_dir, calls):
    from jaxserve.engine.engine import Engine

    engine = Engine(model_path=tiny_model_dir, max_total_tokens=256, disable_precompile=True)
    calls.clear()  # start-up loads adapters and compiles nothing that checks requests, but be sure
    engine.add_request("Hello", {"max_new_tokens": 2, "temperature": 0, "stop": STOP})
    assert dict(calls) == {"types": 1, "values": 1, "stop_sizes": 1, "request": 1}
    while engine.has_unfinished():
        engine.step()
    assert dict(calls) == {"types": 1, "values": 1, "stop_sizes": 1, "request": 1}  # nothing checks it again
