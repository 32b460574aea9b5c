"""The default model (SmolLM2-135M: 9 query heads, 3 kv heads) served by `scripts/serve.py --tp-size 3` on
three CPU host devices gives the greedy ids of tp 1, over the native and the OpenAI API; `--tp-size 2`
is refused at start-up with the numbers and no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import httpx
import pytest

from tests.server.conftest import REPO, SERVE, ServerProcess, free_port

FLAGS = ["--max-total-tokens", "2048", "--context-length", "512", "--max-running-requests", "4",
         "--chunked-prefill-size", "128", "--disable-precompile"]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Three prime numbers are"]
GREEDY = {"max_new_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("tp_servers")
    with mock.patch.dict(os.environ, {"JAX_NUM_CPU_DEVICES": "3"}):
        procs = {tp: ServerProcess(["--tp-size", str(tp), *FLAGS], log_dir / f"tp{tp}.log") for tp in (1, 3)}
    try:
        for p in procs.values():
            p.wait_healthy(600)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _native(url: str) -> list[list[int]]:
    resp = httpx.post(url + "/generate", json={"text": PROMPTS, "sampling_params": GREEDY}, timeout=300)
    assert resp.status_code == 200, resp.text
    return [out["output_ids"] for out in resp.json()]


def _openai(url: str) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    resp = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS, max_tokens=12, temperature=0)
    return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]


@pytest.mark.slow
def test_default_model_tp3_matches_tp1_over_http(servers):
    info = httpx.get(servers[3].url + "/get_server_info", timeout=30).json()
    assert info["tp_size"] == 3 and info["devices"] == ["cpu:0", "cpu:1", "cpu:2"]
    assert "tp_size 3 on cpu:0, cpu:1, cpu:2" in servers[3].log()  # the engine-ready line
    memory, memory_tp1 = info["memory"], httpx.get(servers[1].url + "/get_server_info", timeout=30).json()["memory"]
    assert memory["num_devices"] == 3 and memory["weights_bytes"] == memory_tp1["weights_bytes"]
    assert memory["kv_pool_bytes_per_device"] * 3 == memory["kv_pool_bytes"] == memory_tp1["kv_pool_bytes"]  # 3 kv heads
    # the matrices split 3 ways, the norms whole on each device
    assert memory["weights_bytes"] / 3 < memory["weights_bytes_per_device"] < memory["weights_bytes"] / 3 * 1.01
    assert "MiB per device) over 3 devices, process RSS" in servers[3].log()
    ref = _native(servers[1].url)
    assert all(len(ids) == 12 for ids in ref)
    assert _native(servers[3].url) == ref
    assert _openai(servers[3].url) == _openai(servers[1].url)


@pytest.mark.slow
def test_default_model_tp2_refused_without_traceback():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}
    proc = subprocess.run([sys.executable, str(SERVE), "--tp-size", "2", "--port", str(free_port()), *FLAGS], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "SmolLM2-135M-Instruct has 9 attention heads; --tp-size 2 does not divide them (use 1, 3 or 9)" in out
    assert "Traceback" not in out
