"""POST /v1/responses (and GET / DELETE of stored responses) through the official `openai` client.

The Responses API runs a chat, so each answer is checked against /v1/chat/completions with the same
conversation, greedy: the same text and token counts. Streams are read with the client's own stream
helper, which rebuilds the Response from the events and refuses events out of order. The reasoning
items run over the scripted fake engine of test_launch_flags (no model reasons here).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest

from tests.launch.test_launch_flags import serve  # noqa: F401 (fixture)
from tests.server.conftest import TINY_SERVER_FLAGS, ServerProcess, wait_idle
from tests.server.openai.test_openai_api import client, model  # noqa: F401 (fixtures: the openai client of the shared server)

QUESTION = "Name three colours."


def chat_text(client, model, messages, max_tokens, **kwargs):
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs)
    return resp.choices[0].message.content, resp.usage, resp.choices[0].finish_reason


def test_text_input_is_a_user_message_and_instructions_a_system_one(client, model):
    resp = client.responses.create(model=model, input=QUESTION, instructions="Answer briefly.",
                                   max_output_tokens=10, temperature=0)
    text, usage, finish = chat_text(client, model, [{"role": "system", "content": "Answer briefly."},
                                                    {"role": "user", "content": QUESTION}], 10)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == model
    assert resp.output_text == text
    assert [item.type for item in resp.output] == ["message"]
    assert resp.output[0].role == "assistant" and resp.output[0].content[0].type == "output_text"
    assert resp.usage.input_tokens == usage.prompt_tokens
    assert resp.usage.output_tokens == usage.completion_tokens
    assert resp.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert resp.instructions == "Answer briefly." and resp.max_output_tokens == 10
    if finish == "length":
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed" and resp.incomplete_details is None


def test_message_list_input_and_a_cut_reply_is_incomplete(client, model):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": QUESTION}]
    items = [messages[0], {"type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": messages[1]["content"], "annotations": []}]},
             {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    resp = client.responses.create(model=model, input=items, max_output_tokens=3, temperature=0)
    text, usage, finish = chat_text(client, model, messages, 3)
    assert resp.output_text == text and resp.usage.input_tokens == usage.prompt_tokens
    assert finish == "length" and usage.completion_tokens == 3  # 3 tokens cannot end the tiny model's reply
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete"


def test_stream_events_carry_the_same_response(client, model):
    kwargs = dict(model=model, input=QUESTION, max_output_tokens=12, temperature=0)
    full = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    terminal = {"completed": "response.completed", "incomplete": "response.incomplete"}[full.status]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", terminal]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == full.output_text == final.output_text == events[-4].text
    assert final.usage.output_tokens == full.usage.output_tokens and final.status == full.status
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {final.output[0].id}
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(model=model, input="Hi", instructions="Be kind.", max_output_tokens=6, temperature=0)
    second = client.responses.create(model=model, input=QUESTION, previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    # the instructions of the first response are not carried over (OpenAI's rule)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": QUESTION}]
    text, usage, _ = chat_text(client, model, messages, 6)
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    assert second.previous_response_id == first.id


def test_retrieve_and_delete_a_stored_response(client, model):
    resp = client.responses.create(model=model, input="Hi", max_output_tokens=2, temperature=0)
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text and got.usage == resp.usage
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(resp.id)
    assert err.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=model, input="Hi", previous_response_id=unstored.id, max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"


def test_text_format_json_schema_constrains_the_reply(client, model):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}},
              "required": ["colour"], "additionalProperties": False}
    resp = client.responses.create(model=model, input="Give a colour as JSON.", max_output_tokens=40, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "colour", "schema": schema}})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize("fields, param, status", [
    ({"tools": [{"type": "web_search"}]}, "tools[0]", 400),
    ({"input": []}, "input", 400),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": "x"}]}, "input[0].type", 400),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output", 400),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id", 400),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c", "output": "x"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, "input[1].call_id", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type", 400),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", 400),
    ({"input": [{"role": "user"}]}, "input[0].content", 400),
    ({"max_output_tokens": -1}, "max_output_tokens", 400),
    ({"temperature": -1.0}, "temperature", 400),
    ({"temperature": "hot"}, "temperature", 400),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", 400),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id", 404),
    ({"input": ["hi"]}, "input[0]", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text", 400),
    ({"input": [{"role": "user", "content": ["x"]}]}, "input[0].content[0]", 400),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format.schema", 400),
    ({"max_tokens": 5}, "max_tokens", 400),
    ({"include": ["file_search_call.results"]}, "include[0]", 400),
    ({"include": ["message.output_text.logprobs"], "stream": True}, "include", 400),
    ({"top_logprobs": 21}, "top_logprobs", 400),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": -1}, "top_logprobs", 400),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages", 400),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", 400),
    ({"metadata": {"k" * 65: "v"}}, "metadata", 400),
    ({"metadata": {"k": "v" * 513}}, "metadata.k", 400),
])
def test_bad_requests_name_the_field_and_leak_nothing(http, fields, param, status):
    resp = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2, **fields})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    wait_idle(http)


def test_request_id_is_the_response_id_and_one_in_flight_at_a_time(serve):
    pieces = ["a"] * 40
    client, engine = serve(pieces)
    body = {"input": "Hi", "request_id": "resp_mine", "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["response"]["id"] == "resp_mine"
        again = client.post("/v1/responses", json={**body, "stream": False})
        assert again.status_code == 400 and again.json()["error"]["param"] == "request_id", again.text
        list(lines)
    got = client.get("/v1/responses/resp_mine").json()
    assert got["id"] == "resp_mine" and got["output"][0]["content"][0]["text"] == "".join(pieces)


def test_store_keeps_the_newest_within_its_entries_and_bytes():
    from jaxserve.server.openai.responses.api import ResponseStore

    store = ResponseStore(max_entries=3, max_bytes=2000)
    for i in range(5):
        store.put({"id": f"r{i}", "text": "x" * 100}, [{"role": "user", "content": "hi"}], [])
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    store.put({"id": "big", "text": "x" * 1800}, [], [])  # over the bytes with r3 and r4: r3 goes too
    assert store.get("big") is not None and store.get("r3") is None and store.num_bytes <= 2000
    store.put({"id": "huge", "text": "x" * 3000}, [], [])  # larger than the whole budget: not kept
    assert store.get("huge") is None and store.get("big") is not None
    assert store.delete("big") and not store.delete("big")
    assert store.num_bytes == sum(len(json.dumps(part)) for part in store.get("r4"))


def test_a_reasoning_reply_is_a_reasoning_item_then_the_message(serve):
    pieces = ["<think>", "six ", "sevens", "</think>", "The answer", " is 42."]
    client, _ = serve(pieces, reasoning_parser="deepseek-r1")
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    resp = oai.responses.create(model="m", input="What is 6 x 7?")
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "six sevens"
    assert resp.output_text == "The answer is 42."
    with oai.responses.stream(model="m", input="What is 6 x 7?") as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert "response.reasoning_text.delta" in types and types[-1] == "response.completed"
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "six sevens"
    assert final.output_text == "The answer is 42."
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]


CALL = '<tool_call>\n{{"name": "f", "arguments": {{"a": {}}}}}\n</tool_call>'
F_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def _items(resp: dict) -> list[tuple]:
    return [(i["type"], i.get("name"), i.get("arguments"), i.get("status")) for i in resp["output"]]


def _streamed(client, body: dict) -> dict:
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events[-1]["response"]


@pytest.mark.parametrize("parallel, want", [(True, [("function_call", "f", '{"a": 1}', "completed"),
                                                     ("function_call", "f", '{"a": 2}', "completed")]),
                                            (False, [("function_call", "f", '{"a": 1}', "completed")])])
def test_whitespace_between_calls_is_no_message_streamed_or_not(serve, parallel, want):
    client, _ = serve(["\n", CALL.format(1), "\n", CALL.format(2), "\n"], tool_call_parser="qwen25")
    body = {"input": "Call f twice.", "tools": [F_TOOL], "parallel_tool_calls": parallel}
    assert _items(client.post("/v1/responses", json=body).json()) == want
    assert _items(_streamed(client, body)) == want


def test_text_around_a_call_is_a_message_streamed_or_not(serve):
    client, _ = serve(["Sure.", "\n", CALL.format(3)], tool_call_parser="qwen25")
    body = {"input": "Call f.", "tools": [F_TOOL]}
    whole, streamed = client.post("/v1/responses", json=body).json(), _streamed(client, body)
    assert _items(whole) == _items(streamed) == [("message", None, None, "completed"), ("function_call", "f", '{"a": 3}', "completed")]
    assert whole["output"][0]["content"][0]["text"] == streamed["output"][0]["content"][0]["text"] == "Sure.\n"


def test_a_draining_server_still_answers_gets_of_stored_responses(serve):
    """While the server drains (SIGTERM) stored responses stay readable: a background response that
    finishes during the drain was lost behind a 503. What needs the engine, or changes the store, is 503."""
    client, _ = serve(["ok"])
    rid = client.post("/v1/responses", json={"input": "Hi"}).json()["id"]
    client.app.state.draining = True
    got = client.get(f"/v1/responses/{rid}")
    assert got.status_code == 200 and got.json()["output"][0]["content"][0]["text"] == "ok"
    assert client.get(f"/v1/responses/{rid}/input_items").json()["data"][0]["content"][0]["text"] == "Hi"
    assert client.post("/v1/responses", json={"input": "Hi"}).status_code == 503
    assert client.delete(f"/v1/responses/{rid}").status_code == 503
    assert client.post(f"/v1/responses/{rid}/cancel").status_code == 503


def test_a_request_id_with_slashes_is_retrieved_and_deleted(serve):
    client, _ = serve(["ok"])
    assert client.post("/v1/responses", json={"input": "Hi", "request_id": "team/a/1"}).json()["id"] == "team/a/1"
    assert client.get("/v1/responses/team/a/1").json()["output"][0]["content"][0]["text"] == "ok"
    assert client.delete("/v1/responses/team/a/1").json()["deleted"] is True
    assert client.get("/v1/responses/team/a/1").json()["error"]["param"] == "response_id"


def test_a_stored_response_route_names_both_its_methods(http):
    r = http.post("/v1/responses/resp_x")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) >= {"GET", "DELETE"}, r.headers


@pytest.mark.parametrize("path, allowed, use", [("/v1/responses/resp_x/input_items", "GET, HEAD", "GET or HEAD"),
                                               ("/v1/responses/resp_x/cancel", "POST", "POST")])
def test_delete_of_a_route_under_a_stored_response_is_a_405(http, path, allowed, use):
    """DELETE .../input_items was a 404 for a response id "resp_x/input_items" (the DELETE route's
    {response_id:path} took the whole rest of the path); it is the sub-route's 405, as for any route."""
    r = http.delete(path)
    # Starlette writes Allow from a set: its order follows the process's string hashing
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == set(allowed.split(", ")), (r.status_code, r.text)
    assert r.json()["error"]["message"] == f"DELETE {path} is not allowed: use {use}"


def _longest_fitting_suffix(client, model, convo):
    """(k, the chat's reply to convo[k:]) for the smallest k the chat API accepts, trying k from the end."""
    found = None
    for k in range(len(convo) - 1, -1, -1):
        try:
            found = (k, client.chat.completions.create(model=model, messages=convo[k:], max_tokens=8, temperature=0))
        except openai.BadRequestError:
            break
    return found


def test_truncation_auto_keeps_the_longest_suffix_of_a_long_conversation(client, model):
    """1200 short messages (a search over starts, not a try of each): the chat's longest fitting suffix."""
    convo = [{"role": ("user", "assistant")[i % 2], "content": f"msg {i} word word"} for i in range(1201)]
    resp = client.responses.create(model=model, input=convo, truncation="auto", max_output_tokens=8, temperature=0)
    k, chat = _longest_fitting_suffix(client, model, convo)
    assert 1100 < k < 1200
    assert resp.output_text == chat.choices[0].message.content and resp.usage.input_tokens == chat.usage.prompt_tokens


def test_truncation_auto_drops_the_oldest_messages_to_fit(client, model):
    """Over the context (256 tokens on the test server), the default truncation is a 400; "auto" answers
    as the chat of the longest suffix of the conversation that the chat API itself accepts."""
    words = "one two three four five six seven eight nine ten".split()
    passage = [" ".join(words[(i + j) % 10] for j in range(70)) for i in range(4)]
    convo = [{"role": role, "content": text} for role, text in zip(["user", "assistant"] * 2, passage)]
    convo.append({"role": "user", "content": QUESTION})
    kw = dict(model=model, max_output_tokens=8, temperature=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(input=convo, **kw)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"].startswith("input"), err.value.body
    resp = client.responses.create(input=convo, truncation="auto", **kw)
    k, chat = _longest_fitting_suffix(client, model, convo)
    assert k >= 1 and resp.truncation == "auto"
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert resp.output_text == chat.choices[0].message.content and resp.usage.input_tokens == chat.usage.prompt_tokens


@pytest.fixture(scope="module")
def small_pool(tiny_model_dir, tmp_path_factory):
    """(openai client, model, max_req_input_len) of a tiny-model server whose KV pool (160 tokens) bounds
    a prompt below its context (256 tokens)."""
    proc = ServerProcess(["--model-path", tiny_model_dir, *TINY_SERVER_FLAGS, "--max-total-tokens", "160"],
                         tmp_path_factory.mktemp("small_pool") / "server.log")
    proc.wait_healthy()
    try:
        info = httpx.get(proc.url + "/get_server_info", timeout=30).json()
        with openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0) as client:
            yield client, info["served_model_name"], info["max_req_input_len"]
    finally:
        proc.stop()


def test_truncation_auto_fits_a_kv_pool_smaller_than_the_context(small_pool):
    """Where the KV pool, not the context, bounds a prompt, the 400 is context_length_exceeded (it was
    invalid_value) and "auto" truncates to the longest suffix the chat API accepts (it was a 400)."""
    client, model, limit = small_pool
    assert limit < 256
    words = "one two three four five six seven eight nine ten".split()
    convo = [{"role": ("user", "assistant")[i % 2], "content": " ".join(words[(i + j) % 10] for j in range(25))}
             for i in range(6)] + [{"role": "user", "content": QUESTION}]
    kw = dict(model=model, max_output_tokens=8, temperature=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(input=convo, **kw)
    assert err.value.body["code"] == "context_length_exceeded" and "KV pool" in err.value.body["message"], err.value.body
    resp = client.responses.create(input=convo, truncation="auto", **kw)
    k, chat = _longest_fitting_suffix(client, model, convo)
    assert 1 <= k < len(convo) - 1 and resp.usage.input_tokens < limit
    assert resp.output_text == chat.choices[0].message.content and resp.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("truncation", ["disabled", "auto"])
def test_instructions_over_the_context_are_a_400_naming_them(client, model, truncation):
    """Instructions that alone fill the context (256 tokens): the 400 names instructions, with or
    without truncation (which drops input messages only); the same instructions half as long are
    answered."""
    words = "one two three four five six seven eight nine ten".split()
    long = " ".join(words[i % 10] for i in range(300))
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, input="Hi", instructions=long, truncation=truncation, max_output_tokens=4)
    assert err.value.body["param"] == "instructions" and err.value.body["code"] == "context_length_exceeded", err.value.body
    short = " ".join(words[i % 10] for i in range(100))
    ok = client.responses.create(model=model, input="Hi", instructions=short, truncation=truncation, max_output_tokens=4)
    assert ok.status in ("completed", "incomplete")


def _poll(client, response_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while (resp := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, resp
        time.sleep(0.05)
    return resp


def test_a_background_response_runs_to_the_chats_answer(client, model, http):
    messages = [{"role": "user", "content": QUESTION}]
    created = client.responses.create(model=model, input=QUESTION, background=True, max_output_tokens=24, temperature=0)
    assert created.background and created.status in ("queued", "in_progress") and created.output == []
    done = _poll(client, created.id)
    assert done.background and done.status in ("completed", "incomplete")
    assert done.output_text == chat_text(client, model, messages, 24)[0]
    assert client.responses.cancel(created.id).status == done.status  # a finished one is returned as it is
    wait_idle(http)


def test_cancel_stops_a_background_response_and_frees_its_request(client, model, http):
    """Cancelled while it decodes (tried until a cancel lands before the reply ends): status cancelled,
    the engine request aborted (the server goes idle), a continuation refused while it ran."""
    for _ in range(5):
        created = client.responses.create(model=model, input=QUESTION, background=True, max_output_tokens=200,
                                          temperature=0)
        running = client.responses.retrieve(created.id).status in ("queued", "in_progress")
        if running:
            with pytest.raises(openai.BadRequestError) as err:
                client.responses.create(model=model, input="and more", previous_response_id=created.id, max_output_tokens=2)
            running = err.value.body["param"] == "previous_response_id"
        cancelled = client.responses.cancel(created.id)
        if cancelled.status == "cancelled":
            break
    assert running and cancelled.status == "cancelled" and cancelled.background
    assert client.responses.retrieve(created.id).status == "cancelled"
    wait_idle(http)


@pytest.mark.parametrize("fields, param", [
    ({"background": True, "store": False}, "store"),
    ({"background": True, "stream": True}, "stream"),
])
def test_background_needs_a_store_and_no_stream(http, fields, param):
    resp = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2, **fields})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_cancel_names_an_unknown_id_and_refuses_a_foreground_response(client, model):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.cancel("resp_unknown")
    assert err.value.body["param"] == "response_id"
    done = client.responses.create(model=model, input=QUESTION, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(done.id)
    assert err.value.body["param"] == "response_id"


@pytest.mark.parametrize("cut_by_stop", [False, True])
def test_include_logprobs_are_the_chats_token_logprobs(client, model, cut_by_stop):
    """The same entries as the chat's logprobs, a token that a stop string cut out of the text included."""
    messages = [{"role": "user", "content": QUESTION}]
    extra = {}
    if cut_by_stop:  # a stop string from the middle of the unstopped reply
        extra = {"stop": [chat_text(client, model, messages, 8)[0][6:8]]}
    resp = client.responses.create(model=model, input=QUESTION, max_output_tokens=8, temperature=0, top_logprobs=2,
                                   include=["message.output_text.logprobs"], extra_body=extra)
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=2, **extra)
    (part,) = resp.output[0].content
    got = [(p.token, p.bytes, [t.token for t in p.top_logprobs]) for p in part.logprobs]
    want = [(p.token, p.bytes, [t.token for t in p.top_logprobs]) for p in chat.choices[0].logprobs.content]
    assert got == want and resp.top_logprobs == 2 and part.text == chat.choices[0].message.content
    # the second request reads the first's prompt from the prefix cache: its logits come from another
    # summation order, equal to ~1e-6
    logprobs = [[p.logprob] + [t.logprob for t in p.top_logprobs] for p in part.logprobs]
    assert logprobs == [pytest.approx([p.logprob] + [t.logprob for t in p.top_logprobs], abs=1e-4)
                        for p in chat.choices[0].logprobs.content]
    assert (len(got) < 8) == cut_by_stop and len(got) == resp.usage.output_tokens


class _FakeReply:
    id = "resp_fake"
    input_items = []

    def response(self, status, output, out=None, incomplete=None, error=None):
        return {"id": self.id, "status": status, "output": output, "error": error, "background": True}


class _FakeGroup:
    def __init__(self, fail: bool):
        self.fail, self.aborted = fail, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.fail:
            raise RuntimeError("boom")
        await asyncio.sleep(3600)

    def abort(self):
        self.aborted = True


@pytest.mark.parametrize("how", ["cancelled before its first step", "cancelled while it runs", "raised"])
def test_a_background_run_that_ends_early_is_recorded_and_aborted(how):
    """However a background run ends, its engine request is aborted and the stored response is not left
    queued: a cancel before the task's first step never enters its body."""
    from types import SimpleNamespace

    from jaxserve.server.openai.responses.api import BackgroundResponses, ResponseStore

    async def scenario():
        store = ResponseStore()
        reply, group = _FakeReply(), _FakeGroup(fail=how == "raised")
        store.put(reply.response("queued", []), [], [])
        background = BackgroundResponses(store)
        background.start(reply, SimpleNamespace(group=group), [])
        if how == "cancelled while it runs":
            await asyncio.sleep(0.01)
        if how == "raised":
            await asyncio.sleep(0.01)
            assert not await background.cancel(reply.id)  # already ended
        else:
            assert await background.cancel(reply.id)
        return store.get(reply.id).response, group

    response, group = asyncio.run(scenario())
    assert group.aborted
    assert response["status"] == ("failed" if how == "raised" else "cancelled"), response
    if how == "raised":
        assert "boom" in response["error"]["message"]


def test_input_items_list_the_request_input_as_items(client, model):
    """GET /v1/responses/{id}/input_items: the request's input as item objects (ids sent back kept),
    newest first by default, paged by `after` (the client's auto-paging walks the pages)."""
    text = client.responses.create(model=model, input=QUESTION, max_output_tokens=2, temperature=0)
    (only,) = client.responses.input_items.list(text.id)
    assert only.type == "message" and only.role == "user" and only.id.startswith("msg_")
    assert [(p.type, p.text) for p in only.content] == [("input_text", QUESTION)]

    items = [
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2+3?"},
                                                        {"type": "input_text", "text": " Use the tool."}]},
        {"type": "function_call", "id": "fc_mine", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"type": "message", "id": "msg_theirs", "role": "assistant",
         "content": [{"type": "output_text", "text": "It is 5.", "annotations": []}]},
        {"role": "user", "content": "Thanks."},
    ]
    resp = client.responses.create(model=model, input=items, max_output_tokens=2, temperature=0)
    listed = list(client.responses.input_items.list(resp.id, order="asc"))
    assert [(i.type, getattr(i, "role", None)) for i in listed] == [
        ("message", "system"), ("message", "user"), ("function_call", None), ("function_call_output", None),
        ("message", "assistant"), ("message", "user")]
    assert [p.text for p in listed[1].content] == ["What is 2+3?", " Use the tool."]
    assert listed[2].id == "fc_mine" and (listed[2].call_id, listed[2].name, listed[2].arguments) == (
        "call_1", "add", '{"a": 2, "b": 3}')
    assert listed[3].call_id == "call_1" and listed[3].output == "5"
    assert listed[4].id == "msg_theirs" and listed[4].content[0].type == "output_text"
    assert len({i.id for i in listed}) == 6 and all(i.status == "completed" for i in listed)

    newest_first = client.responses.input_items.list(resp.id)
    assert [i.id for i in newest_first.data] == [i.id for i in reversed(listed)] and newest_first.has_more is False
    page = client.responses.input_items.list(resp.id, limit=2, order="asc")
    assert [i.id for i in page.data] == [i.id for i in listed[:2]] and page.has_more is True
    assert [i.id for i in page.iter_pages().__next__().data] == [i.id for i in listed[:2]]
    assert [i.id for i in client.responses.input_items.list(resp.id, limit=2, order="asc")] == [i.id for i in listed]
    after = client.responses.input_items.list(resp.id, order="asc", after=listed[4].id)
    assert [i.id for i in after.data] == [listed[5].id] and after.has_more is False
    # a continuation lists its own input, not the conversation it continues
    follow = client.responses.create(model=model, input="And 3+4?", previous_response_id=resp.id, max_output_tokens=2,
                                     temperature=0)
    assert [i.content[0].text for i in client.responses.input_items.list(follow.id)] == ["And 3+4?"]


@pytest.mark.parametrize("query, param", [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "many"}, "limit"),
                                          ({"order": "up"}, "order"), ({"after": "msg_nowhere"}, "after")])
def test_input_items_bad_query_is_a_400_naming_it(client, model, query, param):
    resp = client.responses.create(model=model, input="Hi", max_output_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.get(f"/responses/{resp.id}/input_items", cast_to=object, options={"params": query})
    assert err.value.body["param"] == param


def test_input_items_of_an_unknown_or_unstored_response_are_a_404(client, model):
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, temperature=0, store=False)
    for response_id in (unstored.id, "resp_nowhere"):
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.input_items.list(response_id)
        assert err.value.body["param"] == "response_id"
