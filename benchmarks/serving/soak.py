"""Soak test: mixed traffic against a jaxserve server for a while, watching memory and the KV pool.

    python -m benchmarks.serving.soak --minutes 30                      # starts scripts/serve.py (default model) itself
    python -m benchmarks.serving.soak --minutes 30 --url http://127.0.0.1:30000 --pid 12345   # a server already running
    python -m benchmarks.serving.soak --minutes 2 --serve-args "--max-total-tokens 8192" --out soak.json --plot soak.png

Traffic (each client picks one at random, with the weights of TRAFFIC): the native /generate API and
the OpenAI completions / chat APIs, streamed and not, structured outputs (regex, JSON schema), n > 1,
long prompts that take several prefill chunks, prompts sharing a few long prefixes, clients that
disconnect at a random moment (DISCONNECT_SHARE of the requests), aborts through /abort_request, and
/flush_cache whenever the server is idle. Loopback only: the URL must be 127.0.0.1 / localhost / ::1.
Bounded: at most --max-requests requests and --minutes of traffic.

Every --sample-s seconds (default 60) it records the server's RSS, free KV pages, cached pages,
the radix tree's node count, running and waiting requests, and the p50 / p99 latency of the requests
that finished in that interval. At the end it checks that:
  1. every request that was not disconnected on purpose got a well-formed response (a JSON body with
     the API's fields, or a stream of events ending in [DONE]), and none got a 5xx;
  2. once idle, the pool is back to its idle state: free + evictable == total (every used page belongs
     to the prefix cache, none is locked);
  3. RSS grew by under 5% from the sample at --warmup-minutes (default 5, or a sixth of a shorter run)
     to the end.
It prints a markdown table, writes the samples as JSON (--out) and a plot (--plot, needs matplotlib),
and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
DISCONNECT_SHARE = 0.2
RSS_GROWTH_LIMIT = 0.05
TRAFFIC = {  # kind -> weight
    "native": 3, "native_stream": 3, "completions": 2, "chat": 2, "chat_stream": 2, "structured": 2,
    "n_gt_1": 1, "long_prompt": 1, "shared_prefix": 3, "abort": 1,
}
PREFIXES = [
    "You are a careful assistant for a public library. Answer briefly and cite the shelf. " * 8,
    "System: the following is a conversation about cooking pasta, sauces and Italian regional food. " * 8,
    "Context: a user asks questions about the solar system, planets, moons and space missions. " * 8,
]
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


@dataclasses.dataclass
class Sample:
    minute: float
    rss_mb: float
    free_pages: int
    cached_pages: int
    radix_nodes: float
    running: int
    waiting: int
    p50_s: float | None
    p99_s: float | None
    num_finished: int


@dataclasses.dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    disconnected: int = 0
    aborted: int = 0
    rejected: int = 0  # 503 (queue full): well-formed, counted apart
    malformed: list[str] = dataclasses.field(default_factory=list)
    latencies: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (end time, seconds)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def _request(kind: str, rng: random.Random, rid: str) -> tuple[str, dict, bool]:
    """(path, JSON body, is_stream) for one request of `kind`."""
    max_new = rng.randint(4, 48)
    temp = rng.choice([0, 0.7, 1.0])
    if kind in ("native", "native_stream", "abort"):
        body = {"text": _text(rng, rng.randint(3, 40)), "rid": rid,
                "sampling_params": {"max_new_tokens": max_new if kind != "abort" else 400, "temperature": temp,
                                    "ignore_eos": kind == "abort"}}
        return "/generate", {**body, "stream": kind != "native"}, kind != "native"
    if kind == "completions":
        return "/v1/completions", {"prompt": _text(rng, rng.randint(3, 40)), "max_tokens": max_new, "temperature": temp}, False
    if kind in ("chat", "chat_stream"):
        body = {"messages": [{"role": "user", "content": _text(rng, rng.randint(3, 30))}], "max_tokens": max_new,
                "temperature": temp, "stream": kind == "chat_stream"}
        return "/v1/chat/completions", body, kind == "chat_stream"
    if kind == "structured":
        if rng.random() < 0.5:
            return "/generate", {"text": "A date: ", "sampling_params": {"regex": r"\d{4}-\d{2}-\d{2}", "max_new_tokens": 16}}, False
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
                  "required": ["name", "age"]}
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": "A person as JSON"}], "max_tokens": 64,
                                        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}, False
    if kind == "n_gt_1":
        return "/generate", {"text": _text(rng, 10), "sampling_params": {"max_new_tokens": max_new, "n": rng.randint(2, 4),
                                                                          "temperature": 0.8}}, False
    if kind == "long_prompt":  # several prefill chunks at the CPU default --chunked-prefill-size 512
        return "/generate", {"text": _text(rng, rng.randint(900, 1800)), "sampling_params": {"max_new_tokens": 8}}, False
    assert kind == "shared_prefix"
    stream = rng.random() < 0.5
    return "/generate", {"text": rng.choice(PREFIXES) + _text(rng, 8), "stream": stream,
                         "sampling_params": {"max_new_tokens": max_new, "temperature": temp}}, stream


def _check_json(path: str, body: object) -> str | None:
    """Why a non-streamed 200 body is malformed, or None."""
    items = body if isinstance(body, list) else [body]
    for item in items:
        if not isinstance(item, dict):
            return f"{path}: not an object"
        if path == "/generate":
            reason = (item.get("meta_info") or {}).get("finish_reason") or {}
            if not isinstance(item.get("text"), str) or reason.get("type") not in ("stop", "length", "abort"):
                return f"{path}: bad output {str(item)[:200]}"
        elif not item.get("choices") or "usage" not in item:
            return f"{path}: no choices/usage {str(item)[:200]}"
    return None


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, rid: str, tally: Tally) -> None:
    path, body, stream = _request(kind, rng, rid)
    disconnect = rng.random() < DISCONNECT_SHARE
    tally.sent += 1
    t0 = time.monotonic()
    try:
        if stream:
            cut_after = rng.randint(1, 6) if disconnect else None
            async with client.stream("POST", path, json=body) as r:
                if r.status_code == 503:
                    tally.rejected += 1
                    return
                if r.status_code != 200:
                    tally.malformed.append(f"{path}: status {r.status_code}")
                    return
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if kind == "abort" and len(events) == 2:
                            await client.post("/abort_request", json={"rid": rid})
                        if cut_after is not None and len(events) >= cut_after:
                            tally.disconnected += 1
                            return  # leaving the block closes the connection mid-stream
            if not events or events[-1] != "[DONE]":
                tally.malformed.append(f"{path} ({kind}): stream without [DONE] ({len(events)} events; {r.headers}; body {str(body)[:120]})")
                return
            for e in events[:-1]:
                parsed = json.loads(e)
                if "error" in parsed:
                    tally.malformed.append(f"{path}: stream error {parsed['error']}")
                    return
            if kind == "abort":
                tally.aborted += 1
        else:
            timeout = rng.uniform(0.05, 1.0) if disconnect else None
            try:
                r = await asyncio.wait_for(client.post(path, json=body), timeout)
            except asyncio.TimeoutError:
                tally.disconnected += 1
                return
            if r.status_code == 503:
                tally.rejected += 1
                return
            if r.status_code != 200:
                tally.malformed.append(f"{path}: status {r.status_code} {r.text[:200]}")
                return
            if (problem := _check_json(path, r.json())) is not None:
                tally.malformed.append(problem)
                return
        tally.ok += 1
        tally.latencies.append((time.monotonic(), time.monotonic() - t0))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        tally.malformed.append(f"{path}: {type(e).__name__}: {e}")


async def client_loop(client, rng, tally, stop_at, max_requests, counter) -> None:
    kinds, weights = list(TRAFFIC), list(TRAFFIC.values())
    while time.monotonic() < stop_at and counter[0] < max_requests:
        counter[0] += 1
        await one_request(client, rng.choices(kinds, weights)[0], rng, f"soak-{counter[0]}", tally)
        await asyncio.sleep(rng.uniform(0, 0.2))


async def server_state(client: httpx.AsyncClient) -> tuple[dict, float]:
    info = (await client.get("/get_server_info")).json()
    nodes = float("nan")
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("jaxserve_radix_cache_nodes_total"):
            nodes = float(line.split()[-1])
    return info, nodes


async def sampler(client, pid, tally, t_start, stop_at, every_s, samples: list[Sample]) -> None:
    last = time.monotonic()
    while True:
        await asyncio.sleep(max(0.0, min(every_s, stop_at - time.monotonic())))
        now = time.monotonic()
        info, nodes = await server_state(client)
        kv, page = info["kv_pool"], info["page_size"]
        window = sorted(s for end, s in tally.latencies if last <= end < now)
        q = statistics.quantiles(window, n=100, method="inclusive") if len(window) >= 2 else None
        samples.append(Sample(
            minute=round((now - t_start) / 60, 2), rss_mb=round(rss_mb(pid), 1),
            free_pages=(kv["total_tokens"] - kv["used_tokens"]) // page, cached_pages=kv["cached_tokens"] // page,
            radix_nodes=nodes, running=info["num_running_reqs"], waiting=info["num_waiting_reqs"],
            p50_s=round(q[49], 3) if q else None, p99_s=round(q[98], 3) if q else None, num_finished=len(window),
        ))
        print(f"[soak] {samples[-1]}", flush=True)
        last = now
        if now >= stop_at:
            return


async def flusher(client, stop_at) -> None:
    """/flush_cache whenever the server looks idle (a 400 while requests run is expected)."""
    while time.monotonic() < stop_at:
        await asyncio.sleep(7)
        info = (await client.get("/get_server_info")).json()
        if info["num_pending_reqs"] == 0:
            await client.post("/flush_cache")


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = (await client.get("/get_server_info")).json()
        if info["num_pending_reqs"] == 0 and info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
            return info
        if time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.5)


async def soak(url: str, pid: int, args) -> tuple[list[Sample], Tally, dict]:
    rng = random.Random(args.seed)
    tally = Tally()
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t_start = time.monotonic()
        stop_at = t_start + args.minutes * 60
        counter = [0]
        workers = [client_loop(client, random.Random(rng.random()), tally, stop_at, args.max_requests, counter)
                   for _ in range(args.clients)]
        await asyncio.gather(sampler(client, pid, tally, t_start, stop_at, args.sample_s, samples),
                             flusher(client, stop_at), *workers)
        idle = await wait_idle(client)
        await asyncio.sleep(1.5)  # the engine publishes its load after its last step
        idle = (await client.get("/get_server_info")).json()
    return samples, tally, idle


def checks(samples: list[Sample], tally: Tally, idle: dict, warmup_minutes: float) -> list[tuple[str, bool, str]]:
    kv = idle["kv_pool"]
    evictable = kv["cached_tokens"] - kv["locked_tokens"]
    free = kv["total_tokens"] - kv["used_tokens"]
    base = next((s for s in samples if s.minute >= warmup_minutes), samples[0])
    growth = samples[-1].rss_mb / base.rss_mb - 1
    return [
        ("every request got a well-formed response", not tally.malformed,
         f"{tally.ok} ok, {tally.disconnected} disconnected on purpose, {tally.rejected} rejected (503), "
         f"{len(tally.malformed)} malformed" + (f": {tally.malformed[:3]}" if tally.malformed else "")),
        ("the pool returns to idle (free + evictable == total)", free + evictable == kv["total_tokens"] and kv["locked_tokens"] == 0,
         f"free {free} + evictable {evictable} vs total {kv['total_tokens']} tokens, locked {kv['locked_tokens']}"),
        (f"RSS grew < {RSS_GROWTH_LIMIT:.0%} after minute {base.minute:g}", growth < RSS_GROWTH_LIMIT,
         f"{base.rss_mb:.0f} MB -> {samples[-1].rss_mb:.0f} MB ({growth:+.1%})"),
    ]


def markdown_table(samples: list[Sample]) -> str:
    head = "| minute | RSS (MB) | free pages | cached pages | radix nodes | running | waiting | p50 (s) | p99 (s) | finished |"
    rows = [head, "|" + "---|" * 10]
    for s in samples:
        rows.append(f"| {s.minute:g} | {s.rss_mb:.0f} | {s.free_pages} | {s.cached_pages} | {s.radix_nodes:g} | {s.running} | "
                    f"{s.waiting} | {s.p50_s if s.p50_s is not None else '-'} | {s.p99_s if s.p99_s is not None else '-'} | {s.num_finished} |")
    return "\n".join(rows)


def plot(samples: list[Sample], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.minute for s in samples]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    axes[0].plot(minutes, [s.rss_mb for s in samples], marker="o")
    axes[0].set(title="server RSS (MB)", xlabel="minute")
    axes[1].plot(minutes, [s.free_pages for s in samples], marker="o", label="free pages")
    axes[1].plot(minutes, [s.cached_pages for s in samples], marker="o", label="cached pages")
    axes[1].set(title="KV pool", xlabel="minute")
    axes[1].legend()
    axes[2].plot(minutes, [s.p50_s for s in samples], marker="o", label="p50")
    axes[2].plot(minutes, [s.p99_s for s in samples], marker="o", label="p99")
    axes[2].set(title="request latency (s)", xlabel="minute")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def start_server(serve_args: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "scripts" / "serve.py"), "--host", "127.0.0.1", "--port", str(port), *shlex.split(serve_args)]
    return subprocess.Popen(cmd, cwd=str(REPO))


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float = 1800) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"soak: the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("soak: the server did not become healthy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--url", help="a running server on loopback (default: start scripts/serve.py on a free port)")
    parser.add_argument("--pid", type=int, help="the running server's process id (for RSS; with --url)")
    parser.add_argument("--serve-args", default="", help="flags for the server this script starts")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests")
    parser.add_argument("--sample-s", type=float, default=60, help="seconds between samples")
    parser.add_argument("--warmup-minutes", type=float, default=None, help="RSS baseline (default: 5, or a sixth of a shorter run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the samples and checks as JSON here")
    parser.add_argument("--plot", help="write a PNG plot here (matplotlib)")
    args = parser.parse_args(argv)
    proc = None
    if args.url:
        if urlparse(args.url).hostname not in LOOPBACK:
            parser.error("--url must be on loopback (127.0.0.1, localhost, ::1)")
        if args.pid is None:
            parser.error("--pid is required with --url (the RSS is read from /proc/PID)")
        url, pid = args.url.rstrip("/"), args.pid
    else:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = start_server(args.serve_args, port)
        url, pid = f"http://127.0.0.1:{port}", proc.pid
    try:
        wait_healthy(url, proc)
        samples, tally, idle = asyncio.run(soak(url, pid, args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    warmup = args.warmup_minutes if args.warmup_minutes is not None else min(5.0, args.minutes / 6)
    results = checks(samples, tally, idle, warmup)
    print(markdown_table(samples))
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}: {name}: {detail}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "args": vars(args), "samples": [dataclasses.asdict(s) for s in samples],
            "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in results],
            "requests": {"sent": tally.sent, "ok": tally.ok, "disconnected": tally.disconnected, "rejected": tally.rejected,
                         "aborted": tally.aborted, "malformed": tally.malformed[:50]},
        }, indent=1))
    if args.plot:
        plot(samples, args.plot)
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
