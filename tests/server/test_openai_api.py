"""The OpenAI API through the official `openai` client (and raw HTTP where the client hides the wire)."""

from __future__ import annotations

import json

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_chat_completion(client, model):
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = resp.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_equals_non_stream(client, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=16, temperature=0.8, seed=1234)
    full = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_wire_format_ends_with_done(http, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    assert json.loads(data[-2])["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_n_choices(client, model):
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=7, n=3)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in resp.choices)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=7,
                                            n=3, stream=True)
    finishes: dict[int, list[str]] = {}
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    assert sorted(finishes) == [0, 1, 2] and all(len(v) == 1 for v in finishes.values())
    assert [texts[i] for i in range(3)] == [c.message.content for c in sorted(resp.choices, key=lambda c: c.index)]


def test_chat_logprobs(client, model):
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy picks the top token


def test_completions(client, model):
    resp = client.completions.create(model=model, prompt="The sky is", max_tokens=5, temperature=0, logprobs=2)
    choice = resp.choices[0]
    assert resp.object == "text_completion" and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 5 and len(choice.logprobs.top_logprobs[0]) <= 2
    assert "".join(choice.logprobs.tokens) == choice.text or "\ufffd" in "".join(choice.logprobs.tokens)
    batch = client.completions.create(model=model, prompt=["The sky is", "Grass is"], max_tokens=3, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == client.completions.create(model=model, prompt="The sky is", max_tokens=3,
                                                              temperature=0).choices[0].text
    echo = client.completions.create(model=model, prompt="The sky is", max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("The sky is")


def test_completions_stream(client, model):
    kwargs = dict(model=model, prompt="Numbers: 1, 2, 3,", max_tokens=8, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stop_and_max_completion_tokens(client, model):
    full = client.completions.create(model=model, prompt="a b c d", max_tokens=8, temperature=0).choices[0].text
    words = full.split()
    if len(words) >= 2:
        stop = " " + words[1]
        cut = client.completions.create(model=model, prompt="a b c d", max_tokens=8, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.index(stop)]
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=3, temperature=0)
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"


def test_sglang_extra_fields_and_response_format(http, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "min_tokens": 4, "skip_special_tokens": False, "no_stop_trim": True, "stop_token_ids": [2]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
