"""`--dp-size N`: N jaxserve worker processes behind the real sglang-router (PyPI `sglang-router`).

Data parallelism is not ours (DESIGN.md): each worker is a whole jaxserve server (its own engine, KV
pool and radix cache) and sglang-router, SGLang's Rust router, spreads the requests over them. This
module only starts, watches and stops the processes:

- Ports: the router listens on `--host:--port` (what clients use); worker i listens on 127.0.0.1 at
  `--port + 1 + i`; the router's Prometheus metrics are on `--port + N + 1`.
- Devices: each worker gets its share. CPU: the launcher's cores split into N contiguous sets (CPU
  affinity), when there are at least N, and with `--tp-size T > 1` T host devices each
  (`JAX_NUM_CPU_DEVICES=T`); GPU: exactly T of `CUDA_VISIBLE_DEVICES` per worker (the first N x T; more
  than the visible GPUs is refused with both numbers). TPU chips are not split here (docs/scaling.md:
  one server per host, the router in front).
- Flags: every worker gets the launcher's flags as given (so `--max-total-tokens` is per worker),
  without `--dp-size`, `--router-policy`, `--host` and `--port`.
- Start-up: the workers start together; the router starts once every worker answers /health, and
  the ready line (the router's URL) is printed once the router lists every worker as healthy.
- Stop: SIGTERM or Ctrl-C stops the router and every worker at once (the workers drain for
  `--shutdown-timeout` seconds); whatever still runs after that and a grace period is killed. A
  second SIGTERM kills everything at once. When one process exits on its own, the others are
  stopped and the launcher exits with status 1. Each child also gets SIGTERM from the kernel if the
  launcher itself dies (`PR_SET_PDEATHSIG`), so nothing is left running.
Each child's output is copied to the launcher's stdout, each line prefixed with `worker i| ` or
`router| `.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import IO

import httpx

from jaxserve.launch.server import ready_line_flags
from jaxserve.server_args import ServerArgs

WORKER_HOST = "127.0.0.1"
# flags the launcher owns: a worker gets its own port and never starts a router of its own
LAUNCHER_FIELDS = frozenset({"dp_size", "router_policy", "host", "port"})
ROUTER_LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error"}
STOP_GRACE_S = 15.0  # after --shutdown-timeout, before SIGKILL
POLL_S = 0.2
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class DeviceShare:
    """One worker's devices: `cpus` for its CPU affinity (None: all of the launcher's), `env` for the
    variables that select its accelerators."""

    cpus: tuple[int, ...] | None = None
    env: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Platform:
    """What the workers would run on: `name` is JAX's backend ("cpu", "gpu", "tpu"), `num_devices` its
    local device count (cores for the CPU)."""

    name: str
    num_devices: int


def worker_argv(args: ServerArgs, port: int) -> list[str]:
    """The serve.py flags of one worker: every flag that differs from its default, except the
    launcher's own (LAUNCHER_FIELDS), then `--host 127.0.0.1 --port PORT`."""
    argv: list[str] = []
    for f in dataclasses.fields(ServerArgs):
        value = getattr(args, f.name)
        if f.name in LAUNCHER_FIELDS or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv + ["--host", WORKER_HOST, "--port", str(port)]


def worker_ports(args: ServerArgs) -> list[int]:
    return [args.port + 1 + i for i in range(args.dp_size)]


def router_argv(args: ServerArgs, worker_urls: list[str]) -> list[str]:
    """`python -m sglang_router.launch_router ...` in front of `worker_urls` (sglang-router 0.3.2's flags)."""
    argv = [
        sys.executable, "-m", "sglang_router.launch_router",
        "--worker-urls", *worker_urls,
        "--host", args.host, "--port", str(args.port),
        "--policy", args.router_policy,
        "--prometheus-host", WORKER_HOST, "--prometheus-port", str(args.port + args.dp_size + 1),
        "--log-level", ROUTER_LOG_LEVELS[args.log_level],
        # the router waits this long for requests in flight; the workers end theirs by --shutdown-timeout
        "--shutdown-grace-period-secs", str(math.ceil(args.shutdown_timeout) + 5),
    ]
    if args.api_key:
        argv += ["--api-key", args.api_key]
    return argv


def device_shares(platform: Platform, dp_size: int, cpus: list[int], visible_gpus: list[str] | None,
                  tp_size: int = 1) -> list[DeviceShare]:
    """Split the devices of `platform` over `dp_size` workers of `tp_size` devices each (see the module
    docstring).

    `cpus`: the launcher's CPU affinity; `visible_gpus`: CUDA_VISIBLE_DEVICES as a list, None if unset.
    Raises:
        ValueError: fewer GPUs than dp_size x tp_size (both numbers named), or a TPU.
    """
    if platform.name == "cpu":
        host_devices = (("JAX_NUM_CPU_DEVICES", str(tp_size)),) if tp_size > 1 else ()
        if len(cpus) < dp_size:
            return [DeviceShare(env=host_devices) for _ in range(dp_size)]
        per, extra = divmod(len(cpus), dp_size)
        shares, start = [], 0
        for i in range(dp_size):
            end = start + per + (i < extra)
            shares.append(DeviceShare(cpus=tuple(cpus[start:end]), env=host_devices))
            start = end
        return shares
    if platform.name == "gpu":
        ids = visible_gpus if visible_gpus is not None else [str(i) for i in range(platform.num_devices)]
        if dp_size * tp_size > len(ids):
            raise ValueError(f"--dp-size {dp_size} x --tp-size {tp_size} needs {dp_size * tp_size} GPUs; "
                             f"{len(ids)} visible")
        per = tp_size
        return [DeviceShare(env=(("CUDA_VISIBLE_DEVICES", ",".join(ids[i * per:(i + 1) * per])),)) for i in range(dp_size)]
    raise ValueError(f"--dp-size > 1 does not split {platform.name} devices; start one server per host and "
                     "sglang-router in front of them (docs/scaling.md)")


def detect_platform() -> Platform:
    """The workers' JAX backend, without initializing one in the launcher (it would hold the devices):
    JAX_PLATFORMS=cpu says so; otherwise a short-lived `python -c "import jax ..."` asks."""
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip() == "cpu":
        return Platform("cpu", len(os.sched_getaffinity(0)))
    probe = "import jax; print(jax.default_backend(), jax.local_device_count())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"jaxserve: cannot start: JAX did not start ({out.stderr.strip()[-500:]})")
    name, count = out.stdout.split()[-2:]
    return Platform(name, int(count) if name != "cpu" else len(os.sched_getaffinity(0)))


_ANSI_SGR = re.compile(r"\x1b\[[0-9;]*m")  # colour and style escapes (sglang-router's log lines carry them)


class _Child:
    """One child process with its output copied, line by line and prefixed, to our stdout."""

    def __init__(self, name: str, argv: list[str], share: DeviceShare = DeviceShare()):
        self.name = name
        env = {**os.environ, **dict(share.env), "PYTHONUNBUFFERED": "1"}
        libc_prctl = ctypes.CDLL(None).prctl  # resolved here: the child only calls it

        def in_child() -> None:
            libc_prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if share.cpus is not None:
                os.sched_setaffinity(0, share.cpus)

        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=in_child, text=True, errors="replace", bufsize=1,
                                     start_new_session=True)  # a terminal's Ctrl-C reaches the launcher only, which stops them in order
        self._pump = threading.Thread(target=self._copy, args=(self.proc.stdout,), name=f"jaxserve-{name}-log", daemon=True)
        self._pump.start()

    def _copy(self, stream: IO[str]) -> None:
        keep_colours = sys.stdout.isatty()  # the router colours its lines whatever NO_COLOR says
        for line in stream:
            if not keep_colours:
                line = _ANSI_SGR.sub("", line)
            sys.stdout.write(f"{self.name}| {line}")
            sys.stdout.flush()

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)


class _Stop(Exception):
    """A signal asked the launcher to stop."""


class DataParallelLauncher:
    """The processes of one `--dp-size N` server: `run()` starts them, waits for a signal or for one
    to exit, and stops them all (see the module docstring). Returns the exit status."""

    def __init__(self, args: ServerArgs, platform: Platform):
        self.args = args
        self.shares = device_shares(platform, args.dp_size, sorted(os.sched_getaffinity(0)), _visible_gpus(), args.tp_size)
        self.urls = [f"http://{WORKER_HOST}:{p}" for p in worker_ports(args)]
        self.children: list[_Child] = []
        self._stop = threading.Event()
        self._num_signals = 0
        self._headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def _on_signal(self, sig: int, frame) -> None:
        self._num_signals += 1
        if self._num_signals > 1:
            for child in self.children:
                child.signal(signal.SIGKILL)
            os._exit(1)
        self._stop.set()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            for i, share in enumerate(self.shares):
                port = worker_ports(self.args)[i]
                argv = [sys.executable, "-m", "jaxserve.launch", *worker_argv(self.args, port)]
                self.children.append(_Child(f"worker {i}", argv, share))
            for url in self.urls:
                self._wait(lambda url=url: self._get(url + "/health").status_code == 200)
            router = _Child("router", router_argv(self.args, self.urls))
            self.children.append(router)
            router_url = f"http://{_loopback(self.args.host)}:{self.args.port}"
            self._wait(lambda: self._num_healthy(router_url) == self.args.dp_size)
            print(self._ready_line(), flush=True)
            while not self._stop.wait(POLL_S):
                if (dead := self._first_dead()) is not None:
                    print(f"jaxserve: {dead.name} exited with status {dead.poll()}: stopping the others", flush=True)
                    return self._stop_all(1)
            return self._stop_all(0)
        except _Stop:
            return self._stop_all(0)
        except BaseException:
            self._stop_all(1)
            raise

    def _get(self, url: str) -> httpx.Response:
        return httpx.get(url, headers=self._headers, timeout=5)

    def _num_healthy(self, router_url: str) -> int:
        """Workers the router lists as healthy (its GET /workers)."""
        workers = self._get(router_url + "/workers").json().get("workers", [])
        return sum(1 for w in workers if w.get("is_healthy", True))

    def _wait(self, is_ready) -> None:
        """Poll until `is_ready()`; raises _Stop on a signal, SystemExit when a child exits."""
        while True:
            if self._stop.is_set():
                raise _Stop
            if (dead := self._first_dead()) is not None:
                raise SystemExit(f"jaxserve: cannot start: {dead.name} exited with status {dead.poll()} during start-up")
            try:
                if is_ready():
                    return
            except (httpx.HTTPError, ValueError):
                pass
            self._stop.wait(0.5)

    def _first_dead(self) -> _Child | None:
        return next((c for c in self.children if c.poll() is not None), None)

    def _ready_line(self) -> str:
        info = self._get(self.urls[0] + "/model_info").json()
        host = f"[{self.args.host}]" if ":" in self.args.host else self.args.host
        ports = worker_ports(self.args)
        return (f"jaxserve ready: serving {info['served_model_name']} at http://{host}:{self.args.port} "
                f"(OpenAI API at /v1{ready_line_flags(self.args)}; sglang-router policy {self.args.router_policy} "
                f"over {self.args.dp_size} workers on ports {ports[0]}-{ports[-1]})")

    def _stop_all(self, status: int) -> int:
        for child in self.children:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.shutdown_timeout + STOP_GRACE_S
        while any(c.poll() is None for c in self.children) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        for child in self.children:
            if child.poll() is None:
                print(f"jaxserve: {child.name} did not stop in time: killing it", flush=True)
                child.signal(signal.SIGKILL)
                child.proc.wait(10)
        print(f"jaxserve stopped: the router and {self.args.dp_size} workers", flush=True)
        return status


def _visible_gpus() -> list[str] | None:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [v.strip() for v in value.split(",") if v.strip()] if value is not None else None


def _loopback(host: str) -> str:
    """The address the launcher reaches the router at (a wildcard host means this machine)."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, f"[{host}]" if ":" in host else host)


def launch_data_parallel(args: ServerArgs) -> None:
    """Run `args.dp_size` workers behind sglang-router until SIGTERM (blocks; see the module docstring).

    Raises:
        SystemExit: sglang-router is not installed, a port is taken, the devices cannot be split, or a
            process failed (status 1).
    """
    from jaxserve.launch.process import bind_socket, configure_logging

    configure_logging(args.log_level)
    if importlib.util.find_spec("sglang_router") is None:
        raise SystemExit("jaxserve: cannot start: --dp-size needs sglang-router: pip install 'jaxserve[router]'")
    for port in [args.port, *worker_ports(args), args.port + args.dp_size + 1]:  # fail in a second, not after loading
        bind_socket(args.host if port == args.port else WORKER_HOST, port).close()
    try:
        launcher = DataParallelLauncher(args, detect_platform())
    except ValueError as e:
        raise SystemExit(f"jaxserve: cannot start: {e}") from None
    if (status := launcher.run()) != 0:
        raise SystemExit(status)
