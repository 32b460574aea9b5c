"""The command line: `python scripts/serve.py [flags]` and `python -m jaxserve.launch [flags]` run `main`.

Order: parse the flags, on CPU set glibc malloc to keep freed memory (D-45; before jax starts its threads),
check the flags (`check_start_up_args`; exit 2 with one line), configure logging, then one server
(server.py), several processes (`--nnodes`, multihost.py) or data-parallel workers behind sglang-router
(`--dp-size`, data_parallel.py). `--help` and a bad flag answer before jax is imported.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

from jaxserve.launch.malloc import keep_freed_memory
from jaxserve.launch.process import configure_logging
from jaxserve.launch.server import launch_server
from jaxserve.server_args import ServerArgs

logger = logging.getLogger(__name__)


def check_start_up_args(args: ServerArgs) -> None:
    """The flag checks that argparse cannot make, made before any port binds or model loads: the
    --chat-template file, the storage tier's extra config, and (for one process: --dp-size 1, --nnodes 1) the flags that depend on the JAX
    platform (--device, --kv-cache-dtype, against `jax.default_backend()`) and on its devices (--tp-size,
    against the visible ones), and --context-length against the model's trained length (SGLang's rule,
    model/context_length.py). `main` reports a failure as argparse does: `serve.py: error: ...` and
    exit status 2.

    Raises:
        ValueError: the first bad flag, named.
    """
    from jaxserve.cache.storage import StorageConfig
    from jaxserve.model.context_length import resolve_context_length, trained_context_length
    from jaxserve.server.openai.chat_template import load_chat_template

    load_chat_template(args.chat_template)
    StorageConfig.from_flags(args.hicache_storage_backend, args.hicache_storage_backend_extra_config)  # its extra config
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
        from jaxserve.launch.data_parallel import launch_data_parallel  # its router's imports only here

        return launch_data_parallel(args)
    if args.nnodes > 1:
        # the converted-weights cache is an orbax checkpoint, whose reads and writes under jax.distributed
        # wait for every process (sync_global_devices) while each rank loads on its own: they stalled
        args = dataclasses.replace(args, weights_cache=False)
        from jaxserve.launch.multihost import join_cluster, run_follower

        cluster = join_cluster(args)
        if args.node_rank > 0:
            return run_follower(args, cluster)
        return launch_server(args, cluster)
    launch_server(args)
