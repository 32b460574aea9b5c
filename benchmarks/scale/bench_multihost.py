"""What the multi-host step channel costs: the same greedy decode workload at tp T in one process of T
CPU devices, and at tp T over T processes of one device each (`--nnodes T` on loopback), in one
invocation; prints one JSON line per run and the ratio.

    python -m benchmarks.scale.bench_multihost [--model-path default] [--tp 3] [--batch 4] [--new-tokens 64]

Per run: seconds per engine step (generate wall time / steps, after a warm-up generate that compiles
every bucket it uses) and, over several processes, the channel's messages and pickled bytes per step
and the seconds rank 0 spent publishing them (`StepChannel.publish`, the key-value store's set).
The multi-process step also pays gloo (TCP) all-reduces instead of in-process ones: the ratio is the
whole cost of going multi-process on one machine, of which the publish time is the channel's share.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--max-total-tokens", "2048", "--context-length", "512", "--max-running-requests", "8",
         "--chunked-prefill-size", "128", "--disable-precompile"]


def _prompts(batch: int) -> list[list[int]]:
    return [[11 + i, 12 + i, 13, 14 + i, 15, 16 + 2 * i, 17, 18][: 4 + i % 4] for i in range(batch)]


def _measure(engine, args) -> dict:
    params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    engine.generate(_prompts(args.batch), params)  # compiles the buckets and samplers this workload uses
    return _measure_after_warmup(engine, args, params)


def run_single(args) -> dict:
    from jaxserve.engine.engine import Engine
    from jaxserve.server_args import ServerArgs

    server_args = ServerArgs.from_cli(["--model-path", args.model_path, *FLAGS, "--tp-size", str(args.tp)])
    return {"mode": f"tp {args.tp} in 1 process", **_measure(Engine(server_args), args)}


def run_leader(args) -> dict:
    import dataclasses

    from jaxserve.engine.engine import Engine
    from jaxserve.launch import multihost as launch
    from jaxserve.server_args import ServerArgs
    server_args = ServerArgs.from_cli(["--model-path", args.model_path, *FLAGS, *_cluster_flags(args, 0)])
    server_args = dataclasses.replace(server_args, weights_cache=False)  # as launch.main does
    cluster = launch.join_cluster(server_args)
    engine = Engine(server_args)
    launch.check_engine_config(cluster, engine)
    channel = cluster.channel
    engine.runner.channel = channel
    publish, spent = channel.publish, [0.0]

    def timed_publish(*a):
        t = time.perf_counter()
        publish(*a)
        spent[0] += time.perf_counter() - t

    channel.publish = timed_publish
    try:
        params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
        engine.generate(_prompts(args.batch), params)
        m0, b0, spent[0] = channel.num_messages, channel.num_bytes, 0.0
        out = _measure_after_warmup(engine, args, params)
        steps = out["steps"]
        out.update(messages_per_step=(channel.num_messages - m0) / steps, bytes_per_step=(channel.num_bytes - b0) / steps,
                   publish_s_per_step=spent[0] / steps)
    finally:
        cluster.close()
    return {"mode": f"tp {args.tp} over {args.tp} processes", **out}


def _measure_after_warmup(engine, args, params) -> dict:
    steps0, t0 = engine.stats.num_steps, time.perf_counter()
    engine.generate(_prompts(args.batch), params)
    wall, steps = time.perf_counter() - t0, engine.stats.num_steps - steps0
    return {"steps": steps, "s_per_step": wall / steps, "wall_s": wall}


def _cluster_flags(args, rank: int) -> list[str]:
    return ["--tp-size", str(args.tp), "--nnodes", str(args.tp), "--node-rank", str(rank),
            "--dist-init-addr", args.coordinator, "--dist-timeout", "120"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(args, role: str, devices: int) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices), "PYTHONPATH": str(REPO)}
    argv = [sys.executable, __file__, "--role", role, "--model-path", args.model_path, "--tp", str(args.tp),
            "--batch", str(args.batch), "--new-tokens", str(args.new_tokens), "--coordinator", args.coordinator or ""]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)


def _result(proc: subprocess.Popen, timeout: float) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench child failed with status {proc.returncode}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default="default")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--role", default="parent", choices=("parent", "single", "leader"))
    parser.add_argument("--coordinator", default="")
    args = parser.parse_args()
    if args.role != "parent":
        result = run_single(args) if args.role == "single" else run_leader(args)
        print(json.dumps(result), flush=True)
        os._exit(0)  # the followers may be gone: skip jax.distributed's shutdown handshake
    single = _result(_child(args, "single", args.tp), 900)
    print(json.dumps(single), flush=True)
    args.coordinator = f"127.0.0.1:{_free_port()}"
    followers = []
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    for rank in range(1, args.tp):
        argv = [sys.executable, "-m", "jaxserve.launch", "--model-path", args.model_path, *FLAGS, *_cluster_flags(args, rank),
                "--log-level", "warning"]
        followers.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL))
    try:
        multi = _result(_child(args, "leader", 1), 900)
    finally:
        for f in followers:
            try:
                f.wait(30)
            except subprocess.TimeoutExpired:
                f.kill()
    print(json.dumps(multi), flush=True)
    print(json.dumps({"multi_over_single_s_per_step": multi["s_per_step"] / single["s_per_step"],
                      "publish_share_of_multi_step": multi["publish_s_per_step"] / multi["s_per_step"]}), flush=True)


if __name__ == "__main__":
    main()
