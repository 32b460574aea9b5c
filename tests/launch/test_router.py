"""Data parallelism behind the real sglang-router 0.3.2: `serve.py --dp-size 2` (tiny checkpoint, small
pools) starts two workers and the router; single requests go through the router as through one server,
and what the router parses away or answers itself (docs/scaling.md's table) is checked too.

One launcher serves the module (round_robin, so the counters show both workers used); the
cache_aware test puts a second real router, with that policy, in front of the same two workers. The
last test stops the launcher with SIGTERM and checks that nothing it started is left running.
"""

from __future__ import annotations

import json
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import sglang_router  # noqa: F401  (the router extra, and a dev dependency: a missing install fails here, not skips)

from tests.server.conftest import TINY_SERVER_FLAGS, ServerProcess, free_port, real_router

pytestmark = pytest.mark.slow

GREEDY = {"max_new_tokens": 4, "temperature": 0.0}
READY_TIMEOUT_S = 240


def _wait_for_line(proc: ServerProcess, needle: str, timeout: float = READY_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = next((x for x in proc.log().splitlines() if x.startswith(needle)), None)
        if line is not None:
            return line
        if proc.proc.poll() is not None:
            raise RuntimeError(f"the launcher exited with {proc.proc.returncode}:\n{proc.log()[-4000:]}")
        time.sleep(0.5)
    proc.stop()
    raise TimeoutError(f"no {needle!r} line in {timeout} s:\n{proc.log()[-4000:]}")


def _launch(args: list[str], log_dir) -> ServerProcess:
    """`serve.py ARGS --port P` for a free P whose next three ports can be bound too (the workers' and
    the router's metrics), once it printed its ready line. Another process on this shared machine may
    take one of those ports between the check and the bind: then again on other ports."""
    attempts = 3
    for attempt in range(attempts):
        port = free_port()
        while not all(_bindable(p) for p in range(port + 1, port + 4)):
            port = free_port()
        proc = ServerProcess(args, log_dir / f"launcher{attempt}.log", port=port)
        try:
            proc.ready_line = _wait_for_line(proc, "jaxserve ready")
        except RuntimeError:
            log = proc.log()  # a port taken between the check and the bind: the launcher's, or the router's metrics
            if attempt < attempts - 1 and ("cannot listen on" in log or "Address already in use" in log):
                proc.stop()
                continue
            raise
        proc.worker_urls = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
        return proc
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def dp(tiny_model_dir, tmp_path_factory):
    """`serve.py --dp-size 2 --router-policy round_robin` on a free port (the workers take the next two)."""
    proc = _launch(["--model-path", tiny_model_dir, *TINY_SERVER_FLAGS, "--served-model-name", "tiny", "--dp-size", "2",
                    "--router-policy", "round_robin"], tmp_path_factory.mktemp("dp"))
    yield proc
    proc.stop()


def _bindable(port: int) -> bool:
    """Whether the launcher could bind `port` now. A connect test is not enough: a port that is the
    local end of another process's connection (the ephemeral range free_port draws from) accepts no
    connection yet cannot be bound (seen in a clean-clone CI run: "cannot listen on", twice)."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _generate(url: str, text: str, params=GREEDY) -> dict:
    r = httpx.post(url + "/generate", json={"text": text, "sampling_params": params}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _finished(url: str) -> int:
    return httpx.get(url + "/get_server_info", timeout=10).json()["engine_stats"]["num_finished_requests"]


def test_the_ready_line_gives_the_routers_url(dp):
    assert dp.ready_line.startswith(f"jaxserve ready: serving tiny at {dp.url} (OpenAI API at /v1;")
    assert "round_robin over 2 workers" in dp.ready_line


def test_native_chat_stream_and_flush_through_the_router(dp):
    direct = _generate(dp.worker_urls[0], "The router forwards")
    routed = _generate(dp.url, "The router forwards")
    assert routed["output_ids"] == direct["output_ids"] and routed["meta_info"]["completion_tokens"] == 4

    chat = httpx.post(dp.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 3 and chat.json()["choices"][0]["message"]["role"] == "assistant"

    body = {"text": "The router forwards", "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", dp.url + "/generate", json=body, timeout=120) as s:
        assert s.status_code == 200
        data = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and len(data) >= 3  # several events passed through, not one buffered body
    assert json.loads(data[-2])["output_ids"] == direct["output_ids"]

    for url in dp.worker_urls:  # both prefix caches hold something, then the router flushes both
        _generate(url, "Fill the cache with a prompt that is longer than one page of sixteen tokens, surely")
    r = httpx.post(dp.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    for url in dp.worker_urls:
        assert httpx.get(url + "/get_server_info", timeout=10).json()["kv_pool"]["cached_tokens"] == 0


def test_what_the_router_does_not_pass_through(dp):
    """docs/scaling.md's table: the router parses /generate into its own types before a worker sees it."""
    batch = httpx.post(dp.url + "/generate", json={"text": ["a", "b"], "sampling_params": GREEDY}, timeout=60)
    assert batch.status_code == 422 and "invalid type: sequence, expected a string" in batch.text
    assert httpx.post(dp.worker_urls[0] + "/generate", json={"text": ["a", "b"], "sampling_params": GREEDY},
                      timeout=120).status_code == 200
    dropped = httpx.post(dp.url + "/generate", timeout=120,
                         json={"text": "a", "sampling_params": GREEDY, "bogus": 1, "max_new_tokens": 9})
    assert dropped.status_code == 200 and dropped.json()["meta_info"]["completion_tokens"] == 4
    assert httpx.post(dp.worker_urls[0] + "/generate", timeout=60,
                      json={"text": "a", "sampling_params": GREEDY, "bogus": 1}).status_code == 400
    wrong_type = httpx.post(dp.url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": "x"}},
                            timeout=60)
    assert wrong_type.status_code == 422
    assert httpx.post(dp.url + "/generate", content=json.dumps({"text": "a"}), timeout=60).status_code == 415
    assert httpx.get(dp.url + "/metrics", timeout=10).status_code == 404
    assert httpx.get(dp.url + "/get_load", timeout=10).status_code == 404
    assert httpx.get(dp.url + "/flush_cache", timeout=10).status_code == 405
    assert "engine_stats" not in httpx.get(dp.url + "/get_server_info", timeout=10).json()


def test_round_robin_sends_requests_to_both_workers(dp):
    before = [_finished(u) for u in dp.worker_urls]
    for i in range(6):
        _generate(dp.url, f"Request number {i}", {"max_new_tokens": 1, "temperature": 0.0})
    delta = [_finished(u) - b for u, b in zip(dp.worker_urls, before)]
    assert sum(delta) == 6 and min(delta) >= 2, delta


def test_the_workers_answer_the_routers_probes(dp):
    url = dp.worker_urls[1]
    info = httpx.get(url + "/server_info", timeout=10).json()
    assert info.keys() == httpx.get(url + "/get_server_info", timeout=10).json().keys()
    assert info["dp_size"] == 1 and info["tp_size"] == 1 and info["port"] == int(url.rsplit(":", 1)[1])
    model = httpx.get(url + "/model_info", timeout=10).json()
    assert model["architectures"] == ["LlamaForCausalLM"] and model["model_type"] == "llama"
    load = httpx.get(url + "/get_load", timeout=10).json()
    assert [sorted(x) for x in load] == [sorted(["dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens",
                                                 "num_pending_tokens", "ts_tic"])]
    assert load[0]["num_reqs"] == 0 and load[0]["num_pending_tokens"] == 0


def _shared_prefix_workload(num_groups: int = 3, per_group: int = 6, seed: int = 18) -> list[list[str]]:
    """bench_serving's generated-shared-prefix shape: groups of prompts that share a long system
    prefix (about 100 tokens) and differ in a short question. An odd number of groups, so round_robin
    sends each group to both workers."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone cloud paper light green orange window music number".split()
    prefixes = [" ".join(rng.choice(words) for _ in range(90)) for _ in range(num_groups)]
    return [[f"{p}\nQuestion {g}.{i}: {rng.choice(words)} {rng.choice(words)}?" for i in range(per_group)]
            for g, p in enumerate(prefixes)]


def _hit_rate(url: str, groups: list[list[str]]) -> float:
    """cached / prompt tokens over the workload. The first prompt of every group is sent while the
    earlier groups' first prompts still run, as in a real burst: the cache_aware router places a prefix
    it has not seen on the least loaded worker (requests in flight; a tie goes to the first worker).
    They decode 140 tokens, 0.14 s on an idle machine (router log, CI): 0.02 s between sends keeps them
    overlapping (0.2 s did not, and every group went to worker 0). The other prompts follow one at a
    time, interleaved across groups."""
    greedy = {"max_new_tokens": 1, "temperature": 0.0}
    long = {"max_new_tokens": 140, "temperature": 0.0, "ignore_eos": True}
    with ThreadPoolExecutor(len(groups)) as pool:
        firsts = []
        for group in groups:
            firsts.append(pool.submit(_generate, url, group[0], long))
            time.sleep(0.02)
        metas = [f.result()["meta_info"] for f in firsts]
    for i in range(1, len(groups[0])):
        metas += [_generate(url, group[i], greedy)["meta_info"] for group in groups]
    return sum(m["cached_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)


def _flush(urls: list[str]) -> None:
    for url in urls:
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def cache_aware_router(dp, tmp_path_factory):
    """A second real sglang-router, policy cache_aware, in front of the launcher's two workers; yields
    its URL and its log (debug level: its routing decisions, printed with the test's output)."""
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    with real_router(dp.worker_urls, "cache_aware", log_path, log_level="debug") as url:
        yield url, log_path


def _router_state(url: str, log_path) -> str:
    """What a failed routing assertion prints: the router's worker list (health, load) and its log's tail."""
    try:
        workers = httpx.get(url + "/workers", timeout=10).text
    except httpx.HTTPError as e:
        workers = f"unreadable: {e!r}"
    return f"router /workers: {workers}\nrouter log tail:\n{log_path.read_text()[-6000:]}"


def test_cache_aware_keeps_one_workers_hit_rate(dp, cache_aware_router):
    groups = _shared_prefix_workload()
    _flush(dp.worker_urls)
    one_worker = _hit_rate(dp.worker_urls[0], groups)
    _flush(dp.worker_urls)
    before = [_finished(u) for u in dp.worker_urls]
    router_url, router_log = cache_aware_router
    routed = _hit_rate(router_url, groups)
    used = [_finished(u) - b for u, b in zip(dp.worker_urls, before)]
    _flush(dp.worker_urls)
    round_robin = _hit_rate(dp.url, groups)
    # printed, not put in the assertion messages: pytest shows a failed test's captured stdout whole, while
    # -q (CI) cuts a long assertion message to its first lines
    print(_router_state(router_url, router_log))
    assert one_worker > 0.5, one_worker  # the workload shares prefixes at all
    assert abs(routed - one_worker) <= 0.05, (routed, one_worker)
    # cache_aware still spread the groups over both workers
    assert min(used) > 0, used
    # the workload tells policies apart: round_robin computes every prefix on both workers
    assert round_robin < one_worker - 0.05, (round_robin, one_worker)


def test_api_key_and_a_dead_worker(tiny_model_dir, tmp_path):
    """With --api-key the router and the workers require the key; when a worker dies the launcher
    stops the router and the other worker and exits with status 1."""
    import psutil

    proc = _launch(["--model-path", tiny_model_dir, *TINY_SERVER_FLAGS, "--served-model-name", "tiny",
                    "--dp-size", "2", "--api-key", "sekret"], tmp_path)
    port = proc.port
    try:
        body = {"text": "Keyed", "sampling_params": GREEDY}
        assert httpx.post(proc.url + "/generate", json=body, timeout=60).status_code == 401
        assert httpx.post(f"http://127.0.0.1:{port + 1}/generate", json=body, timeout=60).status_code == 401
        keyed = httpx.post(proc.url + "/generate", json=body, headers={"Authorization": "Bearer sekret"}, timeout=60)
        assert keyed.status_code == 200 and keyed.json()["meta_info"]["completion_tokens"] == 4

        children = psutil.Process(proc.proc.pid).children(recursive=True)
        worker0 = next(c for c in children if f"--port {port + 1}" in " ".join(c.cmdline()))
        worker0.kill()
        assert proc.proc.wait(90) == 1
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.pid for p in alive]
        assert "worker 0 exited with status -9: stopping the others" in proc.log()
    finally:
        proc.stop()


def test_sigterm_stops_the_router_and_every_worker(dp):
    """Last in the module (slow tests keep their order): it ends the shared launcher."""
    import psutil

    children = psutil.Process(dp.proc.pid).children(recursive=True)
    assert len(children) >= 3  # two workers and the router
    dp.proc.send_signal(signal.SIGTERM)
    assert dp.proc.wait(90) == 0
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [p.pid for p in alive]
    assert "jaxserve stopped: the router and 2 workers" in dp.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(dp.url + "/health", timeout=2)


def test_a_prefix_computed_on_one_worker_is_a_storage_hit_on_the_other(tiny_model_dir, tmp_path, monkeypatch):
    """--dp-size 2 with one storage directory (--hicache-storage-backend file): worker A computes a long
    prompt, worker B (which never saw it) reads its prefix from storage, with the same greedy output."""
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "hicache"))
    proc = _launch(["--model-path", tiny_model_dir, *TINY_SERVER_FLAGS, "--dp-size", "2", "--page-size", "16",
                    "--hicache-storage-backend", "file",
                    "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 16}'], tmp_path)
    try:
        tokens = [random.Random(7).randrange(3, 40000) for _ in range(150)]
        body = {"input_ids": tokens, "sampling_params": GREEDY}
        a = httpx.post(proc.worker_urls[0] + "/generate", json=body, timeout=120).json()
        assert a["meta_info"]["cached_tokens"] == 0
        deadline = time.monotonic() + 60  # worker A writes its pages off the request's path
        while time.monotonic() < deadline:
            if len(list((tmp_path / "hicache").glob("*.kv"))) >= 149 // 16:
                break
            time.sleep(0.2)
        b = httpx.post(proc.worker_urls[1] + "/generate", json=body, timeout=120).json()
        assert b["meta_info"]["cached_tokens"] >= 149 // 16 * 16
        assert b["output_ids"] == a["output_ids"]
    finally:
        proc.stop()
