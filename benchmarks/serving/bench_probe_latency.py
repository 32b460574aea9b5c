"""How long /health and /get_load take while the engine runs long steps (D-44).

Starts `scripts/serve.py` (default model unless `--server-flags` says otherwise, with
`--gc-warning-threshold-secs` so the log counts long garbage collections), then runs one load: `--long`
streamed requests with `--long-words`-word prompts (each a long prefill step) among `--short` streamed
short ones, while two probes poll /health and /get_load every `--probe-interval` seconds. It reports
each probe's latency (p50, p99, max, how many over 100 ms) against the longest step of the load: the
longest gap between two streamed chunks of any request, which a long prefill step opens in every
running decode. A ratio of max probe latency to longest step well under 1 says the probes did not
wait for the step.

    python -m benchmarks.serving.bench_probe_latency --case long-steps
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.cases import with_case
from benchmarks.serving.bench_decode_latency import free_port, start_server

CASES = Path(__file__).resolve().parent / "cases"
WORDS = ("sea", "ship", "storm", "wind", "island", "harbor", "sail", "tide", "reef", "gull")


def prompt(i: int, num_words: int) -> str:
    rng = random.Random(i)
    return f"Story {i}: " + " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 999)}" for _ in range(num_words))


async def stream(client: httpx.AsyncClient, url: str, text: str, max_new_tokens: int) -> list[float]:
    """POST /generate streamed; returns the gaps (s) between its chunks."""
    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.8, "ignore_eos": True}}
    gaps, last = [], None
    async with client.stream("POST", url + "/generate", json=body, timeout=1800) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


async def probe(client: httpx.AsyncClient, url: str, interval: float, out: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        r = await client.get(url, timeout=60)
        r.raise_for_status()
        out.append(time.perf_counter() - t)
        await asyncio.sleep(interval)


def summary(latencies: list[float]) -> dict:
    xs = sorted(latencies)
    return {"n": len(xs), "p50_ms": round(1e3 * statistics.median(xs), 1),
            "p99_ms": round(1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], 1),
            "max_ms": round(1e3 * xs[-1], 1), "over_100ms": sum(x > 0.1 for x in xs)}


async def run_load(url: str, args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.long + args.short + 4)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as load, httpx.AsyncClient(trust_env=False) as probes:
        stop = asyncio.Event()
        health, get_load = [], []
        probe_tasks = [asyncio.create_task(probe(probes, url + "/health", args.probe_interval, health, stop)),
                       asyncio.create_task(probe(probes, url + "/get_load", args.probe_interval, get_load, stop))]
        jobs = [stream(load, url, prompt(i, args.long_words), args.max_new_tokens) for i in range(args.long)]
        jobs += [stream(load, url, prompt(args.long + i, 20), args.max_new_tokens) for i in range(args.short)]
        started = time.perf_counter()
        gaps = await asyncio.gather(*jobs)
        wall = time.perf_counter() - started
        stop.set()
        await asyncio.gather(*probe_tasks)
    longest_step = max(g for request in gaps for g in request)
    health_s, load_s = summary(health), summary(get_load)
    return {"health": health_s, "get_load": load_s, "longest_step_ms": round(1e3 * longest_step, 1),
            "max_probe_over_longest_step": round(max(health_s["max_ms"], load_s["max_ms"]) / (1e3 * longest_step), 3),
            "wall_s": round(wall, 1)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server-flags", default="", help="flags for scripts/serve.py (one string)")
    p.add_argument("--long", type=int, default=4, help="requests with long prompts")
    p.add_argument("--long-words", type=int, default=2000, help="words of each long prompt")
    p.add_argument("--short", type=int, default=28, help="requests with 20-word prompts")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--probe-interval", type=float, default=0.05, help="seconds between a probe's requests")
    p.add_argument("--gc-warning-threshold-secs", type=float, default=0.05,
                   help="the server's flag: collections longer than this are counted from its log")
    p.add_argument("--log-dir", default="/tmp/bench_probe_latency")
    p.add_argument("--output-file", help="append the result as a JSON line")
    return p


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(with_case(p, argv, CASES, "benchmarks.serving.bench_probe_latency"))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    port, log_path = free_port(), log_dir / "server.log"
    flags = [*args.server_flags.split(), "--gc-warning-threshold-secs", str(args.gc_warning_threshold_secs)]
    proc = start_server(flags, port, log_path)
    try:
        result = asyncio.run(run_load(f"http://127.0.0.1:{port}", args))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log = log_path.read_text()
    served = log.split("jaxserve ready:", 1)[-1]  # start-up's own collections come before the freeze
    result["long_gcs_during_load"] = len(re.findall(r"long garbage collection", served))
    result["frozen_at_start_up"] = int(m.group(1)) if (m := re.search(r"server start-up: froze (\d+) objects", log)) else 0
    result["server_flags"] = args.server_flags
    print(json.dumps(result, indent=1))
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
