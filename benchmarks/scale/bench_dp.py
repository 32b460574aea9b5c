"""Data parallelism through sglang-router against one worker: the same bench_serving workload, one invocation.

    python -m benchmarks.scale.bench_dp --port 32000 --server-args "--max-total-tokens 16384 --context-length 1024" \
        -- --dataset-name random --num-prompts 32 --random-input-len 256 --random-output-len 32 --max-concurrency 16

It starts `serve.py --dp-size 2` (the router on --port, the workers on the two ports after it, each
pinned to its share of the cores) and a second sglang-router in front of worker 0 alone, then runs
benchmarks/serving/bench_serving.py (the arguments after `--`) three times, flushing the prefix caches first:

- dp 1: worker 0 directly (one worker, no router);
- dp 1 + router: worker 0 through its own router (what the router adds);
- dp 2: both workers through the launcher's router (--router-policy, cache_aware by default).

It prints a table with each run's throughput and its ratio to dp 1, and appends bench_serving's
records (tagged dp1, dp1-router, dp2) to --output-file. Everything it started is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 900


def _wait_ready(proc: subprocess.Popen, log: Path, needle: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while needle not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"bench_dp: no {needle!r} (exit status {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(1)


def _router(worker_url: str, port: int, log) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", worker_url,
                             "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(port + 1),
                             "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/workers", timeout=2).json()["workers"][0]["is_healthy"]:
                return proc
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"bench_dp: the single-worker router did not start (exit status {proc.poll()})")
        time.sleep(0.5)


def _bench(url: str, tag: str, bench_args: list[str], output: Path) -> dict:
    argv = [sys.executable, "-m", "benchmarks.serving.bench_serving", "--backend", "jaxserve", "--base-url", url,
            "--flush-cache", "--disable-tqdm", "--tag", tag, "--output-file", str(output), *bench_args]
    print(f"bench_dp: {tag}: {shlex.join(argv[2:])}", flush=True)
    subprocess.run(argv, check=True, cwd=REPO)
    return json.loads(output.read_text().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=32000, help="the dp 2 router; workers on +1, +2; their metrics +3; "
                        "the single-worker router on +4 (its metrics +5)")
    parser.add_argument("--server-args", default="", help="serve.py flags for both workers (quoted)")
    parser.add_argument("--router-policy", default="cache_aware")
    parser.add_argument("--output-file", default=None, help="append the three bench_serving records (JSON lines)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: benchmarks.serving.bench_serving arguments")
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    workdir = Path(tempfile.mkdtemp(prefix="bench_dp_"))
    output = Path(args.output_file) if args.output_file else workdir / "records.jsonl"
    launcher_log = workdir / "launcher.log"
    with open(launcher_log, "w") as log, open(workdir / "router.log", "w") as router_log:
        launcher = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "serve.py"), *shlex.split(args.server_args), "--port", str(args.port),
             "--dp-size", "2", "--router-policy", args.router_policy, "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        router = None
        try:
            _wait_ready(launcher, launcher_log, "jaxserve ready")
            worker0 = f"http://127.0.0.1:{args.port + 1}"
            router = _router(worker0, args.port + 4, router_log)
            runs = [("dp1", worker0), ("dp1-router", f"http://127.0.0.1:{args.port + 4}"),
                    ("dp2", f"http://127.0.0.1:{args.port}")]
            records = {tag: _bench(url, tag, bench_args, output) for tag, url in runs}
        finally:
            if router is not None:
                router.terminate()
                router.wait(60)
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(120)
    base = records["dp1"]
    print("\n| run | requests ok | duration (s) | output tok/s | total tok/s | ratio (total) | mean TTFT (ms) | cache hit rate |")
    print("|---|---|---|---|---|---|---|---|")
    for tag, m in records.items():
        print(f"| {tag} | {m['completed']} | {m['duration']:.1f} | {m['output_throughput']:.1f} | "
              f"{m['total_throughput']:.1f} | {m['total_throughput'] / base['total_throughput']:.2f}x | "
              f"{m['mean_ttft_ms']:.0f} | {m['cache_hit_rate']:.1%} |")
    print(f"\nrecords: {output}; logs: {workdir}")


if __name__ == "__main__":
    main()
