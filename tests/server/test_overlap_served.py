"""The overlap schedule served (`--no-disable-overlap-schedule`; CPU's default is off), through the real
clients: the openai client (plain, streamed, concurrent) and SGLang's frontend language give the same
greedy text as the shared tiny server, which runs without the overlap. Its engine_stats show that
decode steps were overlapped (a server that never overlapped would pass the comparisons vacuously).
"""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
import sglang as sgl

from tests.server.conftest import TINY_SERVER_FLAGS, ServerProcess


@pytest.fixture(scope="module")
def overlap_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("overlap") / "server.log"
    proc = ServerProcess(["--model-path", tiny_model_dir, *TINY_SERVER_FLAGS, "--no-disable-overlap-schedule"], log)
    proc.wait_healthy()
    yield proc
    proc.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _completions(url: str, prompts: list[str], stream: bool) -> list[str]:
    client = _client(url)
    model = client.models.list().data[0].id

    def one(prompt: str) -> str:
        kwargs = dict(model=model, prompt=prompt, max_tokens=12, temperature=0)
        if not stream:
            return client.completions.create(**kwargs).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


@sgl.function
def _two_answers(s, topic):
    s += "Facts about " + topic + ":\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"{i + 1}." + sgl.gen("fact", max_tokens=8, temperature=0)
    s += "".join(f["fact"] for f in forks)


def _overlapped_steps(url: str) -> int:
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    assert info["disable_overlap_schedule"] is False
    return info["engine_stats"]["num_overlapped_steps"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_client_text_equals_the_server_without_overlap(overlap_server, base_url, stream):
    prompts = ["The sky is", "Once upon a time", "def add(a, b):", "Paris is the capital of"]
    before = _overlapped_steps(overlap_server.url)
    assert _completions(overlap_server.url, prompts, stream) == _completions(base_url, prompts, stream)
    assert _overlapped_steps(overlap_server.url) > before


def test_sglang_frontend_fork_equals_the_server_without_overlap(overlap_server, base_url):
    before = _overlapped_steps(overlap_server.url)
    got = _two_answers.run(topic="rivers", backend=sgl.RuntimeEndpoint(overlap_server.url)).text()
    assert got == _two_answers.run(topic="rivers", backend=sgl.RuntimeEndpoint(base_url)).text()
    assert _overlapped_steps(overlap_server.url) > before
