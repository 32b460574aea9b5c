"""`python scripts/serve.py` with no model flags serves the default model (SmolLM2-135M-Instruct).

Slow: it loads the GGUF model and precompiles every shape bucket (minutes on a 2-core CPU the first
time; the persistent XLA cache makes later runs faster). Only --port is given, since 30000 may be taken.
"""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import ServerProcess

STARTUP_TIMEOUT_S = 1200


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
@pytest.mark.timeout(STARTUP_TIMEOUT_S + 300)
def test_serve_default_model(tmp_path):
    server = ServerProcess([], tmp_path / "serve.log")
    try:
        server.wait_healthy(STARTUP_TIMEOUT_S)
        rss_gb = _rss_bytes(server.proc.pid) / 1e9  # right after start-up, as the README states it
        assert rss_gb < 3.5, f"the default server's RSS is {rss_gb:.2f} GB"
        log = server.log()
        assert "KV pool:" in log and "CPU default: min(1.5 GiB, 10%" in log
        ready = [line for line in log.splitlines() if line.startswith("jaxserve ready:")]
        assert ready == [f"jaxserve ready: serving SmolLM2-135M-Instruct at {server.url} (OpenAI API at /v1)"], log[-2000:]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
        resp = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0,
        )
        assert resp.choices[0].finish_reason in ("stop", "length")
        assert resp.choices[0].message.content.strip()
        assert resp.usage.completion_tokens > 0
        print(f"default server RSS after start-up: {rss_gb:.2f} GB;", next(x for x in log.splitlines() if "KV pool:" in x))
    finally:
        server.stop()


# scripts/serve.py under a flag that ends in argparse, reporting whether jax was imported by then
_ARGPARSE_ONLY = """
import runpy, sys
sys.argv = ["serve.py", *sys.argv[1:]]
try:
    runpy.run_path("scripts/serve.py", run_name="__main__")
except SystemExit as e:
    print("exit", e.code, "jax imported:", "jax" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["--no-such-flag"], 2), (["--dist-timeout", "0"], 2),
                                        (["--tool-call-parser", "bogus"], 2)])
def test_help_and_flag_errors_answer_before_jax_is_imported(argv, code):
    """--help took ~1.3 s idle (~5 s on a busy machine), nearly all of it importing jax through the app."""
    import subprocess
    import sys

    from tests.server.conftest import REPO

    out = subprocess.run([sys.executable, "-c", _ARGPARSE_ONLY, *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert f"exit {code} jax imported: False" in out.stderr, out.stderr[-2000:]
    if code == 0:
        assert "--model-path" in out.stdout
        assert "--tool-call-parser {qwen25,qwen,hermes,llama3}" in out.stdout  # the choices of parsers.PARSERS
    if "bogus" in argv:  # was a traceback after ~12 s of loading the model
        assert "serve.py: error: argument --tool-call-parser: invalid choice: 'bogus'" in out.stderr
