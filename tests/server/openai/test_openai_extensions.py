"""The OpenAI extensions (docs/api.md) on the default model (SmolLM2-135M-Instruct) through the real server:
max_completion_tokens, assistant prefill, echo with logprobs, logit_bias and tool calling, with the
official `openai` client where it has the parameter and raw HTTP otherwise, streamed and not, and the
400s that remain. One server serves the module (lazy compiles, a 4096-token pool)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import ServerProcess, wait_idle

pytestmark = pytest.mark.slow  # loads the default model

SERVER_FLAGS = ["--max-total-tokens", "4096", "--context-length", "1024", "--max-running-requests", "4",
                "--chunked-prefill-size", "256", "--disable-precompile"]
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # SmolLM2's template default
QUESTION = "What is the weather in Paris?"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}, "hour24": {"type": "boolean"}},
                   "required": ["zone", "hour24"]}}}


def chatml(*turns: tuple[str, str], open_turn: str | None = "") -> str:
    """SmolLM2's chat format written out by hand: the independent reference of the chat template."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text if open_turn is None else text + f"<|im_start|>assistant\n{open_turn}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(SERVER_FLAGS, tmp_path_factory.mktemp("default") / "server.log")
    proc.wait_healthy(600)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


MODEL = "SmolLM2-135M-Instruct"


def complete(client, prompt, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)


def stream_text(chunks) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices)


# ---- max_completion_tokens -------------------------------------------------------------------------
def test_max_completion_tokens_on_completions(client):
    got = complete(client, "The sky is", extra_body={"max_completion_tokens": 3, "ignore_eos": True})
    assert got.usage.completion_tokens == 3 and got.choices[0].finish_reason == "length"
    # both given: the smaller wins, whichever field holds it
    for a, b in ((8, 2), (2, 8)):
        both = complete(client, "The sky is", max_tokens=a, extra_body={"max_completion_tokens": b, "ignore_eos": True})
        assert both.usage.completion_tokens == 2
    chunks = list(client.completions.create(model=MODEL, prompt="The sky is", temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"max_completion_tokens": 3, "ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 3 and stream_text(chunks) == got.choices[0].text


def test_max_completion_tokens_on_chat(client):
    msgs = [{"role": "user", "content": QUESTION}]
    got = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=9, max_completion_tokens=4,
                                         extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_completion_tokens=4,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 4
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == got.choices[0].message.content


def test_max_completion_tokens_errors_name_the_field(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_completion_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_completion_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


# ---- chat without the new fields: the template as before ----------------------------------------
def test_plain_chat_greedy_equals_the_hand_written_prompt(client):
    msgs = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=12)
    ref = complete(client, chatml(("system", SYSTEM), ("user", QUESTION)), max_tokens=12)
    assert chat.choices[0].message.content == ref.choices[0].text
    assert chat.usage.prompt_tokens == ref.usage.prompt_tokens


# ---- assistant prefill -----------------------------------------------------------------------------
def test_continue_final_message(http, client):
    prefix = "The weather in Paris is"
    msgs = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": prefix}]
    body = {"model": MODEL, "messages": msgs, "continue_final_message": True, "add_generation_prompt": False,
            "temperature": 0, "max_tokens": 10}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    ref = complete(client, chatml(("system", SYSTEM), ("user", QUESTION), open_turn=prefix), max_tokens=10)
    assert r.json()["choices"][0]["message"]["content"] == ref.choices[0].text
    assert r.json()["usage"]["prompt_tokens"] == ref.usage.prompt_tokens
    body.pop("add_generation_prompt")  # continue_final_message alone implies no generation prompt
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == ref.choices[0].text


def test_add_generation_prompt_false(http, client):
    msgs = [{"role": "user", "content": QUESTION}]
    r = http.post("/v1/chat/completions", json={"messages": msgs, "add_generation_prompt": False, "temperature": 0, "max_tokens": 6})
    assert r.status_code == 200, r.text
    ref = complete(client, chatml(("system", SYSTEM), ("user", QUESTION), open_turn=None), max_tokens=6)
    assert r.json()["usage"]["prompt_tokens"] == ref.usage.prompt_tokens
    assert r.json()["choices"][0]["message"]["content"] == ref.choices[0].text


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True}, "last message to be the assistant's"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
      "continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
])
def test_continue_final_message_refusals(http, body, message):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "continue_final_message" and message in err["message"]


# ---- echo --------------------------------------------------------------------------------------------
def test_echo_logprobs_match_the_decode_path(client):
    """The prompt logprobs of an echo equal the logprobs the same tokens had when they were generated."""
    gen = complete(client, "The sky is", max_tokens=4, logprobs=1, extra_body={"ignore_eos": True})
    gen_tokens, gen_logprobs = gen.choices[0].logprobs.tokens, gen.choices[0].logprobs.token_logprobs
    full = "The sky is" + gen.choices[0].text
    echo = complete(client, full, max_tokens=0, echo=True, logprobs=1)
    choice = echo.choices[0]
    assert choice.text == full and echo.usage.completion_tokens == 0 and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and "".join(lp.tokens) == full
    assert lp.tokens[-4:] == gen_tokens
    assert lp.token_logprobs[-4:] == pytest.approx(gen_logprobs, abs=2e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_with_logprobs_and_output(client):
    kw = dict(max_tokens=3, echo=True, logprobs=2, extra_body={"ignore_eos": True})
    got = complete(client, "Numbers: 1, 2,", **kw)
    choice = got.choices[0]
    plain = complete(client, "Numbers: 1, 2,", max_tokens=3, logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    assert choice.text == "Numbers: 1, 2," + plain.text
    lp = choice.logprobs
    n_prompt = got.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None
    assert lp.tokens[n_prompt:] == plain.logprobs.tokens and lp.top_logprobs[n_prompt:] == plain.logprobs.top_logprobs
    assert lp.text_offset[n_prompt] == len("Numbers: 1, 2,")
    chunks = list(client.completions.create(model=MODEL, prompt="Numbers: 1, 2,", temperature=0, stream=True, **kw))
    assert stream_text(chunks) == choice.text
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None


def test_echo_max_tokens_zero_streamed_and_without_logprobs(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, echo=True, logprobs=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert stream_text(chunks) == "Hello there" and chunks[-1].usage.completion_tokens == 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    plain = complete(client, "Hello there", max_tokens=0, echo=True)
    assert plain.choices[0].text == "Hello there" and plain.choices[0].logprobs is None
    streamed = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, echo=True, temperature=0, stream=True))
    assert stream_text(streamed) == complete(client, "Hello there", max_tokens=3, echo=True).choices[0].text


# ---- logit_bias ----------------------------------------------------------------------------------------
def test_logit_bias_forces_and_bans(client, http):
    plain = complete(client, "The sky is", max_tokens=4, logprobs=0, extra_body={"ignore_eos": True})
    first = plain.choices[0].logprobs.tokens[0]
    first_id = http.post("/generate", json={"text": "The sky is", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()["output_ids"][0]
    banned = complete(client, "The sky is", max_tokens=4, logprobs=0, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    forced = complete(client, "The sky is", max_tokens=4, logit_bias={"253": 100}, extra_body={"ignore_eos": True})
    r = http.post("/generate", json={"text": "The sky is", "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                              "ignore_eos": True, "logit_bias": {"253": 100}}})
    assert r.status_code == 200 and r.json()["output_ids"] == [253, 253, 253, 253]  # 253 is " a"
    assert r.json()["text"] == " a a a a"
    assert forced.choices[0].text == r.json()["text"]
    chunks = list(client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, stream=True,
                                            logit_bias={"253": 100}, extra_body={"ignore_eos": True}))
    assert stream_text(chunks) == forced.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          max_tokens=3, logit_bias={"253": 100}, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3 and chat.choices[0].message.content == " a a a"
    # an unbiased greedy request after biased ones: unchanged
    assert complete(client, "The sky is", max_tokens=4, logprobs=0, extra_body={"ignore_eos": True}).choices[0].text == plain.choices[0].text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/generate"])
@pytest.mark.parametrize("bias, message", [
    ({"49152": 1}, "outside the vocabulary"),
    ({"12": 100.5}, "in [-100, 100]"),
    ({"12": -101}, "in [-100, 100]"),
    ({"twelve": 1}, "integer token ids"),
])
def test_logit_bias_refusals(http, route, bias, message):
    if route == "/generate":
        body = {"text": "Hi", "sampling_params": {"logit_bias": bias}}
    elif route == "/v1/completions":
        body = {"prompt": "Hi", "logit_bias": bias}
    else:
        body = {"messages": [{"role": "user", "content": "Hi"}], "logit_bias": bias}
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    param = "sampling_params.logit_bias" if route == "/generate" else "logit_bias"
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]


def test_logit_bias_too_many_entries(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "logit_bias": {str(t): 1 for t in range(301)}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias" and "at most 300" in r.json()["error"]["message"]


# ---- tool calling --------------------------------------------------------------------------------------
def _check_call(call, tool):
    assert call.type == "function" and call.id and call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("question, choice, want", [
    (QUESTION, "required", None),
    ("What time is it in Tokyo?", {"type": "function", "function": {"name": "get_time"}}, TIME),
    (QUESTION, {"type": "function", "function": {"name": "get_weather"}}, WEATHER),
])
def test_forced_tool_call_is_valid(client, question, choice, want):
    msgs = [{"role": "user", "content": question}]
    resp = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice=choice,
                                          temperature=0, max_tokens=200)
    choice0 = resp.choices[0]
    assert choice0.finish_reason == "tool_calls" and len(choice0.message.tool_calls) == 1
    call = choice0.message.tool_calls[0]
    tool = want or {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    _check_call(call, tool)
    # streamed: index, id and name first, then the argument text; the same call
    stream = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice=choice,
                                            temperature=0, max_tokens=200, stream=True)
    deltas = [d for c in stream if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == call.function.name
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 3  # the argument text arrives in pieces as it is decoded
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_forced_call_with_sampling_validates(client):
    msgs = [{"role": "user", "content": "Plan my day."}]
    resp = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                          temperature=1.0, seed=3, n=3, max_tokens=200)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        _check_call(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])


def test_auto_stream_equals_non_stream(client):
    msgs = [{"role": "user", "content": QUESTION}]
    kw = dict(model=MODEL, messages=msgs, tools=[WEATHER], temperature=0, max_tokens=60)
    full = client.chat.completions.create(**kw).choices[0]
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == full.finish_reason
    if full.message.tool_calls:
        assert full.finish_reason == "tool_calls"
        assert [d.function.name for d in calls if d.function.name] == [t.function.name for t in full.message.tool_calls]
    else:
        assert content == full.message.content and not calls


def test_tool_choice_none_ignores_tools(client):
    msgs = [{"role": "user", "content": QUESTION}]
    with_none = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none",
                                               temperature=0, max_tokens=10)
    plain = client.chat.completions.create(model=MODEL, messages=msgs, tool_choice="none", temperature=0, max_tokens=10)
    assert with_none.choices[0].message.tool_calls is None
    assert with_none.choices[0].message.content == plain.choices[0].message.content
    assert with_none.usage.prompt_tokens == plain.usage.prompt_tokens


def test_tools_round_trip(client):
    """The openai client's tools= loop: a forced call, the tool's result, then the model's answer."""
    msgs = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    second = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=24)
    assert second.choices[0].message.content and second.choices[0].message.tool_calls is None
    # the earlier call and the result are in the prompt (as the default tool prompt renders them)
    turn = f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>'
    ref = complete(client, chatml(("system", SYSTEM), ("user", QUESTION), ("assistant", turn),
                                  ("user", '<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response>')),
                   max_tokens=24)
    assert second.choices[0].message.content == ref.choices[0].text


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name", "do not declare"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "constrains"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "'get_weather' twice"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name", "required"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "should be 'none', 'auto' or 'required'"),
])
def test_tool_refusals(http, body, param, message):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_auto_parses_calls_and_content_of_a_pinned_reply(http):
    """A reply pinned by an EBNF grammar: text, then two calls. Parsed into content and tool_calls,
    streamed the same, and cut to one call with parallel_tool_calls false."""
    calls = [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "CET", "hour24": True})]
    reply = "Checking.\n" + "\n".join(
        f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)
    body = {"messages": [{"role": "user", "content": QUESTION}], "tools": [WEATHER, TIME], "temperature": 0,
            "ebnf": "start: " + json.dumps(reply)}
    for parallel, want in ((True, calls), (False, calls[:1])):
        r = http.post("/v1/chat/completions", json={**body, "parallel_tool_calls": parallel})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"].strip() == "Checking."
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
        assert got == want
        with http.stream("POST", "/v1/chat/completions", json={**body, "parallel_tool_calls": parallel, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
        streamed: dict[int, list] = {}
        for d in deltas:
            if "id" in d:
                streamed[d["index"]] = [d["function"]["name"], ""]
            streamed[d["index"]][1] += d["function"]["arguments"]
        assert [(n, json.loads(a)) for n, a in streamed.values()] == want
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events).strip() == "Checking."
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_idle_after_everything(http):
    """Refused, forced, echoed and biased requests leave no page locked or outside the prefix cache."""
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER],
                                                 "tool_choice": "required", "max_tokens": 3, "stream": True})
    assert r.status_code == 200  # a forced call cut short by max_tokens, streamed
    wait_idle(http, timeout=60)



# ---- function tools on the Responses API ----------------------------------------------------------------
def _flat(tool: dict) -> dict:
    """A chat `tools` entry in the Responses API's flat form."""
    return {"type": "function", **tool["function"]}


def test_responses_forced_call_is_the_chat_call_streamed_and_not(client):
    """A forced call through /v1/responses is the call /v1/chat/completions makes for the same conversation,
    as a function_call item; streamed, its arguments arrive in pieces that add up to it."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=[WEATHER, TIME],
                                          tool_choice="required", temperature=0, max_tokens=200)
    want = chat.choices[0].message.tool_calls[0].function
    kw = dict(model=MODEL, input=QUESTION, tools=[_flat(WEATHER), _flat(TIME)], tool_choice="required",
              temperature=0, max_output_tokens=200)
    resp = client.responses.create(**kw)
    assert [item.type for item in resp.output] == ["function_call"] and resp.status == "completed"
    call = resp.output[0]
    assert (call.name, call.arguments) == (want.name, want.arguments) and call.call_id.startswith("call_")
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 3 and "".join(deltas) == want.arguments  # a forced call streams as it is decoded
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == want.arguments and done[0].name == want.name
    assert [(i.type, i.name, i.arguments) for i in final.output] == [("function_call", want.name, want.arguments)]
    named = client.responses.create(**{**kw, "tool_choice": {"type": "function", "name": "get_time"}})
    assert named.output[0].name == "get_time"
    jsonschema.validate(json.loads(named.output[0].arguments), TIME["function"]["parameters"])


def test_responses_tool_result_round_trip_equals_the_chat(client):
    """The call's output sent back, through previous_response_id and as explicit input items: the
    answer is the chat's with the same assistant call and tool message."""
    tools = [_flat(WEATHER)]
    first = client.responses.create(model=MODEL, input=QUESTION, tools=tools, tool_choice="required", temperature=0,
                                    max_output_tokens=200)
    call = first.output[0]
    result = json.dumps({"temperature": 21, "sky": "sunny"})
    output_item = {"type": "function_call_output", "call_id": call.call_id, "output": result}
    kw = dict(model=MODEL, tools=tools, tool_choice="none", temperature=0, max_output_tokens=24)
    chained = client.responses.create(previous_response_id=first.id, input=[output_item], **kw)
    explicit = client.responses.create(input=[{"role": "user", "content": QUESTION},
                                              {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                               "arguments": call.arguments}, output_item], **kw)
    msgs = [{"role": "user", "content": QUESTION},
            {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                                  "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    ref = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none", temperature=0,
                                         max_tokens=24)
    assert chained.output_text == explicit.output_text == ref.choices[0].message.content
    assert chained.usage.input_tokens == explicit.usage.input_tokens == ref.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as orphan:  # an output no call of the conversation asked for
        client.responses.create(previous_response_id=first.id, input=[{**output_item, "call_id": "call_other"}], **kw)
    assert orphan.value.body["param"] == "input[0].call_id" and "call_other" in orphan.value.body["message"]


def test_responses_forced_call_cut_by_the_length_limit_reads_the_same_streamed_or_not(client):
    kw = dict(model=MODEL, input=QUESTION, tools=[_flat(WEATHER)], tool_choice="required", temperature=0, max_output_tokens=18)
    whole = client.responses.create(**kw)
    streamed = list(client.responses.create(**kw, stream=True))[-1].response
    assert whole.status == streamed.status == "incomplete"
    assert [(i.type, i.name, i.arguments, i.status) for i in whole.output] == \
        [(i.type, i.name, i.arguments, i.status) for i in streamed.output] == \
        [("function_call", "get_weather", whole.output[0].arguments, "incomplete")]
    assert whole.output[0].arguments and not whole.output[0].arguments.endswith("}")  # cut inside the arguments


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "name": "x</tool_call>y", "parameters": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools[0].parameters"),
    ({"tools": [_flat(WEATHER), _flat(WEATHER)]}, "tools[1].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "bogus"}}]}, "tools[0].parameters"),
    ({"tools": [_flat(WEATHER)], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
])
def test_responses_tool_refusals_name_the_responses_field(http, body, param):
    r = http.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and ".function." not in error["param"], error
    wait_idle(http, timeout=60)

# ---- the default model behind the real sglang-router: a tokenizer path it can load ------------------
def test_server_info_names_a_tokenizer_dir_the_router_loads(server, http, tmp_path):
    from transformers import AutoTokenizer

    from jaxserve.model.tokenizer import load_tokenizer
    from tests.server.conftest import real_router

    info, model_info = http.get("/get_server_info").json(), http.get("/get_model_info").json()
    assert info["resolved_model_path"].endswith(".gguf")
    assert info["model_path"] == info["tokenizer_path"] == model_info["tokenizer_path"]
    text = "Hello, world! <|im_start|>user\nwhat?"
    ours = load_tokenizer("default")  # the tokenizer the server encodes with
    assert AutoTokenizer.from_pretrained(info["model_path"]).encode(text) == ours.encode(text)
    log = tmp_path / "router.log"
    with real_router([server.url], "round_robin", log) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 2, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
    assert "Failed to load tokenizer" not in log.read_text()
