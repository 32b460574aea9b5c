"""Bad input gets a 400 in OpenAI's error shape naming the field, and the server keeps serving."""

from __future__ import annotations

import json
import re

import pytest

from jaxserve.server.protocol import ResponsesRequest

LONG_TEXT = "hello " * 400  # > 256 tokens, the test server's context length
HUGE_TEXT = "x" * 3_000_000  # too long for any tokenization: refused before the tokenizer runs

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def _ascii_json(body) -> bytes:
    """The body as JSON with \\uXXXX escapes (httpx's json= writes UTF-8, which cannot carry a lone surrogate)."""
    return json.dumps(body).encode()


# (endpoint, body (dict, or raw bytes), expected param or None, text expected in the message)
BAD_INPUTS = [
    (CHAT, {"messages": MSG, "temperature": -1}, "temperature", ">= 0"),
    (CHAT, {"messages": MSG, "top_p": 0}, "top_p", "(0, 1]"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, "top_p", "(0, 1]"),
    (CHAT, {"messages": MSG, "min_p": 2}, "min_p", "[0, 1]"),
    (CHAT, {"messages": MSG, "top_k": 0}, "top_k", "top_k"),
    (CHAT, {"messages": MSG, "n": 0}, "n", "[1, 128]"),
    (CHAT, {"messages": MSG, "n": 1000000}, "n", "[1, 128]"),
    (CHAT, {"messages": MSG, "stop": [""]}, "stop", "empty"),
    (CHAT, {"messages": MSG, "max_tokens": -1}, "max_tokens", ">= 0"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -1}, "max_completion_tokens", ">= 0"),
    (CHAT, {"messages": MSG, "max_tokens": 1000}, "max_tokens", "256"),
    (CHAT, {"messages": [{"role": "user", "content": LONG_TEXT}]}, "messages", "256"),
    (CHAT, {"messages": []}, "messages", "at least one"),
    (CHAT, {"messages": "hi"}, "messages", "list"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", "needs a 'text' field"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, "temperature", "number"),
    (CHAT, {"messages": MSG, "n": "3"}, "n", "integer"),
    (CHAT, {"messages": MSG, "stream": "yes"}, "stream", "bool"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, "top_logprobs", "logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, "top_logprobs", "20"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format.json_schema.schema", "schema"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type", "json"),
    (CHAT, {}, "messages", "required"),
    (CHAT, b'{"messages": [', None, "JSON"),
    (CHAT, b"", None, "empty"),
    (CHAT, b"[1, 2]", None, "object"),
    (COMPLETIONS, {"prompt": ""}, "prompt", "empty"),
    (COMPLETIONS, {"prompt": []}, "prompt", "empty"),
    (COMPLETIONS, {"prompt": LONG_TEXT}, "prompt", "256"),
    (COMPLETIONS, {"prompt": [1, True]}, "prompt[1]", "input should be a valid"),
    (COMPLETIONS, {"prompt": [10**9]}, "prompt", "token ids"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, "max_tokens", ">= 0"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 99}, "logprobs", "20"),
    (COMPLETIONS, {"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    (COMPLETIONS, {"prompt": "hi", "seed": "x"}, "seed", "integer"),
    ("/generate", {"text": "hi", "sampling_params": {"temprature": 0}}, "sampling_params.temprature", "unknown"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 2}}, "sampling_params.top_p", "(0, 1]"),
    ("/generate", {"text": "hi", "input_ids": [1]}, "text", "exactly one"),
    ("/generate", {"sampling_params": {}}, "text", "exactly one"),
    ("/generate", {"text": ""}, "text", "empty"),
    ("/generate", {"input_ids": [-1]}, "input_ids", "token ids"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "2 prompts"),
    ("/generate", {"text": "hi", "return_logprobs": True}, "return_logprobs", "unknown"),
    # the message named no field; without return_logprob SGLang ignores top_logprobs_num (so does jaxserve)
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num",
     "top_logprobs_num: must be in [0, 20], got 21"),
    ("/generate", {"text": LONG_TEXT}, "text", "256"),
    ("/generate", {"text": HUGE_TEXT}, "text", "3000000 characters"),
    (COMPLETIONS, {"prompt": HUGE_TEXT}, "prompt", "3000000 characters"),
    # a lone UTF-16 surrogate is legal JSON (a \udcff escape) but no text: the tokenizer raised a TypeError (a 500)
    ("/generate", _ascii_json({"text": "a\udcffb"}), "text", "surrogate"),
    ("/generate", _ascii_json({"text": ["ok", "a\ud800"]}), "text[1]", "surrogate"),
    (COMPLETIONS, _ascii_json({"prompt": "a\udcffb", "max_tokens": 2}), "prompt", "surrogate"),
    (CHAT, _ascii_json({"messages": [{"role": "user", "content": "a\udcffb"}]}), "messages[0].content", "surrogate"),
    ("/abort_request", {}, "rid", "rid"),
    # logprob_start_len past the prompt was a 200 with empty prompt logprobs; SGLang's scheduler refuses it
    ("/generate", {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 4}, "logprob_start_len",
     "prompt, which has 3 tokens"),
    ("/generate", {"input_ids": [[1, 2], [1, 2, 3, 4]], "return_logprob": True, "logprob_start_len": [0, 5]},
     "logprob_start_len[1]", "has 4 tokens"),
    # a per-prompt list field's error named no prompt; a rid repeated in a batch said "already in use"
    ("/generate", {"text": ["a", "b"], "return_logprob": True, "top_logprobs_num": [1, 50]}, "top_logprobs_num[1]", "20"),
    ("/generate", {"text": ["a", "b"], "return_logprob": True, "token_ids_logprob": [[1], [99999999]]},
     "token_ids_logprob[1]", "got 99999999"),
    ("/generate", {"text": ["a", "b", "c"], "rid": ["x", "y", "x"]}, "rid[2]", "rid[2] 'x' repeats rid[0]"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 10**6}, "logprob_start_len", "past the end"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len", "-1"),
    # seeds outside the signed 64-bit range of OpenAI's schema were accepted (and silently reduced mod 2**32)
    (COMPLETIONS, {"prompt": "hi", "seed": 2**70}, "seed", "64-bit"),
    (COMPLETIONS, {"prompt": "hi", "seed": 2**63}, "seed", "64-bit"),
    (CHAT, {"messages": MSG, "seed": -(2**63) - 1}, "seed", "64-bit"),
    ("/generate", {"text": "hi", "sampling_params": {"seed": 2**64}}, "sampling_params.seed", "64-bit"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"sampling_seed": -(2**70)}]}, "sampling_params[1].sampling_seed", "64-bit"),
    # a lone surrogate in a stop string was a 200 (it can never match); ids past the vocabulary too
    ("/generate", _ascii_json({"text": "hi", "sampling_params": {"stop": ["ok", "\ud800"]}}), "sampling_params.stop[1]", "surrogate"),
    (COMPLETIONS, _ascii_json({"prompt": "hi", "stop": "a\udcff"}), "stop", "surrogate"),
    (CHAT, _ascii_json({"messages": MSG, "stop": ["\ud800"]}), "stop[0]", "surrogate"),
    ("/generate", _ascii_json({"text": "hi", "sampling_params": {"regex": "a\ud800"}}), "sampling_params.regex", "lone surrogate U+D800"),
    (COMPLETIONS, _ascii_json({"prompt": "hi", "max_tokens": 2, "regex": "(a|\udcff)"}), "regex", "lone surrogate U+DCFF"),
    # a new user's break test: a stop_regex that recurses on the empty string was a 500 (MemoryError),
    # and a Responses input item whose type is a list or an object a 500 (unhashable type)
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "stop_regex": "(?R)"}}, "sampling_params.stop_regex", "cannot be searched"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_regex": ["x", "(?0)"]}}, "sampling_params.stop_regex", "cannot be searched"),
    ("/v1/responses", {"input": [{"type": []}]}, "input[0].type", "must be a string"),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi", "type": {"a": 1}}]}, "input[0].type", "must be a string"),
    # a grammar field of the wrong type was a 500 ("grammar source must be a string, got int")
    ("/generate", {"text": "a", "sampling_params": {"regex": 5}}, "sampling_params.regex", "regex: must be a string, got 5 (an integer)"),
    ("/generate", {"text": "a", "sampling_params": {"ebnf": ["x"]}}, "sampling_params.ebnf", 'ebnf: must be a string, got ["x"] (a list)'),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"regex": 5}]}, "sampling_params[1].regex", "must be a string"),
    # SGLang's json_schema is JSON text (Optional[str]); /generate took an object
    ("/generate", {"text": "a", "sampling_params": {"json_schema": {"type": "object"}}}, "sampling_params.json_schema",
     'json_schema: must be a string, got {"type": "object"} (an object)'),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "regex": 5}, "regex", "regex: must be a string, got 5 (an integer)"),
    (CHAT, {"messages": MSG, "max_tokens": 2, "ebnf": 5}, "ebnf", "ebnf: must be a string, got 5 (an integer)"),
    # a too-long prompt of a batch is named with its index, as sampling_params[1] is
    ("/generate", {"text": ["hi", LONG_TEXT]}, "text[1]", "256"),
    ("/generate", {"input_ids": [[1, 2], [1] * 300]}, "input_ids[1]", "256"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [10**12]}}, "sampling_params.stop_token_ids", "vocabulary"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [2, 49152]}}, "sampling_params.stop_token_ids", "vocabulary"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [10**12]}, "stop_token_ids", "vocabulary"),
    (CHAT, {"messages": MSG, "stop_token_ids": [10**12]}, "stop_token_ids", "vocabulary"),
    # logit_bias with one token spelt twice kept one of the biases silently
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"028": 1, "28": -1}}}, "sampling_params.logit_bias",
     "'028' and '28' are the same token id 28"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "logit_bias": {"5": 1, "05": 1}}, "logit_bias", "same token id 5"),
    # chat_template_kwargs was ignored whatever it held
    (CHAT, {"messages": MSG, "chat_template_kwargs": 5}, "chat_template_kwargs", "dictionary"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     "cannot be set"),
    # a grammar that matches no string was a 400 saying llguidance's stop reason (NoExtensionBias)
    ("/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= root"}}, "sampling_params.ebnf",
     "invalid EBNF grammar: the grammar matches no string"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "regex": "[^\\x00-\\x{10FFFF}]"}, "regex",
     "invalid regex: the grammar matches no string"),
    # "a assistant"; a range from -2147483647 for a field that must not be negative
    (CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}, "messages[1].content",
     "field required for an assistant message"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**23}}, "sampling_params.max_new_tokens",
     "must be between 0 and 2147483647, got 1" + "0" * 23),
    # break test of stop 37, each a 500 before: an integer of over 4300 digits (Python's int parsing
    # limit), in any field; a lone surrogate in a value or in a key (named by its path, quoted in
    # the message as an ASCII escape); a key that is no identifier
    ("/generate", b'{"text": "hi", "sampling_params": {"max_new_tokens": 1' + b"0" * 5000 + b"}}", None, "over 4300 digits"),
    (CHAT, b'{"messages": [], "zzz": ' + b"9" * 5000 + b"}", None, "over 4300 digits"),
    ("/generate", _ascii_json({"text": "hi", "sampling_params": {"max_new_tokens": "\ud800"}}),
     "sampling_params.max_new_tokens", "lone surrogate U+D800"),
    (COMPLETIONS, _ascii_json({"prompt": "hi", "temperature": "\udcff"}), "temperature", "temperature"),
    ("/generate", _ascii_json({"text": "hi", "sampling_params": {"\ud800": 1}}), "sampling_params.\ud800", "the key is not valid"),
    ("/generate", _ascii_json({"text": "hi", "\ud800": 1}), "\ud800", "the key is not valid"),
    ("/generate", {"text": "hi", "": 1}, "", '"": unknown field'),
    ("/generate", {"text": "hi", "a b": 1}, "a b", '"a b": unknown field'),
    ("/generate", {"text": "hi", "Text": 1}, "Text", "Text: unknown field"),
    ("/generate", {"text": "hi", "str": 1}, "str", "str: unknown field"),
    (CHAT, {"messages": MSG, "n": 2**31}, "n", "must be in [1, "),
    # a schema nested past Python's recursion limit was a 500 (RecursionError in json.loads)
    ("/generate", {"text": "a", "sampling_params": {"json_schema": "[" * 100000}}, "sampling_params.json_schema",
     "invalid JSON schema: nested too deeply"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 2, "json_schema": '{"items": ' * 5000 + "{}" + "}" * 5000}, "json_schema",
     "nested too deeply"),
    # a union's error named its first member's index (input_ids[0]) instead of the bad value's
    ("/generate", {"input_ids": [[1, 2], [3, 1.5]]}, "input_ids[1][1]", "valid integer"),
    # pydantic's model class names leaked into param (tool_choice.NamedToolChoice.function)
    (CHAT, {"messages": MSG, "tool_choice": {"type": "function"}}, "tool_choice.function", "field required"),
    (CHAT, {"messages": MSG, "tool_choice": {"type": "bogus", "function": {"name": "f"}}}, "tool_choice.type", "'function'"),
    ("/v1/responses", {"input": "hi", "tool_choice": {"name": "f"}}, "tool_choice.type", "field required"),
    # a string of the right type with a wrong value was "has the wrong type; expected one of: literal[...]"
    (CHAT, {"messages": MSG, "tool_choice": "bogus"}, "tool_choice", "should be 'none', 'auto' or 'required'"),
]


@pytest.mark.parametrize("path,body,param,fragment", BAD_INPUTS, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_is_a_400_naming_the_field(http, path, body, param, fragment):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert fragment.lower() in err["message"].lower(), err


# The same bad value gets the same 400 on chat, completions and /generate (its sampling_params, with
# the native name). Chat's seed: true got pydantic's "Input should be a valid integer" and /generate
# "must be a number, got True". (OpenAI field, native field, value, expected message after "<field>: ")
SAME_ON_EVERY_ROUTE = [
    ("seed", "seed", True, "must be an integer, got true (a boolean)"),
    ("seed", "seed", "7", 'must be an integer, got "7" (a string)'),
    ("seed", "seed", 1.5, "must be an integer, got 1.5 (a number)"),
    ("n", "n", True, "must be an integer, got true (a boolean)"),
    ("n", "n", 0, "must be in [1, 128], got 0"),
    ("max_tokens", "max_new_tokens", 2.5, "must be an integer, got 2.5 (a number)"),
    ("max_tokens", "max_new_tokens", -1, "must be >= 0, got -1"),
    ("min_tokens", "min_new_tokens", True, "must be an integer, got true (a boolean)"),
    ("temperature", "temperature", "0.5", 'must be a number, got "0.5" (a string)'),
    ("temperature", "temperature", False, "must be a number, got false (a boolean)"),
    ("top_p", "top_p", [1], "must be a number, got [1] (a list)"),
    ("top_p", "top_p", 1.5, "must be in (0, 1], got 1.5"),
    ("stop", "stop", 5, "must be a string or a list of strings, got 5 (an integer)"),
    ("stop", "stop", ["a", 1], 'must be a string or a list of strings, got ["a", 1] (a list)'),
    ("stop", "stop", [""], "stop strings must not be empty"),
    ("stop_token_ids", "stop_token_ids", [True], "must be a list of integers, got [true] (a list)"),
    ("ignore_eos", "ignore_eos", 1, "must be a boolean, got 1 (an integer)"),
    ("regex", "regex", 5, "must be a string, got 5 (an integer)"),
    ("ebnf", "ebnf", ["x"], 'must be a string, got ["x"] (a list)'),
]


@pytest.mark.parametrize("field, native, value, expected", SAME_ON_EVERY_ROUTE,
                         ids=[f"{r[0]}={r[2]!r}" for r in SAME_ON_EVERY_ROUTE])
def test_same_bad_value_same_error_on_every_route(http, field, native, value, expected):
    answers = {
        CHAT: http.post(CHAT, json={"messages": MSG, "max_tokens": 2, field: value}),
        COMPLETIONS: http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, field: value}),
        "/generate": http.post("/generate", json={"text": "hi", "sampling_params": {native: value}}),
    }
    if field in ResponsesRequest.model_fields:  # the fields /v1/responses has under the same name
        answers["/v1/responses"] = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, field: value})
    for path, r in answers.items():
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        name = native if path == "/generate" else field
        # /generate's param is the field's path (docs/api.md); the message reads the same on every route
        param = f"sampling_params.{native}" if path == "/generate" else field
        # a range error's number is as the route parsed it (OpenAI's models read 1.5 as a float either way)
        assert err["param"] == param and err["message"] == f"{name}: {expected}", (path, err)
    codes = {r.json()["error"]["code"] for r in answers.values()}
    assert len(codes) == 1 and codes <= {"invalid_type", "invalid_value"}, codes


def test_engine_field_names_in_openai_messages_are_the_openai_names(http):
    r = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 4, "min_tokens": 10})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "min_tokens", err
    assert err["message"] == "min_tokens: must be <= max_tokens (4), got 10", err


def test_prompt_too_long_message_gives_both_numbers(http):
    r = http.post(COMPLETIONS, json={"prompt": LONG_TEXT})
    message = r.json()["error"]["message"]
    num_tokens = int(re.search(r"prompt has (\d+) tokens", message).group(1))
    assert num_tokens > 256 and "context length is 256" in message, message
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_client_gone_before_its_body_arrived_is_not_a_server_error(server, http):
    """A client that closes the connection while its body is still due: logged as 499, no 500, no
    traceback (nothing was submitted), and the server serves on."""
    import socket
    import time

    for path in ("/v1/responses", CHAT):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 1000\r\n\r\n{{\"input\": ".encode())
        deadline = time.monotonic() + 30
        while f"POST {path} 499" not in server.log():
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.1)
    log = server.log()
    assert "ClientDisconnect" not in log and "POST /v1/responses 500" not in log, log[-3000:]
    assert http.get("/health").status_code == 200


def test_a_client_gone_during_a_non_streamed_generation_is_logged_as_499(server):
    """The client leaves after its request was submitted: the access log says 499 (it said 200, for a
    reply nobody read), with the prompt's tokens counted (the 499 of a body that never arrived has none)."""
    import socket
    import time

    body = json.dumps({"text": "count with me", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
    seen = len(server.log())
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        time.sleep(0.05)
    deadline = time.monotonic() + 60
    while not (line := re.search(r"POST /generate (\d+) prompt_tokens=([1-9]\d*) .*", server.log()[seen:])):
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    assert line.group(1) == "499", line.group(0)


def test_a_stream_its_client_left_logs_the_tokens_it_was_sent(server):
    """A streamed /generate whose client leaves mid-stream: its access line counts the prompt and the
    tokens streamed before the abort (it said prompt_tokens=0 completion_tokens=0: tokens were
    counted only at a sequence's finish, which an abandoned stream never reaches)."""
    import socket
    import time

    max_new = 240
    body = json.dumps({"text": "count with me", "stream": True,
                       "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}})
    seen = len(server.log())
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        received = b""
        while received.count(b"data:") < 3:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    deadline = time.monotonic() + 60
    while not (line := re.search(r"POST /generate (\d+) prompt_tokens=(\d+) completion_tokens=(\d+)", server.log()[seen:])):
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    status, prompt, completion = map(int, line.groups())
    assert status == 200 and prompt > 0, line.group(0)
    assert 3 <= completion < max_new, line.group(0)  # what was streamed, and the rest was aborted


def test_an_internal_error_closes_the_connection():
    """A 500 (a bug) says `Connection: close`: uvicorn closes the connection after it, and a keep-alive
    client that was not told so had its next request reset."""
    import asyncio

    from jaxserve.server.errors import EXCEPTION_HANDLERS

    response = asyncio.run(EXCEPTION_HANDLERS[Exception](None, RuntimeError("boom")))
    assert response.status_code == 500 and response.headers["connection"] == "close"
    assert json.loads(response.body)["error"]["message"] == "internal server error: RuntimeError: boom"


def test_deeply_nested_tool_call_arguments_are_kept_as_text(http):
    """An assistant tool call whose arguments are JSON nested past Python's recursion limit was a 500
    (the chat template's arguments are decoded); they go to the template as the text sent."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "[" * 100000}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    r = http.post(CHAT, json={"messages": messages, "max_tokens": 1})
    assert r.status_code in (200, 400) and "internal" not in r.text, r.text


def test_null_means_default(http):
    body = {"messages": MSG, "max_tokens": 2, "top_p": None, "temperature": None, "stop": None, "n": None,
            "stream": None, "seed": None}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_server_still_serves_after_bad_input(http):
    for path, body, _, _ in BAD_INPUTS[:5]:
        http.post(path, json=body)
    assert http.get("/health").status_code == 200
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_logprob_start_len_at_the_prompt_length_means_no_prompt_positions(http):
    """SGLang accepts logprob_start_len == the prompt's length: no prompt positions, only output logprobs."""
    def meta(start: int) -> dict:
        r = http.post("/generate", json={"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": start,
                                         "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]

    at_end = meta(3)
    assert at_end["input_token_logprobs"] == [] and len(at_end["output_token_logprobs"]) == 1
    assert [t for _, t, _ in meta(1)["input_token_logprobs"]] == [2, 3]
    # without return_logprob the field is ignored, as in SGLang
    r = http.post("/generate", json={"input_ids": [1, 2, 3], "logprob_start_len": 99, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text


def test_seed_is_taken_mod_2_32_over_the_64_bit_range(http):
    """docs/api.md: a seed in [-2**63, 2**63 - 1] is honoured mod 2**32 (the sampler's uint32 key)."""
    def tokens(path: str, seed: int) -> list:
        body = {"prompt": "Once upon", "max_tokens": 6, "temperature": 1.0, "seed": seed, "logprobs": 0}
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    assert tokens(COMPLETIONS, -1) == tokens(COMPLETIONS, 2**32 - 1)
    assert tokens(COMPLETIONS, 2**63 - 1) == tokens(COMPLETIONS, 2**32 - 1)  # 2**63 - 1 = 2**32 - 1 (mod 2**32)
    assert tokens(COMPLETIONS, -(2**63)) == tokens(COMPLETIONS, 0)


# A lone surrogate in a field the server echoes or stores (rid, ids, names, metadata, user) was a 500,
# or a stream cut off mid-body (no error event, no [DONE]) whose rid stayed "already in use", or a
# stored response that every GET answered with a 500. (endpoint, body, param)
S = "\ud800"
ECHOED_FIELDS = [
    ("/generate", {"text": "hi", "rid": S}, "rid"),
    ("/generate", {"text": ["a", "b"], "rid": ["ok", "x" + S]}, "rid[1]"),
    (COMPLETIONS, {"prompt": "hi", "rid": S}, "rid"),
    (COMPLETIONS, {"prompt": "hi", "user": S}, "user"),
    (CHAT, {"messages": MSG, "rid": S}, "rid"),
    (CHAT, {"messages": MSG, "user": S}, "user"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": S}]}, "messages[0].name"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": S}}]}, "tools[0].function.name"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": S, "schema": {}}}},
     "response_format.json_schema.name"),
    ("/v1/responses", {"input": "hi", "request_id": S}, "request_id"),
    ("/v1/responses", {"input": "hi", "metadata": {"k": S}}, "metadata.k"),
    ("/v1/responses", {"input": "hi", "metadata": {S: "v"}}, "metadata." + S),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": S, "schema": {}}}},
     "text.format.name"),
    ("/v1/responses", {"input": "hi", "user": S}, "user"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": S}]}, "tools[0].name"),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi", "id": S}]}, "input[0].id"),
    ("/v1/responses", {"input": "hi", "background": True, "metadata": {"k": S}}, "metadata.k"),
]


# each case plain and streamed, but a background response, which is never streamed
ECHOED_CASES = [(*case, stream) for case in ECHOED_FIELDS for stream in (False, True)
                if not (stream and case[1].get("background"))]


@pytest.mark.parametrize("path,body,param,stream", ECHOED_CASES,
                         ids=[f"{i}-{c[2]!a}-{'stream' if c[3] else 'plain'}" for i, c in enumerate(ECHOED_CASES)])
def test_a_lone_surrogate_in_an_echoed_field_is_a_400_naming_it(http, path, body, param, stream):
    sampling = {"sampling_params": {"max_new_tokens": 2}} if path == "/generate" else \
        {"max_output_tokens": 2} if path == "/v1/responses" else {"max_tokens": 2}
    r = http.post(path, content=_ascii_json({**body, **sampling, "stream": stream}), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_value", err
    assert "lone surrogate U+D800" in err["message"], err


def test_a_request_refused_for_a_lone_surrogate_leaves_its_rid_free(http):
    for path, body in (("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop": [S]}}),
                       (CHAT, {"messages": MSG, "max_tokens": 2, "user": S}),
                       (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "user": S})):
        for stream in (True, False):
            body = {**body, "rid": "surrogate-rid", "stream": stream}
            r = http.post(path, content=_ascii_json(body), headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
    r = http.post("/v1/responses", content=_ascii_json({"input": "hi", "max_output_tokens": 2, "stream": True,
                                                        "request_id": "surrogate-rid", "metadata": {"k": S}}),
                  headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 2, "rid": "surrogate-rid"})
    assert r.status_code == 200 and r.json()["id"], r.text
    r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "request_id": "surrogate-rid"})
    assert r.status_code == 200, r.text
    assert http.get(f"/v1/responses/{r.json()['id']}").status_code == 200


def test_a_surrogate_pair_escape_is_text(http):
    """A \\ud83d\\ude00 pair (how json.dumps writes an emoji by default) is one character, not refused."""
    r = http.post("/generate", content=_ascii_json({"text": "hi", "rid": "pair-\U0001F600", "sampling_params": {"max_new_tokens": 1}}),
                  headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "pair-\U0001F600", r.text
