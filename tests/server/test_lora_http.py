"""Multi-LoRA over HTTP (a real server on the tiny checkpoint): lora_path on /generate, OpenAI's
"<served>:<adapter>" through the `openai` client, /v1/models, and /load_lora_adapter and
/unload_lora_adapter with SGLang's response shapes, against PEFT's greedy ids."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.model.lora_helpers import make_peft_adapter, peft_greedy, peft_model
from tests.server.conftest import TINY_SERVER_FLAGS, ServerProcess, wait_idle

NEW = 6
GREEDY = {"max_new_tokens": NEW, "temperature": 0}
PROMPT = [5, 17, 301, 42, 9, 77, 1003, 12]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("http_adapters")
    return {
        "a": make_peft_adapter(tiny_model_dir, str(root / "a"), seed=21, rank=8),
        "b": make_peft_adapter(tiny_model_dir, str(root / "b"), seed=22, rank=4, targets=("q_proj", "v_proj", "down_proj")),
        "big": make_peft_adapter(tiny_model_dir, str(root / "big"), seed=23, rank=16),
    }


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters):
    ref = peft_model(tiny_model_dir, {k: v for k, v in adapters.items() if k != "big"})
    return {name: peft_greedy(ref, name, PROMPT, NEW) for name in (None, "a", "b")}


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("lora_server") / "server.log"
    proc = ServerProcess(["--model-path", tiny_model_dir, *TINY_SERVER_FLAGS, "--served-model-name", "tiny",
                          "--lora-paths", f"a={adapters['a']}", "--max-lora-rank", "8",
                          "--max-loras-per-batch", "2"], log)
    proc.wait_healthy()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(lora_server):
    with httpx.Client(base_url=lora_server.url, timeout=120) as client:
        yield client


def generate(http, lora_path, prompt=PROMPT):
    return http.post("/generate", json={"input_ids": prompt, "sampling_params": GREEDY, "lora_path": lora_path})


def test_generate_under_an_adapter_matches_peft(http, expected):
    assert generate(http, "a").json()["output_ids"] == expected["a"]
    assert generate(http, None).json()["output_ids"] == expected[None]
    assert expected["a"] != expected[None]


def test_load_generate_unload_with_sglang_shapes(http, adapters, expected):
    r = http.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": adapters["b"], "pinned": False})
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "error_message": "", "loaded_adapters": {"a": adapters["a"], "b": adapters["b"]}}
    models = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "a", "b"]
    assert models[2]["root"] == adapters["b"] and models[2]["parent"] == "tiny"
    # a batch: one adapter per prompt
    out = http.post("/generate", json={"input_ids": [PROMPT] * 3, "sampling_params": GREEDY,
                                       "lora_path": ["b", None, "a"]}).json()
    assert [o["output_ids"] for o in out] == [expected["b"], expected[None], expected["a"]]
    r = http.post("/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 200 and r.json() == {"success": True, "error_message": "", "loaded_adapters": {"a": adapters["a"]}}
    r = generate(http, "b")
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = http.post("/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 400 and r.json()["success"] is False and "not loaded" in r.json()["error_message"]
    wait_idle(http)


@pytest.mark.parametrize("body, message", [
    ({"lora_name": "a", "lora_path": "/nowhere"}, "already loaded"),
    ({"lora_name": "x", "lora_path": "/nowhere"}, "not found"),
    ({"lora_name": "big", "lora_path": "BIG"}, "exceeds --max-lora-rank 8"),
])
def test_bad_loads_are_400s_and_the_server_serves_on(http, adapters, expected, body, message):
    body = {**body, "lora_path": adapters["big"] if body["lora_path"] == "BIG" else body["lora_path"]}
    r = http.post("/load_lora_adapter", json=body)
    assert r.status_code == 400
    assert r.json()["success"] is False and message in r.json()["error_message"]
    assert generate(http, "a").json()["output_ids"] == expected["a"]


def test_bad_bodies_name_their_field(http):
    r = http.post("/load_lora_adapter", json={"lora_path": "/x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x", "pinned": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "pinned"
    r = generate(http, "nope")
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = http.post("/v1/completions", json={"model": "tiny:nope", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_openai_client_model_colon_adapter(lora_server, expected):
    import openai

    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="none")
    got = client.completions.create(model="tiny:a", prompt=PROMPT, max_tokens=NEW, temperature=0)
    # the model's adapter wins over lora_path
    crossed = client.completions.create(model="tiny:a", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                        extra_body={"lora_path": "missing"})
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0)
    tok = httpx.post(lora_server.url + "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "lora_path": "a"})
    assert got.choices[0].text == crossed.choices[0].text == tok.json()["text"]
    assert base.choices[0].text != got.choices[0].text


def test_unload_while_requests_run_lets_them_finish(http, adapters, expected):
    """SGLang's behaviour: the unload answers after the adapter's running requests finish; they finish
    under the adapter."""
    http.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": adapters["b"]})
    long = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(http.post, "/generate", json={"input_ids": PROMPT, "sampling_params": long, "lora_path": "b"})
                   for _ in range(3)]
        for _ in range(200):  # until all three run (they take far longer than this loop's first turns)
            if http.get("/get_server_info").json()["num_running_reqs"] == len(running):
                break
        unload = http.post("/unload_lora_adapter", json={"lora_name": "b"})
        outs = [f.result() for f in running]
    assert unload.status_code == 200
    assert all(o.status_code == 200 and o.json()["output_ids"][:NEW] == expected["b"] for o in outs), [o.text[:300] for o in outs]
    wait_idle(http)


def test_frontend_gen_with_lora_path(lora_server, http):
    """The frontend language's `gen(lora_path=...)` (and `run(lora_path=...)`), plain and streamed,
    over HTTP: the same text as /generate under the adapter."""
    from jaxserve.lang import RuntimeEndpoint, function, gen

    question = "Name a color:"

    @function
    def ask(s, adapter):
        s += question + gen("answer", max_tokens=NEW, lora_path=adapter)

    @function
    def ask_default(s):
        s += question + gen("answer", max_tokens=NEW)

    def by_hand(adapter):
        body = {"text": question, "sampling_params": {**GREEDY}, "lora_path": adapter}
        return http.post("/generate", json=body).json()["text"]

    with RuntimeEndpoint(lora_server.url) as remote:
        under_a = ask.run("a", backend=remote, temperature=0)
        assert under_a["answer"] == by_hand("a") != by_hand(None)
        streamed = ask.run("a", backend=remote, temperature=0, stream=True)
        assert "".join(streamed.text_iter()) == question + by_hand("a")
        assert ask_default.run(backend=remote, temperature=0, lora_path="a")["answer"] == by_hand("a")


def test_chat_and_responses_routes_take_model_colon_adapter(lora_server):
    import openai

    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Name a color."}]

    def chat(model):
        return client.chat.completions.create(model=model, messages=messages, max_tokens=NEW, temperature=0).choices[0].message.content

    def respond(model):
        return client.responses.create(model=model, input="Name a color.", max_output_tokens=NEW, temperature=0).output_text

    assert chat("tiny:a") == respond("tiny:a")
    assert chat("tiny") == respond("tiny")
    assert chat("tiny:a") != chat("tiny")
