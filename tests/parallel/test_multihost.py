"""Multi-host serving on loopback, tiny random checkpoint: `--nnodes 2` processes on
jax.distributed give rank 0's HTTP server the greedy outputs of a single tp-1 process, at tp 2 over
two processes of one CPU device and at tp 4 over two of two, with the host tier (soft release,
recall) and copy-on-write in play; a follower killed mid-run (of three ranks) makes rank 0 fail the
request with a 500 naming the rank, once, and exit 1, and the other follower exit 1 with one line; so
does one killed while idle, found by its heartbeat (not after --dist-timeout); a follower with another
--page-size, or one that never joins, is refused at start with the numbers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from jaxserve.parallel.distributed import DEFAULT_DIST_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, STOP_NOTICE_S
from tests.conftest import TINY_LLAMA, make_hf_checkpoint
from tests.parallel.multihost_cluster import LoopbackCluster
from tests.parallel.tp_worker import prompts
from tests.server.conftest import REPO, SERVE, ServerProcess, free_port

FLAGS = ["--max-total-tokens", "1024", "--context-length", "128", "--max-running-requests", "8",
         "--chunked-prefill-size", "32", "--page-size", "8", "--disable-precompile"]
# the release policy at its most active (tests/parallel/tp_worker.py): every idle prefix is soft-released
# to the host tier and recalled on a match; a match ending inside a page is copied on write
AGGRESSIVE = ["--enable-hierarchical-cache", "--radix-cache-soft-free-threshold", "0", "--radix-cache-evict-threshold", "0",
              "--release-conservative-batch-size", "0", "--release-aggressive-batch-size", "0", "--enable-auto-merge",
              "--merge-max-suffix-tokens", "15", "--merge-min-shared-ratio", "0"]
GREEDY = {"max_new_tokens": 6, "temperature": 0}
STARTUP_S = 300


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """A single-process tp-1 reference and the two clusters, started together (they load in parallel)."""
    log_dir = tmp_path_factory.mktemp("multihost")
    flags = ["--model-path", tiny_model_dir, *FLAGS, *AGGRESSIVE]
    started = []
    try:
        started.append(ref := ServerProcess(flags, log_dir / "tp1.log"))
        started.append(tp2 := LoopbackCluster(2, 1, [*flags, "--tp-size", "2"], log_dir, "tp2"))
        started.append(tp4 := LoopbackCluster(2, 2, [*flags, "--tp-size", "4"], log_dir, "tp4"))
        for s in started:
            s.wait_healthy(STARTUP_S)
        yield {"ref": ref, 2: tp2, 4: tp4}
    finally:
        for s in started:
            s.stop()


def _generate(url: str, input_ids: list[list[int]]) -> list[list[int]]:
    resp = httpx.post(url + "/generate", json={"input_ids": input_ids, "sampling_params": GREEDY}, timeout=300)
    assert resp.status_code == 200, resp.text
    return [out["output_ids"] for out in resp.json()]


def _workload(url: str) -> dict:
    """Two mixed-length batches (the second shares a prefix with cached, soft-released requests),
    an OpenAI completion and a streamed chat completion."""
    ps = prompts(49152)
    out = {"first": _generate(url, ps[:8]), "second": _generate(url, ps[8:])}
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    out["completion"] = resp.json()["choices"][0]["text"]
    chat = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat, timeout=300) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    out["stream"] = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, events[:-1]) if c["choices"])
    return out


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert values, f"{name} not in /metrics"
    return sum(float(v) for v in values)


def _assert_host_tier_used(url: str) -> None:
    """Batch 1's prefixes were soft-released when the engine went idle after it (thresholds 0) and
    batch 2 recalled the shared 44-token prefix from the host tier. Deterministic: the loop's idle step
    runs the release before it reads batch 2 from its inbox, and publishes fresh stats before any later
    request gets an output (jaxserve/engine/engine_loop.py, "Going idle")."""
    assert _metric(url, "jaxserve_radix_cache_soft_freed_bytes") > 0
    assert _metric(url, "jaxserve_radix_cache_recalled_bytes") > 0


@pytest.fixture(scope="module")
def reference(servers) -> dict:
    out = _workload(servers["ref"].url)
    assert all(len(ids) == 6 for ids in out["first"] + out["second"])
    assert out["completion"] and out["stream"]
    _assert_host_tier_used(servers["ref"].url)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_two_processes_match_one_process_tp1(servers, reference, tp):
    cluster = servers[tp]
    info = httpx.get(cluster.url + "/get_server_info", timeout=30).json()
    assert info["tp_size"] == tp and len(info["devices"]) == tp
    assert _workload(cluster.url) == reference
    _assert_host_tier_used(cluster.url)  # pages soft-released: contents gathered from the follower
    assert all(r.proc.poll() is None for r in cluster.ranks)


@pytest.fixture(scope="module")
def tiny3_model_dir(tmp_path_factory, default_tokenizer) -> str:
    """The tiny checkpoint with 6 query and 3 kv heads: tp 3 over three processes."""
    config = dict(TINY_LLAMA, num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny3"), "LlamaForCausalLM", config, tokenizer=default_tokenizer)


@pytest.mark.slow
def test_follower_killed_mid_run_ends_rank0_naming_it(tiny3_model_dir, tmp_path):
    """Three ranks, rank 2 killed while a stream decodes: the stream ends with the error naming rank 2
    (once), rank 0 logs it once without a traceback and exits 1, and rank 1, whose collective failed
    too, exits 1 with one line (it printed a gloo traceback, and rank 0 named "rank 1, 2")."""
    cluster = LoopbackCluster(3, 1, ["--model-path", tiny3_model_dir, *FLAGS, "--tp-size", "3"], tmp_path, "kill",
                              dist_timeout=15)
    try:
        cluster.wait_healthy(STARTUP_S)
        body = {"input_ids": [5, 6, 7], "stream": True,
                "sampling_params": {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True}}
        with httpx.stream("POST", cluster.url + "/generate", json=body, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            cluster.ranks[2].proc.kill()  # one token streamed: the request is decoding
            rest = "\n".join(lines)
        assert '"output_ids"' in first
        lost = "rank 2 of --nnodes 3 stopped"
        (error,) = [json.loads(line[len("data: "):])["error"] for line in rest.splitlines() if line.startswith('data: {"error"')]
        assert error["message"].startswith(f"engine error: RankLostError: {lost}") and error["message"].count("rank ") == 1, error
        assert error["type"] == "server_error"
        assert cluster.wait_exit(0, 15 + 15) == 1  # within --dist-timeout (and the death path's 3 s)
        assert cluster.wait_exit(1, 15) == 1
        log0, log1 = cluster.ranks[0].log(), cluster.ranks[1].log()
        assert log0.count(lost) == 1 and "Traceback" not in log0, log0[-3000:]
        assert "jaxserve ready" in log0
        assert "Traceback" not in log1, log1[-3000:]
        (exit_line,) = [line for line in log1.splitlines() if line.startswith("jaxserve: rank 1 of --nnodes 3:")]
        assert "a step failed" in exit_line and exit_line.endswith("exiting with status 1"), exit_line
    finally:
        cluster.stop()


def _generate_in_background(url: str) -> tuple[threading.Thread, list]:
    answers: list = []

    def run() -> None:
        body = {"input_ids": [5, 6, 7], "sampling_params": GREEDY}
        resp = httpx.post(url + "/generate", json=body, timeout=STARTUP_S)
        answers.append((resp.status_code, resp.json()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, answers


def _first_health_not_200(url: str, timeout: float) -> int | str | None:
    """The first /health status other than 200 (or the connection error's name) within `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = httpx.get(url + "/health", timeout=2).status_code
        except httpx.HTTPError as e:
            return type(e).__name__
        if status != 200:
            return status
        time.sleep(0.2)
    return None


@pytest.mark.slow
def test_follower_killed_while_idle_is_found_by_its_heartbeat(tiny3_model_dir, tmp_path):
    """--dist-timeout 300 (the default): rank 2 of 3 killed -9 while idle. Requests sent then wait for
    it (their first step's collective), until rank 0's watchdog finds its heartbeat silent for
    HEARTBEAT_TIMEOUT_S: /health turns 503, both requests end with a 500 naming rank 2, rank 0 exits
    1, and rank 1, blocked in that collective, exits 1 with one line: no process is left."""
    cluster = LoopbackCluster(3, 1, ["--model-path", tiny3_model_dir, *FLAGS, "--tp-size", "3"], tmp_path,
                              "idle_kill", dist_timeout=DEFAULT_DIST_TIMEOUT_S)
    try:
        cluster.wait_healthy(STARTUP_S)
        cluster.ranks[2].proc.kill()
        cluster.ranks[2].proc.wait()
        requests = [_generate_in_background(cluster.url) for _ in range(2)]
        assert _first_health_not_200(cluster.url, HEARTBEAT_TIMEOUT_S + 10) == 503
        lost = "rank 2 of --nnodes 3 stopped"
        for thread, answers in requests:
            thread.join(30)
            ((status, body),) = answers
            assert status == 500 and body["error"]["message"].startswith(f"engine error: RankLostError: {lost}"), body
        # the engine-death path's 3 s, then rank 0 leaves its reason for the followers and waits for them
        assert cluster.wait_exit(0, 3 + STOP_NOTICE_S + 10) == 1
        assert cluster.wait_exit(1, 10) == 1
        log0, log1 = cluster.ranks[0].log(), cluster.ranks[1].log()
        assert f"RankLostError: {lost}: the model cannot run without it (no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s)" in log0
        assert log0.count(lost) == 1 and "Traceback" not in log0, log0[-3000:]  # logged once
        (exit_line,) = [line for line in log1.splitlines() if line.startswith("jaxserve: rank 1 of --nnodes 3:")]
        assert f"rank 0 stopped ({lost}" in exit_line and exit_line.endswith("exiting with status 1"), exit_line
    finally:
        cluster.stop()


@pytest.mark.slow
def test_follower_with_another_page_size_is_refused(tiny_model_dir, tmp_path):
    cluster = LoopbackCluster(2, 1, ["--model-path", tiny_model_dir, *FLAGS, "--tp-size", "2"], tmp_path, "mismatch",
                              rank_flags={1: ["--page-size", "16"]})
    try:
        assert [cluster.wait_exit(rank, 120) for rank in (0, 1)] == [1, 1]
        expected = "rank 1 was started with another configuration than rank 0: --page-size: rank 0 has 8, rank 1 has 16"
        for rank in cluster.ranks:
            assert expected in rank.log()
            assert "Traceback" not in rank.log()
    finally:
        cluster.stop()


@pytest.mark.slow
def test_follower_compiling_past_dist_timeout_is_waited_for(tiny_model_dir, tmp_path, monkeypatch):
    """--dist-timeout 20: rank 0 finished first and gave up 20 s later, naming rank 1 missing, while rank 1
    was alive and compiling. Here rank 1 takes 3 s longer than --dist-timeout 3, heartbeating."""
    from jaxserve.launch.multihost import FOLLOWER_START_DELAY_ENV

    monkeypatch.setenv(FOLLOWER_START_DELAY_ENV, "6")  # read by the followers only
    cluster = LoopbackCluster(2, 1, ["--model-path", tiny_model_dir, *FLAGS, "--tp-size", "2"], tmp_path, "slow_rank",
                              dist_timeout=3)
    try:
        cluster.wait_healthy(STARTUP_S)
        assert len(_generate(cluster.url, [[5, 6, 7]])[0]) == 6
    finally:
        cluster.stop()


@pytest.mark.slow
def test_rank_that_never_joins_is_named(tiny_model_dir):
    args = ["--model-path", tiny_model_dir, *FLAGS, "--tp-size", "2", "--nnodes", "2", "--node-rank", "0",
            "--dist-init-addr", f"127.0.0.1:{free_port()}", "--dist-timeout", "3", "--port", str(free_port())]
    proc = subprocess.run([sys.executable, str(SERVE), *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"})
    assert proc.returncode == 1
    assert "rank 0 of --nnodes 2: rank 1 did not join at" in proc.stdout + proc.stderr
    assert "within --dist-timeout 3 s" in proc.stdout + proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "--node-rank must be in 0..1 (--nnodes 2), got 2"),
    (["--nnodes", "2"], "--nnodes 2 needs --dist-init-addr HOST:PORT (rank 0's coordinator), none given"),
    (["--nnodes", "2", "--nccl-init-addr", "nohost"], "needs --dist-init-addr HOST:PORT (rank 0's coordinator), got 'nohost'"),
    (["--nnodes", "2", "--dist-init-addr", "h:1", "--dp-size", "2"], "--dp-size 2 with --nnodes 2 is not supported"),
    (["--nnodes", "2", "--dist-init-addr", "h:1", "--tp-size", "3"], "--tp-size 3 must be a multiple of --nnodes 2"),
    (["--dist-timeout", "0"], "--dist-timeout must be >= 1 second, got 0"),
])
def test_bad_multihost_flags_are_refused(argv, message, capsys):
    from jaxserve.server_args import ServerArgs

    with pytest.raises(SystemExit):
        ServerArgs.from_cli(argv)
    assert message in capsys.readouterr().err


def test_flags_keep_sglang_names_and_alias():
    from jaxserve.server_args import ServerArgs

    args = ServerArgs.from_cli(["--nnodes", "3", "--node-rank", "1", "--nccl-init-addr", "10.0.0.1:5000", "--dist-timeout", "60",
                                "--tp-size", "3"])
    assert (args.nnodes, args.node_rank, args.dist_init_addr, args.dist_timeout) == (3, 1, "10.0.0.1:5000", 60)
    assert ServerArgs().dist_timeout is None  # SGLang 0.5.23's default; resolved to 300 s at start


@pytest.mark.slow
def test_tp_size_other_than_all_devices_is_refused(tiny_model_dir, tmp_path):
    cluster = LoopbackCluster(2, 1, ["--model-path", tiny_model_dir, *FLAGS, "--tp-size", "4"], tmp_path, "tp_devices")
    try:
        assert [cluster.wait_exit(rank, 120) for rank in (0, 1)] == [1, 1]
        for rank in cluster.ranks:
            assert "--tp-size 4 must equal the devices of all --nnodes 2 processes together: 2 (1 per process)" in rank.log()
    finally:
        cluster.stop()
