"""The process's own set-up, shared by every way of launching (server.py, multihost.py, data_parallel.py):
its logging (every client value escaped, jaxserve.log_safe) and the listening socket, bound before the model
loads so that a port in use fails in a second."""

from __future__ import annotations

import logging
import socket

from jaxserve.log_safe import LogSafeFormatter


def configure_logging(level: str) -> None:
    """One format for jaxserve, uvicorn and the libraries; uvicorn's start-up chatter only at debug.
    Every value formatted into a message is escaped (jaxserve.log_safe): a client cannot forge lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(LogSafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
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
