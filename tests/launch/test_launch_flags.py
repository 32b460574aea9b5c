"""SGLang launch flags that copied command lines carry: --chat-template, --reasoning-parser and
--skip-tokenizer-init, and start-up argument errors reported before any port binds.

The routes run over a scripted fake engine (no model): it replies with fixed text pieces, one per
step, and records the prompts it was given, so the chat template's rendering and the reasoning
split are read straight off the HTTP answers. The start-up checks are real `scripts/serve.py` runs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys

import jinja2
import pytest
from starlette.testclient import TestClient

from jaxserve.core.request import finish_stop
from jaxserve.engine.engine_loop import EngineLoop
from jaxserve.engine.outputs import RequestMeta, StepOutput
from jaxserve.engine.validation.check import RequestChecker
from jaxserve.engine.validation.limits import ModelLimits
from jaxserve.server.app import create_app
from jaxserve.server.openai.chat_template import load_chat_template
from jaxserve.server.openai.reasoning import REASONING_PARSERS, ReasoningSplitter, reasoning_format, split_reasoning
from jaxserve.server_args import ServerArgs
from tests.server.conftest import REPO, SERVE
from tests.server.fakes import FakeEngine, FakeTokenizer

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "What is 6 x 7?"}]
# a template of our own, unlike SmolLM2's: the rendered prompt shows which one was used
TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")


class RecordingChecker(RequestChecker):
    """The request checks, recording each prompt they tokenize."""

    def __init__(self, *args):
        super().__init__(*args)
        self.prompts: list = []

    def tokenize(self, prompt, add_special_tokens=True):
        self.prompts.append(prompt)
        return super().tokenize(prompt, add_special_tokens)


class ScriptedEngine(FakeEngine):
    """Replies `pieces` (one text piece per step, token id 7 each) and records each prompt it tokenizes."""

    def __init__(self, pieces: list[str], tokenizer=None):
        super().__init__()
        # SmolLM2's template alone is longer than the fake's 64 (a token per character)
        self.limits = ModelLimits(vocab_size=64, context_length=4096, pool_tokens=8192)
        self.checker = RecordingChecker(FakeTokenizer(), self.limits)  # the chat template is `tokenizer`'s
        self.pieces = pieces
        self.tokenizer = tokenizer

    @property
    def prompts(self) -> list:
        return self.checker.prompts

    def add_request(self, checked):
        rids = super().add_request(checked)
        self.think_end_ids = tuple(checked.request.think_end_ids)
        for r in rids:
            self.reqs[r]["max"] = min(self.reqs[r]["max"], len(self.pieces))
        return rids

    def _output(self, rid, new, finished, reason=None):
        req = self.reqs[rid]
        num = len(req["out"])
        if finished and num == len(self.pieces):
            reason = finish_stop(2)  # the script ends as a model's reply ends: EOS
        meta = RequestMeta(rid, req["prompt"], num, 0, reason, 0.0)
        if finished:
            del self.reqs[rid]
        return StepOutput(rid, new, list(req["out"]), "".join(self.pieces[:num]),
                          self.pieces[num - 1] if new else "", finished, meta)


@pytest.fixture
def serve(default_tokenizer):
    """serve(pieces, **server_args) -> (TestClient, engine); everything is shut down after the test."""
    made = []

    def start(pieces: list[str], **args) -> tuple[TestClient, ScriptedEngine]:
        engine = ScriptedEngine(pieces, copy.copy(default_tokenizer))
        engine.args = dataclasses.replace(engine.args, **args)
        loop = EngineLoop(engine).start()
        client = TestClient(create_app(loop, engine.args))
        made.append((loop, client))
        return client.__enter__(), engine

    yield start
    for loop, client in made:
        client.__exit__(None, None, None)
        loop.shutdown()


def _reference_split(text: str, starts_inside: bool) -> tuple[str, str]:
    """(reasoning, content) by the format's definition, with str.partition."""
    if not starts_inside and not text.startswith("<think>"):
        return "", text
    body = text.removeprefix("<think>")
    reasoning, found, content = body.partition("</think>")
    return (reasoning, content) if found else (body, "")


REPLIES = ["<think>6 x 7 is 42.</think>The answer is 42.", "6 x 7 is 42.</think>42", "No thinking here.",
           "<think>cut off before the end", "<think></think>", "<thi", "</think>only the answer", "<think>a</think>b</think>c"]


@pytest.mark.parametrize("name", ["deepseek-r1", "qwen3"])
@pytest.mark.parametrize("text", REPLIES)
def test_split_matches_the_definition_whole_and_in_any_pieces(name, text):
    fmt = reasoning_format(name)
    want = _reference_split(text, fmt.starts_in_reasoning)
    got = split_reasoning(fmt, text)
    assert (got.reasoning, got.content) == want
    for cuts in [[i] for i in range(len(text) + 1)] + [list(range(1, len(text)))]:  # two pieces; one char each
        bounds = [0, *cuts, len(text)]
        splitter = ReasoningSplitter(fmt)
        parts = [splitter.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [splitter.finish()]
        assert ("".join(p.reasoning for p in parts), "".join(p.content for p in parts)) == want, cuts


def test_deepseek_r1_and_qwen3_differ_where_sglang_says():
    assert REASONING_PARSERS["deepseek-r1"].starts_in_reasoning and not REASONING_PARSERS["qwen3"].starts_in_reasoning
    assert split_reasoning(reasoning_format("deepseek-r1"), "think</think>say").reasoning == "think"
    assert split_reasoning(reasoning_format("qwen3"), "think</think>say").content == "think</think>say"
    with pytest.raises(ValueError, match="--reasoning-parser 'nope' is not one of: deepseek-r1, .*qwen3"):
        reasoning_format("nope")


def test_reasoning_content_in_the_message_and_the_stream(serve):
    pieces = ["<th", "ink>6 x 7", " is 42.</", "think>", "The answer", " is 42."]
    client, _ = serve(pieces, reasoning_parser="deepseek-r1")
    body = {"messages": MSG, "max_tokens": 16}
    message = client.post(CHAT, json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "6 x 7 is 42." and message["content"] == "The answer is 42."
    plain = client.post(CHAT, json={**body, "separate_reasoning": False}).json()["choices"][0]["message"]
    assert plain["content"] == "".join(pieces) and plain["reasoning_content"] is None
    with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "6 x 7 is 42."
    assert "".join(d.get("content", "") for d in deltas) == "The answer is 42."
    assert not any("<" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas), deltas
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_without_the_flag_reasoning_stays_in_content(serve):
    client, _ = serve(["<think>a</think>", "b"])
    message = client.post(CHAT, json={"messages": MSG, "max_tokens": 4}).json()["choices"][0]["message"]
    assert message["content"] == "<think>a</think>b" and message["reasoning_content"] is None


def test_reasoning_then_a_tool_call(serve):
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    client, _ = serve(["<think>use f", "</think>", call], reasoning_parser="qwen3")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]
    choice = client.post(CHAT, json={"messages": MSG, "max_tokens": 8, "tools": tools}).json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "use f" and choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["f"]


CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
F_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]


def _reference_tool_split(text: str, starts_inside: bool) -> tuple[str, str]:
    """SGLang's Qwen3Detector on a reply with no </think> after a <tool_call>: the reasoning ends at
    </think> (dropped) or at <tool_call> (kept in the content), whichever comes first."""
    if not starts_inside and not text.startswith("<think>"):
        return "", text
    body = text.removeprefix("<think>")
    ends = [(i, n) for i, n in ((body.find("</think>"), len("</think>")), (body.find("<tool_call>"), 0)) if i >= 0]
    if not ends:
        return body, ""
    i, n = min(ends)
    return body[:i], body[i + n:]


@pytest.mark.parametrize("name", ["qwen3", "qwen3-thinking"])
@pytest.mark.parametrize("text", ["<think>use f" + CALL, "use f" + CALL, "<think>a</think>b" + CALL, "<think>use f<tool_c",
                                  "<think><tool_call>", "no reasoning" + CALL])
def test_qwen3_ends_the_reasoning_at_a_tool_call(name, text):
    fmt = reasoning_format(name)
    want = _reference_tool_split(text, fmt.starts_in_reasoning)
    assert (split_reasoning(fmt, text).reasoning, split_reasoning(fmt, text).content) == want
    for cuts in [[i] for i in range(len(text) + 1)] + [list(range(1, len(text)))]:
        bounds = [0, *cuts, len(text)]
        splitter = ReasoningSplitter(fmt)
        parts = [splitter.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [splitter.finish()]
        assert ("".join(p.reasoning for p in parts), "".join(p.content for p in parts)) == want, cuts
    # DeepSeekR1Detector has no tool start: the call stays in the reasoning
    assert split_reasoning(reasoning_format("deepseek-r1"), "use f" + CALL).reasoning == "use f" + CALL


@pytest.mark.parametrize("text", REPLIES + ["<think>use f" + CALL])
def test_stream_reasoning_false_hands_the_reasoning_out_in_one_piece(text):
    fmt = reasoning_format("qwen3")
    want = split_reasoning(fmt, text)
    splitter = ReasoningSplitter(fmt, stream_reasoning=False)
    parts = [splitter.feed(ch) for ch in text] + [splitter.finish()]
    pieces = [p.reasoning for p in parts if p.reasoning]
    assert pieces == ([want.reasoning] if want.reasoning else []), parts
    assert "".join(p.content for p in parts) == want.content


@pytest.mark.parametrize("constraint", [{"tool_choice": "required"}, {"tool_choice": {"type": "function", "function": {"name": "f"}}},
                                        {"response_format": {"type": "json_object"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_waits_for_the_reasoning_then_the_answer_is_split(serve, default_tokenizer, constraint, stream):
    """SGLang's ReasonerGrammarBackend: under --reasoning-parser a request that reasons gets its grammar
    after </think> (the engine is told the ids), so its reply splits into reasoning and the constrained answer."""
    reply = CALL if "tool_choice" in constraint else '{"x": 1}'
    client, engine = serve(["weigh it", "</think>", reply], reasoning_parser="deepseek-r1")
    body = {"messages": MSG, "max_tokens": 8, "tools": F_TOOL, **constraint, "stream": stream}
    if not stream:
        message = client.post(CHAT, json=body).json()["choices"][0]["message"]
        assert message["reasoning_content"] == "weigh it", message
        if "tool_choice" in constraint:
            assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"], message
        else:
            assert message["content"] == reply, message
    else:
        with client.stream("POST", CHAT, json=body) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "weigh it", deltas
        if "tool_choice" in constraint:
            assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls") or [] if c.get("function", {}).get("name")] == ["f"]
        else:
            assert "".join(d.get("content") or "" for d in deltas) == reply
    assert engine.think_end_ids == tuple(default_tokenizer.encode("</think>", add_special_tokens=False)) != ()


@pytest.mark.parametrize("constraint", [{"tool_choice": "required"}, {"response_format": {"type": "json_object"}}])
def test_a_grammar_of_a_request_that_does_not_reason_applies_from_the_start(serve, constraint):
    """qwen3 with enable_thinking false (SGLang: require_reasoning false): the grammar from the first
    token, and the reply is all answer."""
    reply = CALL if "tool_choice" in constraint else '{"x": 1}'
    client, engine = serve([reply], reasoning_parser="qwen3")
    body = {"messages": MSG, "max_tokens": 8, "tools": F_TOOL, **constraint, "chat_template_kwargs": {"enable_thinking": False}}
    message = client.post(CHAT, json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] is None, message
    if "tool_choice" in constraint:
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"], message
    else:
        assert message["content"] == reply, message
    assert engine.think_end_ids == ()
    plain = client.post(CHAT, json={"messages": MSG, "max_tokens": 8}).json()["choices"][0]["message"]
    assert engine.think_end_ids == () and plain["content"] == reply  # no grammar: nothing to defer


def test_stream_reasoning_false_over_http_and_the_implicit_close(serve):
    pieces = ["<think>use", " f", CALL]  # Qwen3.5's habit: a call opened without </think>
    client, _ = serve(pieces, reasoning_parser="qwen3")
    body = {"messages": MSG, "max_tokens": 8, "tools": F_TOOL}
    choice = client.post(CHAT, json=body).json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "use f" and choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["f"]
    for stream_reasoning, want in ((True, ["use", " f"]), (False, ["use f"])):
        with client.stream("POST", CHAT, json={**body, "stream": True, "stream_reasoning": stream_reasoning}) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines() if line.startswith("data: {")]
        assert [d["reasoning_content"] for d in deltas if d.get("reasoning_content")] == want, deltas
        assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls") or [] if c.get("function", {}).get("name")] == ["f"]


def test_chat_template_file_renders_through_transformers(serve, tmp_path, default_tokenizer):
    path = tmp_path / "mine.jinja"
    path.write_text(TEMPLATE)
    client, engine = serve(["ok"], chat_template=str(path))
    assert client.post(CHAT, json={"messages": MSG, "max_tokens": 1}).status_code == 200
    # the file's literal \n is a line break, as SGLang reads it; rendered here by jinja2 itself
    want = jinja2.Template(TEMPLATE.replace("\\n", "\n")).render(messages=MSG, add_generation_prompt=True)
    assert engine.prompts[-1] == want == "[USER] What is 6 x 7?\n[ASSISTANT]"
    default_client, default_engine = serve(["ok"])
    default_client.post(CHAT, json={"messages": MSG, "max_tokens": 1})
    assert default_engine.prompts[-1] == default_tokenizer.apply_chat_template(MSG, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("arg, fragment", [
    ("chatml", "no such file; SGLang's built-in template names are not served"),
    ("conv.json", ".json conversation templates are not served"),
    ("bad.jinja", "not a valid Jinja template"),
    ("empty.jinja", "the file is empty"),
    # it parsed, and then every chat request failed rendering it
    ("norender.jinja", "cannot render a conversation of one user message with the generation prompt: UndefinedError"),
])
def test_chat_template_refusals_say_what_is_accepted(tmp_path, arg, fragment):
    (tmp_path / "conv.json").write_text("{}")
    (tmp_path / "norender.jinja").write_text("{{ undefined_var.attr }}{% for m in messages %}{{ m.content }}{% endfor %}")
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    (tmp_path / "empty.jinja").write_text("\n")
    path = arg if arg == "chatml" else str(tmp_path / arg)
    with pytest.raises(ValueError) as info:
        load_chat_template(path)
    assert f"--chat-template {path}: " in str(info.value) and fragment in str(info.value)
    if arg not in ("bad.jinja", "norender.jinja"):  # a file of the right kind: its own error is the message
        assert "a path to an existing Jinja chat template file" in str(info.value)


def test_chat_template_that_fails_only_for_a_system_message_loads(tmp_path):
    path = tmp_path / "no_system.jinja"
    text = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
            "{{ bos_token + m.content }}{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
    path.write_text(text)
    assert load_chat_template(str(path)) == text


def test_skip_tokenizer_init_takes_ids_and_returns_no_text(serve):
    client, _ = serve(["a", "b"], skip_tokenizer_init=True)
    err = client.post("/generate", json={"text": "hi"}).json()["error"]
    assert err["param"] == "text" and "--skip-tokenizer-init" in err["message"]
    out = client.post("/generate", json={"input_ids": [1, 2, 3], "return_logprob": True,
                                         "return_text_in_logprobs": True}).json()
    assert out["output_ids"] == [7, 7] and "text" not in out and out["meta_info"]["completion_tokens"] == 2
    with client.stream("POST", "/generate", json={"input_ids": [1, 2], "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [e["output_ids"] for e in events] == [[7], [7, 7]] and not any("text" in e for e in events)
    assert client.post(CHAT, json={"messages": MSG}).json()["error"]["param"] == "messages"
    assert client.post("/v1/completions", json={"prompt": "hi"}).json()["error"]["param"] == "prompt"
    assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200
    with_text, _ = serve(["a"])
    assert with_text.post("/generate", json={"input_ids": [1]}).json()["text"] == "a"


def test_unknown_reasoning_parser_or_template_fails_create_app(tmp_path):
    loop = EngineLoop(FakeEngine()).start()
    try:
        with pytest.raises(ValueError, match="--reasoning-parser"):
            create_app(loop, ServerArgs(model_path="/models/fake-model", reasoning_parser="r2d2"))
        with pytest.raises(ValueError, match="--chat-template"):
            create_app(loop, ServerArgs(model_path="/models/fake-model", chat_template=str(tmp_path / "none.jinja")))
    finally:
        loop.shutdown()


def test_log_requests_leaves_out_health_generate(serve, caplog):
    client, _ = serve(["a"], log_requests=True)
    with caplog.at_level(logging.INFO):
        assert client.get("/health_generate").status_code == 200
        assert client.post("/generate", json={"text": "hi", "rid": "mine"}).status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("request finished")]
    assert len(lines) == 1 and lines[0].startswith("request finished rid=mine "), lines


def test_start_up_argument_errors_come_before_the_port_binds(tmp_path):
    """Each bad flag exits 2 with one `serve.py: error:` line, although its port is taken: before, the
    --device and --kv-cache-dtype checks ran after binding (and the bind failed first here)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    (tmp_path / "norender.jinja").write_text("{{ undefined_var.attr }}")
    env.pop("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", None)  # the --context-length case needs the refusal
    cases = [
        (["--device", "tpu"], "--device tpu: this process runs on the JAX platform 'cpu'"),
        (["--kv-cache-dtype", "fp4_e2m1"], "--kv-cache-dtype 'fp4_e2m1' is not a KV cache dtype"),
        (["--chat-template", "chatml"], "--chat-template chatml: no such file"),
        (["--chat-template", str(tmp_path / "norender.jinja")], "cannot render a conversation of one user message"),
        (["--tp-size", "64"], "--tp-size 64 needs 64 devices"),
        (["--reasoning-parser", "r2d2"], "argument --reasoning-parser: invalid choice: 'r2d2'"),
        (["--served-model-name", ""], "--served-model-name must not be empty"),
        (["--context-length", "100000"], "--context-length 100000 is greater than the model's context length 8192"),
    ]
    try:
        procs = [subprocess.Popen([sys.executable, str(SERVE), *argv, "--port", port], cwd=str(REPO), env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv, _ in cases]
        for p, (argv, message) in zip(procs, cases):
            out, err = p.communicate(timeout=120)
            assert p.returncode == 2, (argv, out[-1000:], err[-2000:])
            assert message in err.strip().splitlines()[-1], (argv, err[-2000:])
            assert "cannot listen" not in out + err and "loading" not in out + err, (argv, out, err)
    finally:
        taken.close()


def test_generate_require_reasoning_defers_the_grammar_under_a_reasoning_parser(serve, default_tokenizer):
    """SGLang's /generate field: with --reasoning-parser the engine gets </think>'s ids; without the
    field, or without the flag, the grammar applies from the first token."""
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "regex": "[0-9]+"}}
    client, engine = serve(["1", "2"], reasoning_parser="qwen3")
    assert client.post("/generate", json={**body, "require_reasoning": True}).status_code == 200
    assert engine.think_end_ids == tuple(default_tokenizer.encode("</think>", add_special_tokens=False)) != ()
    client.post("/generate", json=body)
    assert engine.think_end_ids == ()
    client, engine = serve(["1", "2"])
    assert client.post("/generate", json={**body, "require_reasoning": True}).status_code == 200
    assert engine.think_end_ids == ()
    assert client.post("/generate", json={**body, "require_reasoning": "yes"}).status_code == 400
