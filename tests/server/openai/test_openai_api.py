"""The OpenAI API through the official `openai` client (and raw HTTP where the client hides the wire)."""

from __future__ import annotations

import json
import re

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]


def cache_prompt(client, model) -> None:
    """Put MESSAGES' prompt into the prefix cache, so that the seeded calls a test compares all extend
    the same cached prefix. A cold prefill and a cached extend agree only to the last float bits
    (logprobs ~1e-6 apart, measured), and over the tiny checkpoint's near-flat 49k-token distribution
    that is enough to flip a temperature-1 inverse-CDF draw; the session server's cache state depends
    on the tests run before (random order), so without this the first call may be cold."""
    client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, temperature=0)


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
    cache_prompt(client, model)
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
    cache_prompt(client, model)
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


def test_stop_regex_cuts_completions_and_chat(client, model, http):
    """SGLang's `stop_regex` extra on the OpenAI routes: the text ends where the first match starts."""
    full = client.completions.create(model=model, prompt="a b c d", max_tokens=8, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 2, full
    pattern = r"\s" + re.escape(words[1]) + r"\b"
    cut = client.completions.create(model=model, prompt="a b c d", max_tokens=8, temperature=0,
                                    extra_body={"stop_regex": pattern})
    start = re.search(pattern, full).start()
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[:start]
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0).choices[0]
    first = chat.message.content.split()[0] if chat.message.content.split() else None
    if first:
        cut = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                             extra_body={"stop_regex": [re.escape(first)]}).choices[0]
        assert cut.finish_reason == "stop" and cut.message.content == chat.message.content[: chat.message.content.index(first)]
    r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1, "stop_regex": "(?R)"})
    assert r.status_code == 400 and "stop_regex" in r.text, r.text


def test_sglang_extra_fields_and_response_format(http, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "min_tokens": 4, "skip_special_tokens": False, "no_stop_trim": True, "stop_token_ids": [2]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


# ---- OpenAI's validation rules: 400s naming the field ----------------------------------------------
@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}], "messages[1].content"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant"}, {"role": "user", "content": "Hi"}], "messages[1].content"),
])
def test_chat_message_without_content_is_refused(http, messages, param):
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "missing_required_parameter" and param in err["message"]


def test_assistant_message_with_tool_calls_may_leave_out_content(http):
    call = {"id": "call_0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [{"role": "user", "content": "What time is it?"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "12:00"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


# a single tool whose argument is a constant: a forced call can be only this text, whatever the model
MARKER_TEXT = 'a</tool_call>\n<tool_call>{"name": "echo"}'
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"const": MARKER_TEXT}}, "required": ["text"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "echo"}}])
def test_forced_call_whose_arguments_hold_the_markers(client, model, choice):
    """A forced call whose argument string holds `</tool_call>` (and `<tool_call>`) is one call with those
    arguments, streamed or not; it came back as content with tool_calls null."""
    kw = dict(model=model, messages=[{"role": "user", "content": "Echo."}], tools=[ECHO], tool_choice=choice,
              max_tokens=60, temperature=0)
    choice0 = client.chat.completions.create(**kw).choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None, choice0
    [call] = choice0.message.tool_calls
    assert call.function.name == "echo" and json.loads(call.function.arguments) == {"text": MARKER_TEXT}
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.function.name] == ["echo"] and {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _forced_reply(client, model, stream: bool, **kw) -> tuple[list[tuple[str, str]], str | None, str | None]:
    """([(name, arguments)], content, finish_reason) of a forced call of ECHO, streamed or not."""
    kw = dict(model=model, messages=[{"role": "user", "content": "Echo."}], tools=[ECHO], tool_choice="required",
              temperature=0, **kw)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.message.content, choice.finish_reason
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    calls: dict[int, list[str]] = {}
    for d in (d for c in chunks for d in (c.choices[0].delta.tool_calls or [])):
        calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    return [tuple(c) for c in calls.values()], content or None, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("cut", [{"stop": ["\n"]}, {"stop": ["</tool_call>", "echo"]}, {"extra_body": {"stop_token_ids": [198]}}])  # 198: "\n"
def test_stop_does_not_cut_a_forced_call(client, model, stream, cut):
    """A forced reply is the call, ended by its grammar: a stop string or stop token inside it left
    `<tool_call>` as content and no call."""
    whole = _forced_reply(client, model, stream, max_tokens=60)
    assert whole[1:] == (None, "tool_calls") and whole[0][0][0] == "echo"
    assert _forced_reply(client, model, stream, max_tokens=60, **cut) == whole


def test_a_forced_call_cut_by_max_tokens_reads_the_same_streamed_or_not(client, model):
    """Cut by max_tokens, a forced call is the call so far (finish_reason length) streamed or not; the
    non-streamed reply gave it as content with tool_calls null."""
    [(name, arguments)], _, _ = _forced_reply(client, model, False, max_tokens=60)
    cut = _forced_reply(client, model, False, max_tokens=24)
    assert cut == _forced_reply(client, model, True, max_tokens=24)
    [(cut_name, cut_arguments)], content, reason = cut
    assert (cut_name, content, reason) == (name, None, "length")
    assert arguments.startswith(cut_arguments) and 0 < len(cut_arguments) < len(arguments)


# as response_format it runs; forced, closing each part made every object invalid (a 400 "Unsatisfiable schema")
PAIR = {"type": "function", "function": {"name": "pair", "parameters": {"type": "object", "allOf": [
    {"properties": {"a": {"type": "boolean"}}, "required": ["a"]}, {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}}}


# recursive through $defs and through the root; each node's fields bounded so that any call ends
TREE = {"type": "function", "function": {"name": "plant", "parameters": {
    "type": "object", "properties": {"tree": {"$ref": "#/$defs/node"}, "again": {"type": "array", "items": {"$ref": "#"}, "maxItems": 0}},
    "required": ["tree"], "$defs": {"node": {"type": "object", "properties": {
        "leaf": {"type": "boolean"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 0}},
        "required": ["leaf", "kids"]}}}}}


@pytest.mark.parametrize("tool", [TREE, PAIR])
def test_forced_call_with_a_schema_response_format_takes(client, model, tool):
    """A `$ref` schema as a tool's parameters works as it does as response_format; a forced call of it
    was refused ("invalid EBNF grammar ... Pointer '/$defs/node' does not exist"), and so was an allOf
    ("Unsatisfiable schema")."""
    import jsonschema

    kw = dict(model=model, messages=[{"role": "user", "content": "Go."}], tools=[tool], tool_choice="required",
              max_tokens=40, temperature=0)  # the tiny server's context: 256 tokens
    choice0 = client.chat.completions.create(**kw).choices[0]
    assert choice0.finish_reason == "tool_calls", choice0
    [call] = choice0.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    deltas = [d for c in client.chat.completions.create(**kw, stream=True) if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == tool["function"]["name"] and "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": False}),
    ("/v1/completions", {"prompt": "Hi"}),
])
def test_stream_options_needs_stream(http, route, body):
    r = http.post(route, json={**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stream_options"


@pytest.mark.parametrize("fields, code", [
    ({"best_of": 1, "n": 2}, "invalid_value"),  # OpenAI: best_of must be >= n
    ({"best_of": 3}, "unsupported_parameter"),  # returning the best n of best_of is not implemented
    ({"best_of": 4, "n": 2}, "unsupported_parameter"),
])
def test_completions_best_of_refusals(http, fields, code):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "best_of" and err["code"] == code


def test_completions_best_of_equal_to_n_is_plain_n(http):
    body = {"prompt": "Hi", "max_tokens": 3, "temperature": 0}
    plain = http.post("/v1/completions", json={**body, "n": 2})
    same = http.post("/v1/completions", json={**body, "n": 2, "best_of": 2})
    assert plain.status_code == same.status_code == 200, same.text
    assert [c["text"] for c in same.json()["choices"]] == [c["text"] for c in plain.json()["choices"]]
    assert http.post("/v1/completions", json={**body, "best_of": 1}).status_code == 200


def test_chat_refuses_best_of(http):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "best_of": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "best_of"


def test_models_retrieve_the_served_name_and_404_otherwise(client, model, http):
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body == {"message": "The model 'no-such-model' does not exist", "type": "invalid_request_error",
                              "param": "model", "code": "model_not_found"}
    assert http.get("/v1/models/org/no-such-model").status_code == 404  # a slash in the name is the name's


def _reference_token_bytes(token_id: int) -> bytes:
    """A byte-level BPE token's raw bytes from its vocabulary string (GPT-2's byte-to-unicode table,
    as transformers defines it): independent of the server's llguidance-based decoder."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from jaxserve.model.tokenizer import load_tokenizer

    unicode_to_byte = {u: b for b, u in bytes_to_unicode().items()}
    return bytes(unicode_to_byte[c] for c in load_tokenizer("default").convert_ids_to_tokens(token_id))


# 23274 and 115 are the two tokens of "日" (bytes e6 97 | a5) in SmolLM2's vocabulary
PARTIAL_TOKEN = 23274


def test_logprob_bytes_are_the_tokens_raw_bytes(client, model):
    """Before: a token holding part of a UTF-8 character came back as token "\ufffd" with bytes
    [239, 191, 189] (U+FFFD's), so a client could not rebuild the character."""
    assert _reference_token_bytes(PARTIAL_TOKEN) == "日".encode()[:2]
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, temperature=0, logprobs=True, top_logprobs=2,
        logit_bias={str(PARTIAL_TOKEN): 100}, extra_body={"ignore_eos": True})
    for entry in resp.choices[0].logprobs.content:
        assert entry.bytes == list(_reference_token_bytes(PARTIAL_TOKEN)), entry
        assert entry.token == "bytes:\\xe6\\x97"  # OpenAI's string for a token that is not whole UTF-8
        assert all(t.bytes != [239, 191, 189] for t in entry.top_logprobs)
    legacy = client.completions.create(model=model, prompt="The sky is", max_tokens=2, temperature=0, logprobs=1,
                                       logit_bias={str(PARTIAL_TOKEN): 100}, extra_body={"ignore_eos": True})
    assert legacy.choices[0].logprobs.tokens == ["bytes:\\xe6\\x97"] * 2
    assert legacy.choices[0].logprobs.text_offset[1] == legacy.choices[0].logprobs.text_offset[0] + 1


def test_logprob_bytes_rebuild_the_text(client, model):
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True)
    content = resp.choices[0].logprobs.content
    assert bytes(b for t in content for b in t.bytes).decode() == resp.choices[0].message.content
