"""Decode latency, served: servers with different flags in turn, each measured by bench_serving.py.

Issue 20's measurements in one invocation: (1) ITL at 8 concurrent requests with prefill chunks
bounded or not, (2) n-gram speculation on against off on the copy-heavy and random workloads at 1
and 8 concurrent requests, (3) the server's TPOT at one request against `Engine.generate`'s ITL on
the same prompts, in-process (`--engine-itl`). Each variant is one server (`scripts/serve.py`,
started and stopped here); its workloads run one after the other against it.

    python scripts/bench_decode_latency.py --variants "off=" "ngram=--speculative-algorithm NGRAM" \
        --workloads copy-heavy:1:6 copy-heavy:8:16 --output-file docs/bench/spec.jsonl

A workload is DATASET:CONCURRENCY:NUM_PROMPTS (random: 128 in / 64 out; copy-heavy: 6 sentences,
128 out). Acceptance comes from the server's `jaxserve_spec_*_total` counters, before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("bench_serving", HERE / "bench_serving.py")
bench_serving = importlib.util.module_from_spec(_spec)
sys.modules["bench_serving"] = bench_serving
_spec.loader.exec_module(bench_serving)

DATASET_ARGS = {
    "random": ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64"],
    "copy-heavy": ["--dataset-name", "copy-heavy", "--copy-num-sentences", "6", "--copy-output-len", "128"],
}
SPEC_COUNTERS = ("verifications", "draft_tokens", "accepted_tokens")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], port: int, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "serve.py"), "--port", str(port), *flags],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return wait_healthy(proc, port, log_path, timeout_s=900, what="server")


def wait_healthy(proc: subprocess.Popen, port: int, log_path: Path, timeout_s: float, what: str) -> subprocess.Popen:
    """Returns `proc` once GET /health on 127.0.0.1:`port` answers 200. Raises RuntimeError (with the log's
    tail) if it exits first, TimeoutError (after killing it) if `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {Path(log_path).read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise TimeoutError(f"{what} did not start")


def spec_counters(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10, trust_env=False).text
    out = {}
    for line in text.splitlines():
        for name in SPEC_COUNTERS:
            if line.startswith(f"jaxserve_spec_{name}_total"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def workload_argv(workload: str, port: int, seed: int) -> list[str]:
    dataset, concurrency, num = workload.split(":")
    return [
        "--backend", "jaxserve", "--port", str(port), *DATASET_ARGS[dataset], "--num-prompts", num,
        "--max-concurrency", concurrency, "--seed", str(seed), "--disable-tqdm",
    ]


def run_variant(name: str, flags: list[str], workloads: list[str], seed: int, log_dir: Path) -> list[dict]:
    port = free_port()
    proc = start_server(flags, port, log_dir / f"server_{name}.log")
    rows = []
    try:
        for w in workloads:
            before = spec_counters(port)
            record = bench_serving.main(workload_argv(w, port, seed))
            after = spec_counters(port)
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
            ver = delta["verifications"]
            rows.append({
                "variant": name, "flags": " ".join(flags), "workload": w,
                "output_throughput": record["output_throughput"],
                "median_tpot_ms": record["median_tpot_ms"], "median_itl_ms": record["median_itl_ms"],
                "p99_itl_ms": record["p99_itl_ms"], "median_ttft_ms": record["median_ttft_ms"],
                "spec_accept_length": (delta["accepted_tokens"] + ver) / ver if ver else None,
                "spec_accept_rate": delta["accepted_tokens"] / delta["draft_tokens"] if delta["draft_tokens"] else None,
                "itls": record["itls"],
            })
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


def engine_itl(flags: list[str], workload: str, seed: int) -> dict:
    """Median per-request ITL ((E2E - TTFT) / (output - 1)) of `Engine.generate`, one request at a time,
    on the workload's prompts, with the server's flags."""
    import numpy as np

    from jaxserve.config import ServerArgs
    from jaxserve.engine.engine import Engine

    args = ServerArgs.from_cli(flags)
    engine = Engine(args)
    bargs = bench_serving.parse_args(workload_argv(workload, 0, seed))
    rows = bench_serving.build_dataset(bargs, engine.tokenizer, np.random.default_rng(seed))
    engine.generate(rows[0].prompt, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})  # warm-up
    itls = []
    for row in rows:
        out = engine.generate(row.prompt, {"max_new_tokens": row.output_len, "temperature": 0, "ignore_eos": True})
        m = out["meta_info"]
        itls.append((m["e2e_latency"] - m["ttft"]) / max(1, m["completion_tokens"] - 1) * 1e3)
    return {"variant": "engine", "workload": workload, "median_tpot_ms": statistics.median(itls)}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = [r for r in results if r["variant"] != "engine"]
    workloads = list(dict.fromkeys(r["workload"] for r in served))
    variants = list(dict.fromkeys(r["variant"] for r in served))
    width = 0.8 / max(1, len(variants))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(workloads), 3.6))
    for i, v in enumerate(variants):
        tpot = [next((r["median_tpot_ms"] for r in served if r["variant"] == v and r["workload"] == w), 0) for w in workloads]
        ax.bar([k + i * width for k in range(len(workloads))], tpot, width, label=v)
    ax.set_xticks([k + width * (len(variants) - 1) / 2 for k in range(len(workloads))], workloads)
    ax.set_ylabel("median TPOT (ms)")
    ax.set_xlabel("workload (dataset:concurrency:prompts)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", required=True, help='NAME=FLAGS, e.g. "off=" "ngram=--speculative-algorithm NGRAM"')
    p.add_argument("--workloads", nargs="+", required=True, help="DATASET:CONCURRENCY:NUM_PROMPTS")
    p.add_argument("--server-flags", default="--max-total-tokens 16384 --log-level warning", help="flags of every server")
    p.add_argument("--engine-itl", default=None, help="also run this workload through Engine.generate in-process (after the servers)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--output-file", default=None, help="append one JSON line per (variant, workload), with each request's ITLs (s)")
    p.add_argument("--plot", default=None, help="write a PNG: median TPOT per workload, one bar per variant")
    args = p.parse_args(argv)
    base = shlex.split(args.server_flags)
    results = []
    for v in args.variants:
        name, _, flags = v.partition("=")
        results += run_variant(name, base + shlex.split(flags), args.workloads, args.seed, Path(args.log_dir))
    if args.engine_itl:
        results.append(engine_itl(base, args.engine_itl, args.seed))
    print("\n| variant | workload | output tok/s | median TPOT (ms) | median ITL (ms) | P99 ITL (ms) | P99 / median ITL | accept length | accept rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["variant"] == "engine":
            print(f"| Engine.generate | {r['workload']} | | {r['median_tpot_ms']:.1f} | | | | | |")
            continue
        ratio = r["p99_itl_ms"] / r["median_itl_ms"] if r["median_itl_ms"] else float("nan")
        acc = f"{r['spec_accept_length']:.2f}" if r["spec_accept_length"] else "-"
        rate = f"{r['spec_accept_rate']:.2f}" if r["spec_accept_rate"] is not None else "-"
        print(f"| {r['variant']} | {r['workload']} | {r['output_throughput']:.1f} | {r['median_tpot_ms']:.1f} | "
              f"{r['median_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} | {ratio:.2f} | {acc} | {rate} |")
    if args.plot:
        plot(results, args.plot)
    if args.output_file:
        with open(args.output_file, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
