"""Programs on the real default model (SmolLM2-135M), in-process and over HTTP.

Each primitive builds the same text as the same prompts sent by hand through `engine.generate`;
select picks the choice with the highest mean token log-probability, computed here by separate
requests per choice; fork branches find their shared prefix in the radix cache; run_batch equals
single runs; RuntimeEndpoint against `scripts/serve.py` gives the in-process result. Greedy, few
tokens: the model decodes ~10 tokens/s per sequence on the 2-core CI CPU.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from jaxserve.lang import (
    BackendError,
    RuntimeEndpoint,
    assistant,
    function,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    user,
)
from jaxserve.lang.expr import REGEX_INT, REGEX_STR

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ENGINE_ARGS = dict(
    model_path="default", max_total_tokens=16384, max_running_requests=16, chunked_prefill_size=256,
    context_length=1024, disable_precompile=True,
)
GREEDY = {"temperature": 0}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def engine():
    from jaxserve.engine.engine import Engine

    return Engine(**ENGINE_ARGS)


@pytest.fixture(scope="module")
def backend(engine):
    from jaxserve.lang.engine_backend import EngineBackend

    with EngineBackend(engine) as b:
        yield b


def hand_generate(backend, prompt: str, params: dict) -> str:
    """`engine.generate` on the engine loop's thread (the loop owns the engine while the backend is open)."""
    return backend.loop.call(lambda engine: engine.generate(prompt, params)).result()["text"]


def input_logprobs(backend, input_ids: list[int]) -> list[float | None]:
    """Prompt log-probabilities of one sequence from position 0 (nothing reused from the cache)."""
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    backend.loop.submit(input_ids, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True, logprob_start_len=0,
                        on_output=outputs.put)
    while not (out := outputs.get(timeout=120)).finished:
        pass
    return [lp for lp, _ in out.meta.input_token_logprobs]


# ---- each primitive equals the hand-built prompts ----------------------------------------------
@function
def primitives(s):
    s += "Q: What is the capital of France?\nA:"
    s += gen("plain", max_tokens=6, stop="\n")
    s += "\nHow many legs does a spider have? "
    s += gen_int("legs", max_tokens=4)
    s += "\nA word in quotes: "
    s += gen_string("word", max_tokens=6)
    s += "\nLetters: " + gen("letters", max_tokens=4, regex="[a-e]{1,3}")
    s += "\nJSON: " + gen("json", max_tokens=10, json_schema=SCHEMA)


def test_gen_primitives_match_engine_generate(backend):
    state = primitives.run(backend=backend, temperature=0)
    steps = [
        ("Q: What is the capital of France?\nA:", {"max_new_tokens": 6, "stop": ["\n"]}),
        ("\nHow many legs does a spider have? ", {"max_new_tokens": 4, "regex": REGEX_INT, "stop": [" ", "\n"]}),
        ("\nA word in quotes: ", {"max_new_tokens": 6, "regex": REGEX_STR}),
        ("\nLetters: ", {"max_new_tokens": 4, "regex": "[a-e]{1,3}"}),
        ("\nJSON: ", {"max_new_tokens": 10, "json_schema": json.dumps(SCHEMA)}),
    ]
    text, outputs = "", []
    for prefix, params in steps:
        text += prefix
        out = hand_generate(backend, text, {**params, **GREEDY})
        outputs.append(out)
        text += out
    assert state.text() == text
    assert [state[n] for n in ("plain", "legs", "word", "letters", "json")] == outputs
    assert state["legs"].strip().lstrip("+-").isdigit()
    assert state["word"].startswith('"')


@function
def chat(s, question):
    s += system("You answer in one short sentence.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=8))


def test_roles_match_engine_generate_with_the_chat_template(backend, engine):
    state = chat.run("What is the capital of France?", backend=backend, temperature=0)
    messages = state.messages()
    prompt = engine.tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    answer = hand_generate(backend, prompt, {"max_new_tokens": 8, **GREEDY})
    assert state["answer"] == answer == messages[2]["content"]
    assert state.text() == engine.tokenizer.apply_chat_template(messages, tokenize=False)
    streamed = chat.run("What is the capital of France?", backend=backend, temperature=0, stream=True)
    assert "".join(streamed.text_iter()) == state.text()


# ---- select ------------------------------------------------------------------------------------
@function
def capital(s, choices):
    s += "The capital of France is "
    s += select("city", choices)
    s += "."


def test_select_picks_the_highest_mean_logprob(backend, engine):
    choices = ["Paris", "London", "a city called Lyon", "Berlin"]
    state = capital.run(choices, backend=backend)
    tok = engine.tokenizer
    prompt = "The capital of France is "
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    means = []
    for choice in choices:  # one request per choice, each computing its whole prompt
        ids = tok.encode(prompt + choice, add_special_tokens=False)
        shared = next(i for i, (a, b) in enumerate(zip(prompt_ids + [-1], ids)) if a != b)
        logprobs = input_logprobs(backend, ids)[shared:]
        means.append(sum(logprobs) / len(logprobs))
    scores = state.get_meta_info("city")
    assert scores.normalized_logprobs == pytest.approx(means, abs=2e-3)
    assert state["city"] == choices[max(range(len(choices)), key=means.__getitem__)]
    assert state.text() == prompt + state["city"] + "."
    # the boundary merge: "is " + "Paris" is scored as the single token " Paris"
    assert tok.decode(scores.token_ids[0]) == " Paris"


# ---- fork: the branches share the prefix in the radix cache -------------------------------------
LONG_PREFIX = " ".join(
    f"Fact {i}: the {w} of item {i} is {i * 7 % 13}." for i, w in enumerate(["colour", "weight", "size", "age"] * 5)
) + "\n"


@function
def fan_out(s, width):
    s += LONG_PREFIX
    forks = s.fork(width)
    for i, f in enumerate(forks):
        f += f"Question {i}: what is the size of item {i}? Answer:"
        f += gen("answer", max_tokens=3)
    for f in forks:
        s += f["answer"]


def test_fork_branches_share_the_prefix(backend, engine):
    prefix_len = len(engine.tokenizer.encode(LONG_PREFIX, add_special_tokens=False))
    assert 280 <= prefix_len <= 330
    state = fan_out.run(4, backend=backend, temperature=0)
    forks_meta = [b.get_meta_info("answer") for b in state._ctx.states[1:]]
    assert len(forks_meta) == 4
    page = engine.args.page_size
    for meta in forks_meta:
        assert meta["prompt_tokens"] > prefix_len
        assert meta["cached_tokens"] >= prefix_len - page, (meta["cached_tokens"], prefix_len)


# ---- run_batch ---------------------------------------------------------------------------------
@function
def short_qa(s, question):
    s += "Q: " + question + "\nA:"
    s += gen("answer", max_tokens=3)


def test_run_batch_equals_single_runs(backend):
    questions = [{"question": f"What is {i} plus {i + 1}?"} for i in range(16)]
    batch = short_qa.run_batch(questions, backend=backend, num_threads=16, temperature=0)
    single = [short_qa.run(backend=backend, temperature=0, **q) for q in questions]
    assert [s.text() for s in batch] == [s.text() for s in single]


# ---- errors ------------------------------------------------------------------------------------
def test_engine_errors_are_backend_errors(backend):
    @function
    def bad_regex(s):
        s += "x" + gen("y", regex="(unclosed", max_tokens=2)

    with pytest.raises(BackendError) as info:
        bad_regex.run(backend=backend)
    assert info.value.status_code == 400 and info.value.param == "regex"

    @function
    def too_long(s):
        s += "hello " * 1100 + gen("y", max_tokens=2)

    with pytest.raises(BackendError, match="context length"):
        too_long.run(backend=backend)


# ---- RuntimeEndpoint against the real server ---------------------------------------------------
@function
def everything(s, question):
    s += system("You answer in one short sentence.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=6))
    s += "Verdict: " + select("verdict", ["correct", "wrong"])
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"\nReason {i}:" + gen("reason", max_tokens=3)
    s += forks[0]["reason"] + forks[1]["reason"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flags = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items()]
    log_path = tmp_path_factory.mktemp("lang_server") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "serve.py"), *flags, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
            env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_runtime_endpoint_matches_in_process(server, backend):
    question = "Is Paris the capital of France?"
    local = everything.run(question, backend=backend, temperature=0)
    with RuntimeEndpoint(server) as remote:
        over_http = everything.run(question, backend=remote, temperature=0)
        assert over_http.text() == local.text()
        assert over_http["verdict"] == local["verdict"]
        assert over_http.get_meta_info("verdict").normalized_logprobs == pytest.approx(
            local.get_meta_info("verdict").normalized_logprobs, abs=2e-3)
        streamed = everything.run(question, backend=remote, temperature=0, stream=True)
        assert "".join(streamed.text_iter()) == local.text()

        @function
        def bad_regex(s):
            s += "x" + gen("y", regex="(unclosed", max_tokens=2)

        with pytest.raises(BackendError) as info:
            bad_regex.run(backend=remote)
        assert info.value.status_code == 400 and info.value.param == "regex" and "regex" in info.value.message
