"""A real jaxserve server in a subprocess (scripts/serve.py on a free loopback port) for the HTTP tests.

One tiny-checkpoint server serves the whole session: it compiles lazily (--disable-precompile), so
each test pays only for the shape buckets it uses, and the persistent XLA cache makes reruns fast.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
SERVE = REPO / "scripts" / "serve.py"
STARTUP_TIMEOUT_S = 180
TINY_SERVER_FLAGS = [
    "--max-total-tokens", "4096", "--context-length", "256", "--max-running-requests", "16",
    "--chunked-prefill-size", "64", "--disable-precompile",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python scripts/serve.py ARGS --port P` with its output in `log_path`; `url` once started."""

    def __init__(self, args: list[str], log_path: Path, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVE), *args, "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"the server did not become healthy in {timeout} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory) -> ServerProcess:
    """The tiny-checkpoint server, shared by every test of tests/server."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(["--model-path", tiny_model_dir, *TINY_SERVER_FLAGS], log)
    proc.wait_healthy()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.url


@pytest.fixture(scope="session")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> dict:
    """Poll /get_server_info until no request runs or waits and every used KV page belongs to the
    prefix cache (the pool's idle level); returns the last info. Raises AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        info = http.get("/get_server_info").json()
        kv = info["kv_pool"]
        idle = (
            info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["num_pending_reqs"] == 0
            and kv["locked_tokens"] == 0 and kv["used_tokens"] == kv["cached_tokens"]
        )
        if idle:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not go idle in {timeout} s: {info}")
        time.sleep(0.1)


@contextlib.contextmanager
def real_router(worker_urls: list[str], policy: str, log_path: Path, log_level: str = "warning"):
    """The real sglang-router (`python -m sglang_router.launch_router`, the argv the --dp-size launcher
    builds) on a free loopback port in front of `worker_urls`, logging to `log_path` at `log_level` (a
    --log-level of serve.py); yields its URL once it lists every worker as healthy (60 s at most), and
    stops it after."""
    from jaxserve.launch.data_parallel import router_argv
    from jaxserve.server_args import ServerArgs

    port = free_port()
    argv = router_argv(ServerArgs(port=port, router_policy=policy, dp_size=len(worker_urls), log_level=log_level), worker_urls)
    argv[argv.index("--prometheus-port") + 1] = str(free_port())  # not port + N + 1: free for certain
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        try:
            while True:
                assert proc.poll() is None, f"sglang-router exited with {proc.returncode}"
                try:
                    workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
                    if len(workers) == len(worker_urls) and all(w["is_healthy"] for w in workers):
                        break
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                assert time.monotonic() < deadline, f"sglang-router did not list its {len(worker_urls)} workers in 60 s"
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            proc.wait(30)
