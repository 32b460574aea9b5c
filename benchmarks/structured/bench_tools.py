"""Tool calling cost: tool_choice "required" (decoding constrained to a call) against the same requests
unconstrained, through the HTTP server, and the share of forced calls whose arguments validate.

N chat prompts over four tools run twice against one server: once with tool_choice "required" (the
grammar of the --tool-call-parser format, each function's JSON schema inside), once with tool_choice
"auto" (the same prompt, tools rendered the same way, no grammar). Fairness as in bench_structured.py:
the unconstrained twin runs with ignore_eos and max_tokens set to the completion tokens of its
constrained twin, so both passes emit the same number of tokens and the latency ratio is what the
grammar costs (mask work) and saves (jump-forward). The prefix cache is flushed before each pass;
one warm-up request per pass compiles what it needs. Greedy, so both passes are repeatable.

    python -m benchmarks.structured.bench_tools --num-prompts 32 --max-concurrency 8

Without --base-url the script starts `scripts/serve.py` (default model) itself on a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a time zone",
     "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount between currencies",
     "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
                    "required": ["amount", "from", "to"]}}},
    {"type": "function", "function": {"name": "search_flights", "description": "Find flights between two cities on a date",
     "parameters": {"type": "object", "properties": {"origin": {"type": "string"}, "destination": {"type": "string"},
                    "date": {"type": "string"}, "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["origin", "destination", "date", "passengers"]}}},
]
CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Sydney", "Toronto", "Mumbai")
TEMPLATES = (
    "What is the weather like in {c} today?",
    "What time is it in {c} right now?",
    "How much is 250 US dollars in the currency of {c}?",
    "Find me a flight from London to {c} next Friday for two people.",
)


@dataclasses.dataclass
class Result:
    latency_s: float
    completion_tokens: int
    finish_reason: str
    calls: list


def prompts(n: int) -> list[str]:
    return [TEMPLATES[i % len(TEMPLATES)].format(c=CITIES[(i // len(TEMPLATES)) % len(CITIES)]) for i in range(n)]


async def one(client: httpx.AsyncClient, model: str, question: str, body: dict) -> Result:
    payload = {"model": model, "messages": [{"role": "user", "content": question}], "tools": TOOLS,
               "temperature": 0, **body}
    t0 = time.perf_counter()
    r = await client.post("/v1/chat/completions", json=payload)
    latency = time.perf_counter() - t0
    r.raise_for_status()
    data = r.json()
    choice = data["choices"][0]
    return Result(latency, data["usage"]["completion_tokens"], choice["finish_reason"], choice["message"].get("tool_calls") or [])


async def run_pass(client, model, questions, bodies, concurrency) -> tuple[list[Result], float]:
    await client.post("/flush_cache")
    await one(client, model, "Warm up.", bodies[0])
    await client.post("/flush_cache")
    sem = asyncio.Semaphore(concurrency)

    async def limited(q, b):
        async with sem:
            return await one(client, model, q, b)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(limited(q, b) for q, b in zip(questions, bodies)))
    return list(results), time.perf_counter() - t0


def valid(call: dict) -> bool:
    tool = next((t for t in TOOLS if t["function"]["name"] == call["function"]["name"]), None)
    if tool is None:
        return False
    try:
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    except (jsonschema.ValidationError, json.JSONDecodeError):
        return False
    return True


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = Path(__file__).resolve().parents[2] / "scripts" / "serve.py"
    proc = subprocess.Popen([sys.executable, str(serve), *flags, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("the server did not start")


async def main_async(args) -> None:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        questions = prompts(args.num_prompts)
        forced, t_forced = await run_pass(client, model, questions, [{"tool_choice": "required", "max_tokens": args.max_tokens}] * len(questions),
                                          args.max_concurrency)
        twins = [{"tool_choice": "auto", "ignore_eos": True, "max_tokens": max(1, r.completion_tokens)} for r in forced]
        free, t_free = await run_pass(client, model, questions, twins, args.max_concurrency)
    calls = [c for r in forced for c in r.calls]
    num_valid = sum(1 for r in forced if len(r.calls) == 1 and valid(r.calls[0]) and r.finish_reason == "tool_calls")
    rows = []
    for name, results, wall in (("unconstrained (tool_choice auto, ignore_eos, lengths matched)", free, t_free),
                                ('tool_choice "required"', forced, t_forced)):
        lat = [r.latency_s for r in results]
        tokens = sum(r.completion_tokens for r in results)
        rows.append((name, tokens, statistics.mean(lat), statistics.median(lat), wall, tokens / wall))
    print(f"{args.num_prompts} prompts, concurrency {args.max_concurrency}, model {model}")
    print(f"forced calls: {len(calls)} calls in {len(forced)} replies; valid (one call, arguments validate, finish_reason "
          f"tool_calls): {num_valid}/{len(forced)} = {100 * num_valid / len(forced):.1f}%")
    print("| pass | output tokens | mean latency (s) | median latency (s) | wall (s) | output tokens/s |")
    print("|---|---|---|---|---|---|")
    for name, tokens, mean, median, wall, tps in rows:
        print(f"| {name} | {tokens} | {mean:.2f} | {median:.2f} | {wall:.1f} | {tps:.1f} |")
    print(f"| ratio (required / unconstrained) | | {rows[1][2] / rows[0][2]:.2f}x | {rows[1][3] / rows[0][3]:.2f}x | "
          f"{rows[1][4] / rows[0][4]:.2f}x | {rows[1][5] / rows[0][5]:.2f}x |")
    if num_valid != len(forced):
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server (default: start scripts/serve.py)")
    parser.add_argument("--server-flags", default="--max-total-tokens 16384 --max-running-requests 16",
                        help="flags for the server this script starts")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256, help="cap on a forced call's tokens")
    args = parser.parse_args()
    proc = None
    if args.base_url is None:
        proc, args.base_url = start_server(args.server_flags.split())
    try:
        asyncio.run(main_async(args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
