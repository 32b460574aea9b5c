"""Tests for benchmarks/serving/bench_serving.py: datasets, metrics, SSE parsing and an end-to-end run against a
fake streaming server (no model)."""

import asyncio
import functools
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from benchmarks.serving import bench_serving as bench


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """A tiny word-level tokenizer saved to disk: decoding then encoding gives back the same ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(200)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path, bench.load_tokenizer(str(path))


def _encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("use_tokenizer", [False, True])
def test_random_lengths_within_range(word_tokenizer, use_tokenizer):
    tokenizer = word_tokenizer[1] if use_tokenizer else None
    sampler = bench.PromptSampler(tokenizer, np.random.default_rng(0))
    rows = bench.sample_random_requests(sampler, 200, input_len=40, output_len=10, range_ratio=0.5)
    assert len(rows) == 200
    prompt_lens = [r.prompt_len for r in rows]
    output_lens = [r.output_len for r in rows]
    assert min(prompt_lens) >= 20 and max(prompt_lens) <= 40
    assert min(output_lens) >= 5 and max(output_lens) <= 10
    assert len(set(prompt_lens)) > 5 and len(set(output_lens)) > 2
    for r in rows:
        if use_tokenizer:
            assert r.prompt_ids == _encode(tokenizer, r.prompt)
            assert len(r.prompt_ids) == r.prompt_len
            assert 0 not in r.prompt_ids  # no special tokens
        else:
            assert r.prompt_ids is None
            assert len(r.prompt.split()) == r.prompt_len


def test_random_range_ratio_one_gives_fixed_lengths():
    sampler = bench.PromptSampler(None, np.random.default_rng(0))
    rows = bench.sample_random_requests(sampler, 20, input_len=7, output_len=3, range_ratio=1.0)
    assert {(r.prompt_len, r.output_len) for r in rows} == {(7, 3)}


def test_random_is_seeded():
    def make(seed):
        return bench.sample_random_requests(bench.PromptSampler(None, np.random.default_rng(seed)), 5, 10, 5, 0.0)

    assert make(3) == make(3)
    assert make(3) != make(4)


@pytest.mark.parametrize("use_tokenizer", [False, True])
def test_gsp_prompts_share_their_group_system_prompt(word_tokenizer, use_tokenizer):
    tokenizer = word_tokenizer[1] if use_tokenizer else None
    sampler = bench.PromptSampler(tokenizer, np.random.default_rng(0))
    rows = bench.sample_generated_shared_prefix_requests(
        sampler, num_groups=4, prompts_per_group=5, system_prompt_len=30, question_len=6, output_len=8
    )
    assert len(rows) == 20
    assert [r.group for r in rows] != sorted(r.group for r in rows)  # shuffled
    systems = {}
    for r in rows:
        system, question = r.prompt.split("\n\n")
        assert systems.setdefault(r.group, system) == system
        assert r.output_len == 8
        if use_tokenizer:
            assert r.prompt_ids == _encode(tokenizer, system) + _encode(tokenizer, question)
            assert r.prompt_len == len(r.prompt_ids) == 36
        else:
            assert (len(system.split()), len(question.split()), r.prompt_len) == (30, 6, 36)
    assert sorted(systems) == [0, 1, 2, 3]
    assert len(set(systems.values())) == 4
    assert len({r.prompt for r in rows}) == 20


def _conversation(prompt, completion):
    return {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": completion}]}


def test_sharegpt_from_local_file(tmp_path):
    words = lambda n: " ".join(["x"] * n)  # noqa: E731
    data = [
        _conversation(words(5), words(7)),
        _conversation(words(3), words(4)),
        _conversation(words(1), words(9)),  # prompt too short
        _conversation(words(6), words(1)),  # completion too short
        _conversation(words(1100), words(9)),  # prompt over 1024
        _conversation(words(1000), words(1100)),  # total over 2048
        {"conversations": [{"from": "human", "value": words(8)}]},  # no answer
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    count = lambda text: len(text.split())  # noqa: E731

    rows = bench.sample_sharegpt_requests(path, 10, count, np.random.default_rng(0))
    assert sorted((r.prompt_len, r.output_len) for r in rows) == [(3, 4), (5, 7)]
    assert all(r.prompt == words(r.prompt_len) for r in rows)

    rows = bench.sample_sharegpt_requests(path, 10, count, np.random.default_rng(0), fixed_output_len=50)
    assert sorted((r.prompt_len, r.output_len) for r in rows) == [(3, 50), (5, 50), (6, 50), (1000, 50)]

    assert len(bench.sample_sharegpt_requests(path, 1, count, np.random.default_rng(0))) == 1
    with pytest.raises(FileNotFoundError):
        bench.sample_sharegpt_requests(tmp_path / "missing.json", 1, count, np.random.default_rng(0))


def test_token_timings_from_known_timestamps():
    arrivals = [(10.25, 1), (10.75, 1), (11.0, 2), (12.5, 3)]
    ttft, itl = bench.token_timings(10.0, arrivals, spreads_itl=True)
    assert ttft == pytest.approx(0.25)
    assert itl == pytest.approx([0.5, 0.125, 0.125, 0.5, 0.5, 0.5])
    ttft, itl = bench.token_timings(10.0, arrivals, spreads_itl=False)
    assert itl == pytest.approx([0.5, 0.25, 1.5])
    assert bench.token_timings(10.0, [], True) == (None, [])


def test_compute_metrics_matches_numpy():
    ok = bench.RequestOutput
    outputs = [
        ok(True, "", prompt_len=10, output_len=4, cached_tokens=5, ttft=0.1, latency=1.0, itl=[0.2, 0.3, 0.4]),
        ok(True, "", prompt_len=20, output_len=1, cached_tokens=0, ttft=0.2, latency=0.5, itl=[]),
        ok(False, "HTTP 400: bad", prompt_len=99, output_len=0),
        ok(True, "", prompt_len=30, output_len=3, cached_tokens=15, ttft=0.3, latency=2.0, itl=[0.5, 1.2]),
    ]
    m = bench.compute_metrics(outputs, duration_s=2.5)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens, m.total_cached_tokens) == (60, 8, 20)
    assert m.cache_hit_rate == pytest.approx(20 / 60)
    assert m.request_throughput == pytest.approx(3 / 2.5)
    assert m.input_throughput == pytest.approx(24.0)
    assert m.output_throughput == pytest.approx(3.2)
    assert m.total_throughput == pytest.approx(27.2)
    assert m.concurrency == pytest.approx(3.5 / 2.5)

    e2e = np.array([1.0, 0.5, 2.0]) * 1000
    ttft = np.array([0.1, 0.2, 0.3]) * 1000
    tpot = np.array([0.9 / 3, 1.7 / 2]) * 1000  # the 1-token request has no TPOT
    itl = np.array([0.2, 0.3, 0.4, 0.5, 1.2]) * 1000
    assert m.mean_e2e_latency_ms == pytest.approx(3500 / 3)
    assert m.median_e2e_latency_ms == pytest.approx(1000)
    assert m.std_e2e_latency_ms == pytest.approx(np.std(e2e))
    assert m.p90_e2e_latency_ms == pytest.approx(np.percentile(e2e, 90))
    assert m.p99_e2e_latency_ms == pytest.approx(np.percentile(e2e, 99))
    assert (m.mean_ttft_ms, m.median_ttft_ms) == pytest.approx((200, 200))
    assert m.p99_ttft_ms == pytest.approx(np.percentile(ttft, 99))
    assert (m.mean_tpot_ms, m.median_tpot_ms) == pytest.approx((575, 575))
    assert m.p99_tpot_ms == pytest.approx(np.percentile(tpot, 99))
    assert (m.mean_itl_ms, m.median_itl_ms, m.max_itl_ms) == pytest.approx((520, 400, 1200))
    assert m.p95_itl_ms == pytest.approx(np.percentile(itl, 95))
    assert m.p99_itl_ms == pytest.approx(np.percentile(itl, 99))

    block = bench.format_result(m, "jaxserve", float("inf"), 8, 2.5)
    assert "Successful requests:                     3" in block
    assert "Mean TPOT (ms):                          575.00" in block
    assert "Cache hit rate:                          33.33%" in block


def test_compute_metrics_with_no_success():
    m = bench.compute_metrics([bench.RequestOutput(False, "boom")], duration_s=1.0)
    assert (m.completed, m.failed, m.total_output_tokens, m.mean_ttft_ms, m.concurrency) == (0, 1, 0, 0, 0)


def test_parse_sse_line():
    assert bench.parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert bench.parse_sse_line('data:{"a": 2}') == {"a": 2}
    assert bench.parse_sse_line("data: [DONE]") == bench.SSE_DONE
    for line in ("", ": keep-alive", "event: message", "id: 3", "data:"):
        assert bench.parse_sse_line(line) is None


def test_native_parser_cumulative_text_and_meta_info():
    parser = bench.NativeStreamParser()
    meta = lambda n, finish=None: {  # noqa: E731
        "prompt_tokens": 12, "completion_tokens": n, "cached_tokens": 4, "finish_reason": finish
    }
    c1 = parser.feed({"text": "Hel", "meta_info": meta(1)})
    c2 = parser.feed({"text": "Hello wor", "meta_info": meta(3)})
    c3 = parser.feed({"text": "Hello world", "meta_info": meta(4, {"type": "length", "length": 4})})
    assert [c.text for c in (c1, c2, c3)] == ["Hel", "lo wor", "ld"]
    assert [c.num_new_tokens for c in (c1, c2, c3)] == [1, 2, 1]
    assert (c3.completion_tokens, c3.prompt_tokens, c3.cached_tokens, c3.finish_reason) == (4, 12, 4, "length")
    assert parser.feed({"error": {"message": "bad"}}).error == "bad"


def test_native_parser_counts_from_output_ids_or_events():
    cumulative = bench.NativeStreamParser()
    assert [cumulative.feed({"text": "ab"[: i + 1], "output_ids": [7, 8][: i + 1]}).num_new_tokens
            for i in range(2)] == [1, 1]
    incremental = bench.NativeStreamParser()
    chunks = [incremental.feed({"text": t, "output_ids": ids}) for t, ids in [("a", [5, 6]), ("abc", [5])]]
    assert [c.num_new_tokens for c in chunks] == [2, 1]
    assert chunks[-1].completion_tokens == 3
    bare = bench.NativeStreamParser()
    chunks = [bare.feed({"text": t}) for t in ("a", "ab", "ab")]
    assert [c.num_new_tokens for c in chunks] == [1, 1, 0]
    assert chunks[-1].completion_tokens is None


def test_openai_completion_parser():
    parser = bench.OpenAIStreamParser(is_chat=False)
    c1 = parser.feed({"choices": [{"index": 0, "text": " Hi", "finish_reason": None}], "usage": None})
    c2 = parser.feed({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
             "prompt_tokens_details": {"cached_tokens": 3}}
    c3 = parser.feed({"choices": [], "usage": usage})
    assert (c1.text, c1.num_new_tokens, c2.num_new_tokens, c2.finish_reason) == (" Hi", 1, 0, "length")
    assert (c3.num_new_tokens, c3.prompt_tokens, c3.completion_tokens, c3.cached_tokens) == (0, 9, 2, 3)
    assert parser.feed({"object": "error", "message": "too long", "code": 400}).error == "too long"


def test_openai_chat_parser():
    parser = bench.OpenAIStreamParser(is_chat=True)
    c0 = parser.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    c1 = parser.feed({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})
    c2 = parser.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": 5, "completion_tokens": 1}})
    assert (c0.num_new_tokens, c1.text, c1.num_new_tokens) == (0, "Hi", 1)
    assert (c2.finish_reason, c2.prompt_tokens, c2.completion_tokens, c2.cached_tokens) == ("stop", 5, 1, None)


def test_poisson_intervals():
    rng = np.random.default_rng(0)
    assert not bench.poisson_intervals(5, float("inf"), rng).any()
    waits = bench.poisson_intervals(20000, 4.0, rng)
    assert waits.mean() == pytest.approx(0.25, rel=0.05)


@dataclass
class FakeState:
    """What the fake server served: one (prompt_tokens, completion_tokens, cached_tokens) per
    successful request, in arrival order."""

    fail_every: int = 0  # every n-th request gets HTTP 400
    served: list = field(default_factory=list)
    payloads: list = field(default_factory=list)
    num_requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0


def _fake_prompt_tokens(body):
    """The fake server's own count: one more than the words or ids (a BOS), plus a template for chat."""
    if "messages" in body:
        return sum(len(m["content"].split()) for m in body["messages"]) + 6
    prompt = body.get("input_ids") or body.get("text") or body.get("prompt")
    return 1 + (len(prompt) if isinstance(prompt, list) else len(prompt.split()))


def make_fake_app(state: FakeState) -> Starlette:
    def sse(obj):
        return f"data: {json.dumps(obj)}\n\n"

    async def handle(request: Request, kind: str):
        body = await request.json()
        state.payloads.append(body)
        state.num_requests += 1
        if state.fail_every and state.num_requests % state.fail_every == 0:
            return JSONResponse({"error": {"message": f"rejected #{state.num_requests}"}}, status_code=400)
        prompt_tokens = _fake_prompt_tokens(body)
        num_out = body["sampling_params"]["max_new_tokens"] if kind == "native" else body["max_tokens"]
        cached = prompt_tokens // 3
        state.served.append((prompt_tokens, num_out, cached))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": num_out,
                 "total_tokens": prompt_tokens + num_out, "prompt_tokens_details": {"cached_tokens": cached}}

        async def native():
            text = ""
            for start in range(0, num_out, 3):  # three tokens per event
                n = min(3, num_out - start)
                text += "".join(f" t{start + i}" for i in range(n))
                finish = {"type": "length", "length": num_out} if start + n == num_out else None
                meta = {"prompt_tokens": prompt_tokens, "completion_tokens": start + n,
                        "cached_tokens": cached, "finish_reason": finish}
                yield sse({"text": text, "meta_info": meta})
                await asyncio.sleep(0.002)

        async def openai():
            for i in range(num_out):
                choice = {"index": 0, "finish_reason": "length" if i == num_out - 1 else None}
                choice.update({"delta": {"content": f" t{i}"}} if kind == "chat" else {"text": f" t{i}"})
                yield sse({"id": "x", "choices": [choice], "usage": None})
                await asyncio.sleep(0.002)
            yield sse({"id": "x", "choices": [], "usage": usage})

        async def stream():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                async for event in native() if kind == "native" else openai():
                    yield event
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def model_info(request):
        return JSONResponse({"model_path": "/nonexistent/fake", "tokenizer_path": "/nonexistent/fake"})

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    return Starlette(routes=[
        Route("/generate", functools.partial(handle, kind="native"), methods=["POST"]),
        Route("/v1/completions", functools.partial(handle, kind="completions"), methods=["POST"]),
        Route("/v1/chat/completions", functools.partial(handle, kind="chat"), methods=["POST"]),
        Route("/get_model_info", model_info),
        Route("/v1/models", models),
    ])


@pytest.fixture(scope="module")
def fake_server():
    state = FakeState()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_fake_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def fake(fake_server):
    url, state = fake_server
    state.__init__()
    return url, state


def _run(url, tmp_path, *extra):
    out_file = tmp_path / "results.jsonl"
    record = bench.main(["--base-url", url, "--disable-tqdm", "--output-file", str(out_file), *extra])
    lines = out_file.read_text().splitlines()
    assert json.loads(lines[-1]) == json.loads(json.dumps(record))
    return record, len(lines)


def _assert_totals_match(record, served):
    assert record["completed"] == len(served)
    assert record["total_input_tokens"] == sum(p for p, _, _ in served)
    assert record["total_output_tokens"] == sum(n for _, n, _ in served)
    assert record["total_cached_tokens"] == sum(c for _, _, c in served)


def test_end_to_end_native_backend(fake, tmp_path, word_tokenizer):
    url, state = fake
    record, _ = _run(
        url, tmp_path, "--backend", "jaxserve", "--tokenizer", str(word_tokenizer[0]),
        "--num-prompts", "24", "--random-input-len", "20", "--random-output-len", "10",
        "--random-range-ratio", "0.5", "--max-concurrency", "4", "--warmup-requests", "1",
    )
    assert state.num_requests == 25
    _assert_totals_match(record, state.served[1:])  # the warm-up is not measured
    assert state.max_in_flight <= 4
    assert record["failed"] == 0 and record["max_concurrency"] == 4 and record["request_rate"] == "inf"
    assert all("text" in p and p["sampling_params"]["ignore_eos"] for p in state.payloads)
    for out_len, itl, ttft, e2e, finish in zip(
        record["output_lens"], record["itls"], record["ttfts"], record["e2e_latencies"], record["finish_reasons"]
    ):
        assert len(itl) == out_len - min(out_len, 3)  # one gap per token after the first event's three
        assert 0 < ttft <= e2e and finish == "length"
    assert record["mean_ttft_ms"] > 0 and record["mean_itl_ms"] > 0
    assert record["args"]["num_prompts"] == 24 and "api_key" not in record["args"]


def test_end_to_end_native_input_ids(fake, tmp_path, word_tokenizer):
    url, state = fake
    record, _ = _run(
        url, tmp_path, "--backend", "sglang", "--tokenizer", str(word_tokenizer[0]), "--tokenize-prompt",
        "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
        "--gsp-system-prompt-len", "12", "--gsp-question-len", "4", "--gsp-output-len", "5",
        "--warmup-requests", "0", "--request-rate", "200", "--seed", "7",
    )
    _assert_totals_match(record, state.served)
    assert record["total_input_tokens"] == 6 * (16 + 1)
    assert all(len(p["input_ids"]) == 16 and "text" not in p for p in state.payloads)


def test_end_to_end_completions_with_failures(fake, tmp_path):
    url, state = fake
    state.fail_every = 5
    record, num_lines = _run(
        url, tmp_path, "--backend", "vllm", "--num-prompts", "20", "--random-input-len", "16",
        "--random-output-len", "6", "--warmup-requests", "0", "--max-concurrency", "8",
    )
    assert state.num_requests == 20 and len(state.served) == 16
    _assert_totals_match(record, state.served)
    assert record["failed"] == 4
    errors = [e for e in record["errors"] if e]
    assert len(errors) == 4 and all("HTTP 400" in e and "rejected" in e for e in errors)
    assert all(p["model"] == "fake-model" and p["stream_options"] == {"include_usage": True} for p in state.payloads)
    for out_len, itl, error in zip(record["output_lens"], record["itls"], record["errors"]):
        assert len(itl) == (0 if error else out_len - 1)  # one gap per streamed event after the first

    _run(url, tmp_path, "--backend", "vllm", "--num-prompts", "2", "--random-input-len", "4",
         "--random-output-len", "2", "--warmup-requests", "0")
    assert sum(1 for _ in (tmp_path / "results.jsonl").open()) == num_lines + 1  # appended


def test_end_to_end_chat_and_sharegpt(fake, tmp_path):
    url, state = fake
    data = [_conversation(f"question number {i} " * 3, "an answer of some words") for i in range(6)]
    (tmp_path / "sg.json").write_text(json.dumps(data))
    record, _ = _run(
        url, tmp_path, "--backend", "openai-chat", "--model", "m", "--dataset-name", "sharegpt",
        "--dataset-path", str(tmp_path / "sg.json"), "--num-prompts", "4", "--warmup-requests", "0",
    )
    _assert_totals_match(record, state.served)
    assert record["completed"] == 4 and record["model"] == "m"
    assert all(p["messages"][0]["role"] == "user" for p in state.payloads)
    assert all(text.startswith(" t0 t1") for text in record["generated_texts"])


def test_server_down_counts_failures(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    record, _ = _run(
        f"http://127.0.0.1:{port}", tmp_path, "--backend", "jaxserve", "--num-prompts", "3",
        "--random-input-len", "4", "--random-output-len", "2", "--warmup-requests", "0",
    )
    assert (record["completed"], record["failed"]) == (0, 3)
    assert all("ConnectError" in e for e in record["errors"])
