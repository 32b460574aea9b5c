"""`launch_server(server_args)`: what `python scripts/serve.py` and `python -m jaxserve.server` run.

Order: configure logging, bind the port (so a port in use fails in a second, not after loading),
load the model and compile (the engine shows progress bars), start the engine loop, then serve the
Starlette app with uvicorn and print one line saying where. Ctrl-C (SIGINT) or SIGTERM stops uvicorn
gracefully, then the engine loop.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys

import uvicorn

from jaxserve.config import ServerArgs
from jaxserve.server.app import create_app, served_model_name

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


def configure_logging(level: str) -> None:
    """One format for jaxserve, uvicorn and the libraries; uvicorn's start-up chatter only at debug."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", force=True
    )
    quiet = logging.DEBUG if level == "debug" else logging.WARNING
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "httpx", "urllib3", "absl", "jax._src.xla_bridge"):
        logging.getLogger(name).setLevel(quiet)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn starts listening on it later).

    Raises:
        SystemExit: the address cannot be bound (in use, no permission, unknown host).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise SystemExit(f"jaxserve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, printing jaxserve's ready line once it accepts connections."""

    def __init__(self, config: uvicorn.Config, ready_line: str):
        super().__init__(config)
        self._ready_line = ready_line

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            print(self._ready_line, flush=True)


def launch_server(server_args: ServerArgs) -> None:
    """Load the model and serve it over HTTP until interrupted (blocks).

    Raises:
        SystemExit: the port cannot be bound or the model cannot be loaded (with the reason).
    """
    configure_logging(server_args.log_level)
    sock = bind_socket(server_args.host, server_args.port)
    from jaxserve.engine.engine import Engine
    from jaxserve.engine.engine_loop import EngineLoop

    logger.info("loading %s", server_args.model_path if server_args.model_path != "default" else "the default model")
    try:
        engine = Engine(server_args)
    except (FileNotFoundError, ValueError) as e:
        logger.debug("engine start-up failed", exc_info=True)
        sock.close()
        raise SystemExit(f"jaxserve: cannot start: {e}") from None
    engine_loop = EngineLoop(engine).start()
    app = create_app(engine_loop, server_args)
    host, port = sock.getsockname()[:2]
    shown_host = f"[{host}]" if ":" in host else host
    ready = (
        f"jaxserve ready: serving {served_model_name(server_args, engine.model_path)} at "
        f"http://{shown_host}:{port} (OpenAI API at /v1)"
    )
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level="debug" if server_args.log_level == "debug" else "warning",
        access_log=server_args.log_level == "debug",
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    # uvicorn stops gracefully on SIGINT / SIGTERM, then re-raises the signal: make that an exception
    # so the engine loop is shut down too, instead of the process dying in the default handler
    signal.signal(signal.SIGTERM, _raise_stop)
    try:
        _Server(config, ready).run(sockets=[sock])
    except (KeyboardInterrupt, _Stop):
        pass
    finally:
        engine_loop.shutdown()
        logger.info("jaxserve stopped")


class _Stop(Exception):
    """SIGTERM after uvicorn's graceful shutdown."""


def _raise_stop(signum, frame) -> None:
    raise _Stop()


def main(argv: list[str] | None = None) -> None:
    launch_server(ServerArgs.from_cli(argv if argv is not None else sys.argv[1:]))
