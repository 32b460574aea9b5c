"""`launch_server(server_args)`: what `python scripts/serve.py` and `python -m jaxserve.launch` run.

Order: parse the flags, on CPU set glibc malloc to keep freed memory (D-45; before jax starts its threads),
check the flags (`check_start_up_args`; exit 2 with one line), configure logging, check the model
path, bind the port (so a port in use fails in a second, not after loading), load the model and compile
(the engine shows progress bars), start the engine loop, then serve the Starlette app with uvicorn and
print one line saying where.

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

Several processes (`--nnodes N`, jaxserve/parallel/distributed.py): every rank joins jax.distributed
first and checks its flags against rank 0's; rank 0 then runs everything above, its runner sending
each device program to the others, and a lost rank is an engine death. Ranks 1..N-1 build the same
engine, bind no port and replay rank 0's programs (`run_follower`) until it sends shutdown.

Test hook (not a user flag): `JAXSERVE_TEST_FOLLOWER_START_DELAY_S=S` in a follower's environment makes
it wait S seconds after building its engine, before its configuration check: a compile that outlasts
`--dist-timeout` while the rank heartbeats.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time

import uvicorn

from jaxserve.config import ServerArgs
from jaxserve.launch.malloc import keep_freed_memory, return_freed_memory
from jaxserve.launch.model_path_check import model_path_problem
from jaxserve.log_safe import LogSafeFormatter
from jaxserve.server.gc_pauses import freeze_gc, warn_on_long_gc

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5
# Seconds between the engine's death and the exit: the failed requests' answers go out, and a health
# probe in that window reads the 503 instead of a refused connection.
ENGINE_DEATH_EXIT_DELAY_S = 3.0
REFUSAL_LINGER_S = 3.0
FOLLOWER_START_DELAY_ENV = "JAXSERVE_TEST_FOLLOWER_START_DELAY_S"


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
        f"jaxserve ready: serving {served_model_name(server_args, engine.model_path)} at "
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


def join_cluster(server_args: ServerArgs):
    """`--nnodes > 1`: join jax.distributed, then refuse a rank whose flags differ from rank 0's or a
    `--tp-size` other than the devices of all ranks. Returns the `Cluster`.

    Raises:
        SystemExit: any of those, with the reason (a missing rank exits inside `initialize`).
    """
    from jaxserve.parallel import distributed

    configure_logging(server_args.log_level)
    if server_args.gc_warning_threshold_secs > 0:
        warn_on_long_gc(server_args.gc_warning_threshold_secs)
    cluster = distributed.initialize(distributed.Topology.from_server_args(server_args))
    cluster.start_heartbeat()  # every rank: a start-up wait lasts as long as the awaited rank beats
    try:
        cluster.check_same_config("flags", distributed.args_fingerprint(server_args))
        cluster.check_devices(server_args.tp_size)
    except distributed.DistributedStartError as e:
        _refuse_start(f"jaxserve: cannot start: {e}", server_args.node_rank)
    return cluster


def _refuse_start(message: str, rank: int) -> None:
    """Exit 1 with `message` on stderr, as SystemExit would, but past jax.distributed's shutdown
    handshake (the runtime aborts a process whose shutdown finds its coordinator gone). Rank 0, whose
    process holds the coordination service, leaves `REFUSAL_LINGER_S` later, so that the followers
    read its verdict and exit with their own message first (JAX terminates them once it is gone)."""
    print(message, file=sys.stderr, flush=True)
    logging.shutdown()
    if rank == 0:
        time.sleep(REFUSAL_LINGER_S)
    os._exit(1)


def check_engine_config(cluster, engine) -> None:
    """What the flags alone do not fix must match too: the model's shape and the KV pool size (sized
    from each host's memory unless --max-total-tokens is given)."""
    from jaxserve.parallel.distributed import DistributedStartError

    fields = {"model config": engine.model_config, "KV pool pages": engine.pool_shape.num_pages,
              "context length": engine.context_length}
    try:
        cluster.check_same_config("engine", fields)
    except DistributedStartError as e:
        _refuse_start(f"jaxserve: cannot start: {e}", cluster.topology.node_rank)


def run_follower(server_args: ServerArgs, cluster) -> None:
    """Ranks 1..N-1 of `--nnodes N`: build the engine as rank 0 does, then replay rank 0's device
    programs until it sends shutdown (no HTTP server, no scheduling). Blocks.

    Raises:
        SystemExit: the model cannot be loaded, or the configuration differs from rank 0's.
    """
    from jaxserve.engine.engine import Engine
    from jaxserve.parallel.distributed import RankLostError, follow, short_cause

    rank = server_args.node_rank
    try:
        engine = Engine(server_args)
    except (FileNotFoundError, ValueError) as e:
        _refuse_start(f"jaxserve: cannot start rank {rank}: {e}", rank)
    time.sleep(float(os.environ.get(FOLLOWER_START_DELAY_ENV, 0)))
    check_engine_config(cluster, engine)
    return_freed_memory()
    freeze_gc(f"rank {rank} start-up", server_args.gc_threshold)
    # SIGTERM of a follower alone would stall rank 0's next collective; rank 0's watchdog then fails it
    print(f"jaxserve follower ready: rank {rank} of --nnodes {server_args.nnodes} runs rank 0's steps "
          f"({server_args.dist_init_addr})", flush=True)
    try:
        num_calls = follow(engine.runner, cluster)
    except Exception as e:  # noqa: BLE001 - the cluster is broken: one line, not a gloo traceback
        logger.debug("rank %d: the follower loop failed", rank, exc_info=True)
        if isinstance(e, RankLostError):
            why = str(e)
        else:
            why = f"a step failed, so another rank (or the link to it) is gone ({short_cause(e)})"
            cluster.report_failure(why)  # rank 0 then names the rank that stopped, not this one
        print(f"jaxserve: rank {rank} of --nnodes {server_args.nnodes}: {why}: exiting with status 1", flush=True)
        logging.shutdown()
        os._exit(1)
    logger.info("rank 0 sent shutdown after %d device programs: rank %d exits", num_calls, rank)
    # not through jax.distributed.shutdown: rank 0, whose process holds the coordination service, may
    # already be gone, and the runtime aborts a process whose shutdown call finds no coordinator
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


def check_start_up_args(args: ServerArgs) -> None:
    """The flag checks that argparse cannot make, made before any port binds or model loads: the
    --chat-template file, and (for one process: --dp-size 1, --nnodes 1) the flags that depend on the JAX
    platform (--device, --kv-cache-dtype, against `jax.default_backend()`) and on its devices (--tp-size,
    against the visible ones), and --context-length against the model's trained length (SGLang's rule,
    engine/context_length.py). `main` reports a failure as argparse does: `serve.py: error: ...` and
    exit status 2.

    Raises:
        ValueError: the first bad flag, named.
    """
    from jaxserve.engine.context_length import resolve_context_length, trained_context_length
    from jaxserve.server.openai.chat_template import load_chat_template

    load_chat_template(args.chat_template)
    if args.dp_size == 1 and args.nnodes == 1:  # a launcher's workers (or ranks) check their own platform
        import jax  # the process that serves imports it next anyway

        from jaxserve.parallel.mesh import make_mesh

        args.check_platform_flags(jax.default_backend())
        make_mesh(args.tp_size)  # raises when --tp-size is more than the visible devices
    if args.context_length is not None and (trained := trained_context_length(args.model_path)) is not None:
        resolve_context_length(args.context_length, trained, default_cap=trained)  # raises above the model's


def main(argv: list[str] | None = None) -> None:
    """scripts/serve.py and `python -m jaxserve.launch`: one server, or with `--dp-size N` N workers
    behind sglang-router (data_parallel.py)."""
    from jaxserve.server.openai.reasoning import REASONING_PARSERS
    from jaxserve.server.openai.tools.parsers import PARSERS  # the one table of names; imports no jax

    args = ServerArgs.from_cli(argv if argv is not None else sys.argv[1:],
                               choices={"tool_call_parser": tuple(PARSERS), "reasoning_parser": tuple(REASONING_PARSERS)})
    malloc_line = keep_freed_memory(args.device)  # D-45, on CPU: before jax starts its threads (check_start_up_args)
    try:
        check_start_up_args(args)
    except ValueError as e:
        print(f"serve.py: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    configure_logging(args.log_level)
    logger.info(malloc_line)
    if args.dp_size > 1:
        from jaxserve.launch.data_parallel import launch_data_parallel

        return launch_data_parallel(args)
    if args.nnodes > 1:
        # the converted-weights cache is an orbax checkpoint, whose reads and writes under jax.distributed
        # wait for every process (sync_global_devices) while each rank loads on its own: they stalled
        args = dataclasses.replace(args, weights_cache=False)
        cluster = join_cluster(args)
        if args.node_rank > 0:
            return run_follower(args, cluster)
        return launch_server(args, cluster)
    launch_server(args)
