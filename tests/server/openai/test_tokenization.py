"""SGLang's POST /tokenize and /detokenize (also under /v1/): before, jaxserve answered both with a 404.

The app runs in-process over a model-free engine that holds the default model's tokenizer (as jaxserve
loads it) and the engine's own request validator; the expected ids come from the same tokenizer files
loaded independently with transformers' AutoTokenizer. One test runs the shared tiny-checkpoint
server (tests/server/conftest.py) to see the routes served by a real engine.
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from jaxserve.engine.engine_loop import EngineLoop
from jaxserve.engine.validation.check import RequestChecker
from jaxserve.engine.validation.limits import ModelLimits
from jaxserve.server.app import create_app
from jaxserve.server_args import ServerArgs
from tests.server.fakes import FakeEngine

CONTEXT_LENGTH = 256
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
TEXTS = ["Hello, world!", "Ünïcode ✓ and 42 numbers", ""]


class SeenChecker(RequestChecker):
    """The engine's `RequestChecker`, recording the `add_special_tokens` of every tokenize call."""

    def __init__(self, *args):
        super().__init__(*args)
        self.add_special_tokens_seen: list[bool] = []

    def tokenize(self, prompt, add_special_tokens=True):
        self.add_special_tokens_seen.append(add_special_tokens)
        return super().tokenize(prompt, add_special_tokens)


class TokenizerEngine(FakeEngine):
    """FakeEngine with a real tokenizer, tokenizing through the engine's `RequestChecker`."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer
        self.limits = ModelLimits(len(tokenizer), CONTEXT_LENGTH, pool_tokens=1024)
        self.checker = SeenChecker(tokenizer, self.limits)


@pytest.fixture(scope="module")
def reference(default_tokenizer):
    """The default model's tokenizer directory (the converted copy jaxserve caches for its GGUF file),
    loaded on its own by transformers."""
    from transformers import AutoTokenizer

    from jaxserve.model.tokenizer import tokenizer_files_path

    path = tokenizer_files_path("default")
    assert not path.endswith(".gguf"), "default_tokenizer writes the converted copy"
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def engine_loop(default_tokenizer):
    loop = EngineLoop(TokenizerEngine(default_tokenizer)).start()
    yield loop
    loop.shutdown()


@pytest.fixture
def client(engine_loop):
    with TestClient(create_app(engine_loop, ServerArgs(model_path="/models/fake-model"))) as c:
        yield c


def _error(r, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
def test_tokenize_a_text_as_transformers_does(client, reference, path):
    for text in TEXTS:
        r = client.post(path, json={"prompt": text})
        assert r.status_code == 200, r.text
        expected = reference.encode(text, add_special_tokens=True)
        assert r.json() == {"tokens": expected, "count": len(expected), "max_model_len": CONTEXT_LENGTH}
    assert client.post(path, json={"prompt": TEXTS[0]}).json()["tokens"] != [], "a text of tokens"


def test_a_list_of_texts_gives_a_list_of_id_lists_and_counts(client, reference):
    r = client.post("/tokenize", json={"prompt": TEXTS})
    assert r.status_code == 200, r.text
    expected = [reference.encode(t) for t in TEXTS]
    assert r.json()["tokens"] == expected and r.json()["count"] == [len(ids) for ids in expected]
    assert client.post("/tokenize", json={"prompt": []}).json() == {"tokens": [], "count": [],
                                                                      "max_model_len": CONTEXT_LENGTH}


def test_add_special_tokens_reaches_the_tokenizer(client, reference, default_tokenizer):
    """SmolLM2's tokenizer adds none; one that adds a BOS (as Gemma's) must get it only when asked."""
    text = TEXTS[0]
    r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.json()["tokens"] == reference.encode(text, add_special_tokens=False)
    seen = []
    original = default_tokenizer.encode

    def spy(text, add_special_tokens=True, **kwargs):
        seen.append(add_special_tokens)
        return original(text, add_special_tokens=add_special_tokens, **kwargs)

    default_tokenizer.encode = spy
    try:
        client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        client.post("/tokenize", json={"prompt": text})
    finally:
        del default_tokenizer.encode
    assert seen == [False, True]


def test_messages_are_the_chat_templates_ids(client, reference):
    r = client.post("/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    expected = reference.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert r.json()["tokens"] == list(expected) and r.json()["count"] == len(expected)
    # add_generation_prompt false: the template's text without the opened assistant turn
    r = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    expected = reference.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=False, return_dict=False)
    assert r.json()["tokens"] == list(expected)
    # an assistant prefill left open, as /v1/chat/completions renders it
    prefill = [*MESSAGES, {"role": "assistant", "content": "Bl"}]
    r = client.post("/tokenize", json={"messages": prefill, "continue_final_message": True})
    expected = reference.apply_chat_template(prefill, tokenize=True, continue_final_message=True, return_dict=False)
    assert r.json()["tokens"] == list(expected)


@pytest.mark.parametrize("fields, add_special_tokens", [
    ({}, False),  # as a chat's prompt: the template wrote the special tokens
    ({"add_special_tokens": True}, False),  # SGLang's rule: only with add_generation_prompt given
    ({"add_generation_prompt": True}, False),
    ({"add_generation_prompt": True, "add_special_tokens": True}, True),
    ({"add_generation_prompt": False, "add_special_tokens": True}, True),
    ({"add_generation_prompt": True, "add_special_tokens": False}, False),
])
def test_messages_add_special_tokens_as_sglang(client, engine_loop, fields, add_special_tokens):
    """SmolLM2's tokenizer adds none, so the flag handed to the tokenizer is what is checked."""
    seen = engine_loop.engine.checker.add_special_tokens_seen
    seen.clear()
    assert client.post("/tokenize", json={"messages": MESSAGES, **fields}).status_code == 200
    assert seen == [add_special_tokens]


def test_messages_count_what_a_chat_completion_submits(client, engine_loop):
    """The chat route's prompt_tokens (the fake engine reports the submitted prompt's length) for the
    same body, tools included."""
    tools = [{"type": "function", "function": {"name": "get_colour", "parameters": {"type": "object"}}}]
    for extra in ({}, {"tools": tools}):
        count = client.post("/tokenize", json={"messages": MESSAGES, **extra}).json()["count"]
        chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, **extra})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == count
    with_tools = client.post("/tokenize", json={"messages": MESSAGES, "tools": tools}).json()["count"]
    assert with_tools > client.post("/tokenize", json={"messages": MESSAGES}).json()["count"]


@pytest.mark.parametrize("path", ["/detokenize", "/v1/detokenize"])
def test_detokenize_round_trips(client, reference, path):
    for text in TEXTS:
        ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
        r = client.post(path, json={"tokens": ids})
        assert r.status_code == 200, r.text
        assert r.json() == {"text": text}
    lists = [reference.encode(t) for t in TEXTS]
    assert client.post(path, json={"tokens": lists}).json() == {"text": TEXTS}
    assert client.post(path, json={"tokens": []}).json() == {"text": ""}


def test_skip_special_tokens(client, reference):
    ids = list(reference.apply_chat_template(MESSAGES, tokenize=True, return_dict=False))
    assert client.post("/detokenize", json={"tokens": ids}).json()["text"] == reference.decode(ids, skip_special_tokens=True)
    kept = client.post("/detokenize", json={"tokens": ids, "skip_special_tokens": False}).json()["text"]
    assert kept == reference.decode(ids) and "<|im_start|>" in kept


def test_token_ids_outside_the_vocabulary_are_400s_naming_them(client, reference):
    vocab_size = len(reference)
    err = _error(client.post("/detokenize", json={"tokens": [1, 2, vocab_size]}), "tokens[2]")
    assert str(vocab_size) in err["message"]
    _error(client.post("/detokenize", json={"tokens": [-1]}), "tokens[0]")
    _error(client.post("/detokenize", json={"tokens": [[1], [2, 2**64]]}), "tokens[1][1]")
    assert client.post("/detokenize", json={"tokens": [vocab_size - 1]}).status_code == 200


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": "a", "messages": MESSAGES}, "messages"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", 5]}, "prompt[1]"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": MESSAGES, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
])
def test_bad_tokenize_requests_are_400s_naming_the_field(client, body, param):
    _error(client.post("/tokenize", json=body), param)


@pytest.mark.parametrize("body, param", [
    ({}, "tokens"),
    ({"tokens": "hello"}, "tokens"),
    ({"tokens": [1, 2.5]}, "tokens[1]"),
    ({"tokens": [1, True]}, "tokens[1]"),
    ({"tokens": [[1, 2], [3, "4"]]}, "tokens[1][1]"),
    ({"tokens": [1], "skip_special_tokens": 0}, "skip_special_tokens"),
])
def test_bad_detokenize_requests_are_400s_naming_the_field(client, body, param):
    _error(client.post("/detokenize", json=body), param)


def test_a_model_without_a_chat_template_refuses_messages(engine_loop, default_tokenizer):
    import copy

    tokenizer = copy.copy(default_tokenizer)
    tokenizer.chat_template = None
    loop = EngineLoop(TokenizerEngine(tokenizer)).start()
    try:
        with TestClient(create_app(loop, ServerArgs(model_path="/models/fake-model"))) as c:
            err = _error(c.post("/tokenize", json={"messages": MESSAGES}), "messages")
            assert "chat template" in err["message"]
            assert c.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    finally:
        loop.shutdown()


def test_skip_tokenizer_init_refuses_both_routes(engine_loop):
    """As text prompts and outputs: SGLang has no tokenizer then."""
    with TestClient(create_app(engine_loop, ServerArgs(model_path="/models/fake-model", skip_tokenizer_init=True))) as c:
        _error(c.post("/tokenize", json={"prompt": "hi"}), "prompt")
        _error(c.post("/tokenize", json={"messages": MESSAGES}), "messages")
        _error(c.post("/detokenize", json={"tokens": [1]}), "tokens")


def test_the_routes_need_the_api_key_and_are_documented(engine_loop):
    with TestClient(create_app(engine_loop, ServerArgs(model_path="/models/fake-model", api_key="k"))) as c:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            assert c.post(path, json=body).status_code == 401
            assert c.post(path, json=body, headers={"Authorization": "Bearer k"}).status_code == 200
        doc = c.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()
    for path in ("/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize"):
        assert "post" in doc["paths"][path], path
    assert set(doc["components"]["schemas"]["TokenizeResponse"]["properties"]) == {"tokens", "count", "max_model_len"}


def test_max_model_len_is_the_tokenizers_own_when_it_has_one():
    from types import SimpleNamespace

    from jaxserve.server.openai.tokenization import max_model_len

    assert max_model_len(SimpleNamespace(model_max_length=8192), 256) == 8192
    assert max_model_len(SimpleNamespace(model_max_length=int(1e30)), 256) == 256
    assert max_model_len(SimpleNamespace(), 256) == 256


def test_a_real_server_tokenizes_and_detokenizes(http, tiny_model_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_model_dir)
    r = http.post("/tokenize", json={"prompt": TEXTS})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == [reference.encode(t) for t in TEXTS]
    r = http.post("/tokenize", json={"messages": MESSAGES})
    expected = reference.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert r.json()["tokens"] == list(expected)
    generate = http.post("/generate", json={"input_ids": r.json()["tokens"], "sampling_params": {"max_new_tokens": 1}})
    assert generate.json()["meta_info"]["prompt_tokens"] == r.json()["count"]
    assert http.post("/detokenize", json={"tokens": [reference.encode(t) for t in TEXTS]}).json() == {"text": TEXTS}
    _error(http.post("/detokenize", json={"tokens": [len(reference)]}), "tokens[0]")


def test_fields_and_defaults_are_sglangs(client):
    """Against SGLang 0.5.23's own models: every request field but `reasoning_effort` (which
    /v1/chat/completions does not take either), the same defaults, and replies its response models read."""
    from sglang.srt.entrypoints.openai import protocol as sglang

    from jaxserve.server import protocol

    for ours, theirs, left_out in ((protocol.TokenizeRequest, sglang.TokenizeRequest, {"reasoning_effort"}),
                                   (protocol.DetokenizeRequest, sglang.DetokenizeRequest, set()),
                                   (protocol.TokenizeResponse, sglang.TokenizeResponse, set()),
                                   (protocol.DetokenizeResponse, sglang.DetokenizeResponse, set())):
        assert set(ours.model_fields) == set(theirs.model_fields) - left_out, ours.__name__
        for name in ("add_special_tokens", "skip_special_tokens", "continue_final_message", "add_generation_prompt"):
            if name in ours.model_fields:
                assert ours.model_fields[name].default == theirs.model_fields[name].default, name
    for body in ({"prompt": "Hi there"}, {"prompt": ["a", "b c"]}, {"messages": MESSAGES}):
        sglang.TokenizeResponse.model_validate(client.post("/tokenize", json=body).json())
    for body in ({"tokens": [1, 2]}, {"tokens": [[1], [2, 3]]}):
        sglang.DetokenizeResponse.model_validate(client.post("/detokenize", json=body).json())
