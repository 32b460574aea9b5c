"""`launch_server(server_args)`: one server, as `python scripts/serve.py` runs it (cli.py parses and checks the
flags first).

Order: check the model path, bind the port (so a port in use fails in a second, not after loading), load the
model and compile (the engine shows progress bars), start the engine loop, then serve the Starlette app
with uvicorn and print one line saying where.

Stopping:
- SIGTERM drains: new requests get 503 at once (`app.state.draining`), running and queued ones may
  finish for up to `--shutdown-timeout` seconds, the rest are aborted with finish reason
  `{"type": "abort", "message": "the server is shutting down ..."}`, then uvicorn closes the
  connections and the process exits 0. A second SIGTERM exits at once (status 1).
- Ctrl-C (SIGINT) stops uvicorn at once (its graceful close of the connections), then the engine loop.
- Engine death (see engine_loop.py): the process exits with status 1 once the failed requests have
  been answered, unless `--keep-alive-on-engine-error` (then it stays up answering 503).

`--help` and a bad flag answer before jax is imported: this module imports only uvicorn and the
flags at the top, the engine and the app inside `launch_server`.

The command line itself (flags, the checks before anything loads, one server or several processes or
data-parallel workers) is cli.py's; several processes (`--nnodes N`) are multihost.py's.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import uvicorn

from jaxserve.launch.malloc import return_freed_memory
from jaxserve.launch.model_path_check import model_path_problem
from jaxserve.launch.multihost import check_engine_config
from jaxserve.launch.process import bind_socket, configure_logging
from jaxserve.server.gc_pauses import freeze_gc, warn_on_long_gc
from jaxserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5
# Seconds between the engine's death and the exit: the failed requests' answers go out, and a health
# probe in that window reads the 503 instead of a refused connection.
ENGINE_DEATH_EXIT_DELAY_S = 3.0


class _Server(uvicorn.Server):
    """uvicorn's server, printing jaxserve's ready line once it accepts connections, draining on
    SIGTERM and stopping when the engine dies (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, ready_line: str, engine_loop, app_state, server_args: ServerArgs):
        super().__init__(config)
        self._ready_line = ready_line
        self._engine_loop = engine_loop
        self._app_state = app_state
        self._shutdown_timeout = server_args.shutdown_timeout
        self._keep_alive = server_args.keep_alive_on_engine_error
        self._num_sigterms = 0
        self.engine_died = False
        engine_loop.add_death_observer(self._on_engine_death)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            print(self._ready_line, flush=True)

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM:
            return super().handle_exit(sig, frame)
        self._num_sigterms += 1
        if self._num_sigterms > 1:
            logger.warning("second SIGTERM: exiting now")
            os._exit(1)
        logger.info("SIGTERM: draining (new requests get 503; running ones have %g s to finish)", self._shutdown_timeout)
        self._app_state.draining = True
        threading.Thread(target=self._drain, name="jaxserve-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self._shutdown_timeout
        while self._engine_loop.num_pending and time.monotonic() < deadline:
            time.sleep(0.05)
        if (left := self._engine_loop.num_pending) > 0:
            logger.warning("--shutdown-timeout %g s is up: aborting %d request(s)", self._shutdown_timeout, left)
            message = f"the server is shutting down: aborted after --shutdown-timeout {self._shutdown_timeout:g} s"
            self._engine_loop.abort_all(message).result(timeout=10)
        self.should_exit = True

    def _on_engine_death(self, message: str) -> None:  # the engine loop's thread, after the failures went out
        self.engine_died = True
        # the engine loop has logged why (once); this line only says what happens next
        if self._keep_alive:
            logger.error("staying up after the engine died (--keep-alive-on-engine-error): every request gets 503")
        else:
            logger.error("exiting with status 1 in %g s: the engine died", ENGINE_DEATH_EXIT_DELAY_S)
            threading.Timer(ENGINE_DEATH_EXIT_DELAY_S, lambda: setattr(self, "should_exit", True)).start()


def ready_line_flags(args: ServerArgs) -> str:
    """The flags that change what a client gets, for the ready line ("; --quantization w8a8_int8, ...";
    "" when none is given)."""
    flags = [f"--{name.replace('_', '-')} {value}" for name, value in
             (("quantization", args.quantization), ("speculative_algorithm", args.speculative_algorithm)) if value]
    return "; " + ", ".join(flags) if flags else ""


def launch_server(server_args: ServerArgs, cluster=None) -> None:
    """Load the model and serve it over HTTP until interrupted (blocks). `cluster`: rank 0's
    `jaxserve.parallel.distributed.Cluster` when it runs over several processes (`join_cluster`).

    Raises:
        SystemExit: the port cannot be bound or the model cannot be loaded (with the reason).
    """
    configure_logging(server_args.log_level)
    if server_args.gc_warning_threshold_secs > 0:
        warn_on_long_gc(server_args.gc_warning_threshold_secs)
    if (problem := model_path_problem(server_args.model_path)) is not None:
        raise SystemExit(f"jaxserve: cannot start: {problem}")
    tokenizer_path = server_args.tokenizer_path
    if tokenizer_path not in (None, "default") and not os.path.exists(tokenizer_path):
        raise SystemExit(f"jaxserve: cannot start: --tokenizer-path {tokenizer_path}: the tokenizer path does not exist")
    sock = bind_socket(server_args.host, server_args.port)
    # the app and the engine import jax (~1 s, more on a busy machine): not before the flags parsed
    from jaxserve.engine.engine import Engine
    from jaxserve.engine.engine_loop import EngineLoop
    from jaxserve.server.app import create_app, served_model_name

    logger.info("loading %s", server_args.model_path if server_args.model_path != "default" else "the default model")
    try:
        engine = Engine(server_args)
    except (FileNotFoundError, ValueError) as e:
        logger.debug("engine start-up failed", exc_info=True)
        sock.close()
        raise SystemExit(f"jaxserve: cannot start: {e}") from None
    if cluster is not None:
        check_engine_config(cluster, engine)
        engine.runner.channel = cluster.channel
    return_freed_memory()
    startup_memory = engine.memory_usage()
    logger.info(startup_memory.log_line())
    engine_loop = EngineLoop(
        engine, max_queued_requests=server_args.max_queued_requests, queue_timeout_s=server_args.queue_timeout
    ).start()
    logger.info(
        "admission: at most %d requests wait (--max-queued-requests%s), queue timeout %s",
        engine_loop.max_queued_requests, "" if server_args.max_queued_requests else ": from the pool size",
        f"{server_args.queue_timeout:g} s" if server_args.queue_timeout else "off",
    )
    if cluster is not None:
        cluster.watch(on_lost=engine_loop.die)
    app = create_app(engine_loop, server_args, startup_memory)
    freeze_gc("server start-up", server_args.gc_threshold)  # D-44: /health must not wait for a full collection
    host, port = sock.getsockname()[:2]
    shown_host = f"[{host}]" if ":" in host else host
    ready = (
        f"jaxserve ready: serving {served_model_name(server_args, engine.runner.model_path)} at "
        f"http://{shown_host}:{port} (OpenAI API at /v1{ready_line_flags(server_args)})"
    )
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level="debug" if server_args.log_level == "debug" else "warning",
        access_log=server_args.log_level == "debug",
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = _Server(config, ready, engine_loop, app.state, server_args)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled gracefully
        pass
    finally:
        lost = cluster is not None and cluster.lost is not None
        # a lost rank can leave the loop thread inside a collective that waits for it (gloo's own
        # timeout, none on NCCL): its requests were answered, so wait neither for the thread nor in
        # JAX's exit handlers, which wait for the lost rank too (close tells the followers why first)
        engine_loop.shutdown(timeout=0 if lost else 30)
        if cluster is not None:
            cluster.close()  # the followers exit
        logger.info("jaxserve stopped")
        if lost:
            logging.shutdown()
            sys.stdout.flush()
            os._exit(1)
    if server.engine_died:
        raise SystemExit(1)
