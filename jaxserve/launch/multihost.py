"""Several processes (`--nnodes N`, jaxserve/parallel/distributed.py): every rank joins jax.distributed first
and checks its flags against rank 0's (`join_cluster`); rank 0 then runs `server.launch_server`, its runner
sending each device program to the others, and a lost rank is an engine death. Ranks 1..N-1 build the same
engine, bind no port and replay rank 0's programs (`run_follower`) until it sends shutdown.

Test hook (not a user flag): `JAXSERVE_TEST_FOLLOWER_START_DELAY_S=S` in a follower's environment makes
it wait S seconds after building its engine, before its configuration check: a compile that outlasts
`--dist-timeout` while the rank heartbeats.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time

from jaxserve.launch.malloc import return_freed_memory
from jaxserve.launch.process import configure_logging
from jaxserve.server.gc_pauses import freeze_gc, warn_on_long_gc
from jaxserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

REFUSAL_LINGER_S = 3.0
FOLLOWER_START_DELAY_ENV = "JAXSERVE_TEST_FOLLOWER_START_DELAY_S"
# ServerArgs fields that may differ between ranks: where this rank listens, logs and caches, and what
# only rank 0 uses (HTTP, admission, seeds of requests). Every other flag shapes the programs or the pool.
PER_RANK_FIELDS = frozenset({
    "node_rank", "host", "port", "api_key", "served_model_name", "log_level", "decode_log_interval",
    "disable_metrics", "enable_debug_checks", "enable_radix_cache_stats", "model_path", "tokenizer_path",
    "compilation_cache_dir", "weights_cache_dir", "weights_cache", "random_seed", "max_queued_requests",
    "queue_timeout", "keep_alive_on_engine_error", "shutdown_timeout", "tool_call_parser", "router_policy",
})


def args_fingerprint(args: ServerArgs, local_device_count: int) -> dict[str, object]:
    """What must be equal on every rank: each flag outside `PER_RANK_FIELDS` by its name ("--page-size"),
    the model by its file or directory name ("model"; paths may differ between hosts) and this process's
    device count."""
    out: dict[str, object] = {"model": os.path.basename(str(args.model_path).rstrip("/")),
                              "devices per process": local_device_count}
    for f in dataclasses.fields(args):
        if f.name not in PER_RANK_FIELDS:
            out["--" + f.name.replace("_", "-")] = getattr(args, f.name)
    return out


def join_cluster(server_args: ServerArgs):
    """`--nnodes > 1`: join jax.distributed, then refuse a rank whose flags differ from rank 0's or a
    `--tp-size` other than the devices of all ranks. Returns the `Cluster`.

    Raises:
        SystemExit: any of those, with the reason (a missing rank exits inside `initialize`).
    """
    import jax

    from jaxserve.parallel import distributed

    configure_logging(server_args.log_level)
    if server_args.gc_warning_threshold_secs > 0:
        warn_on_long_gc(server_args.gc_warning_threshold_secs)
    cluster = distributed.initialize(distributed.Topology(server_args.nnodes, server_args.node_rank, server_args.dist_init_addr,
                                                          server_args.dist_timeout or distributed.DEFAULT_DIST_TIMEOUT_S))
    cluster.start_heartbeat()  # every rank: a start-up wait lasts as long as the awaited rank beats
    try:
        cluster.check_same_config("flags", args_fingerprint(server_args, jax.local_device_count()))
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

    fields = {"model config": engine.runner.model_config, "KV pool pages": engine.runner.pool_shape.num_pages,
              "context length": engine.limits.context_length}
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
