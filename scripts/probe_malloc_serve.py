"""Probe: a server with glibc's defaults against one whose malloc keeps freed memory (no mmap, one arena,
no trim), both up at once: RSS after start-up and after traffic, and served throughput in ABBA rounds.

    python scripts/probe_malloc_serve.py --rounds 4 [--serve-args "--model-path ..."] [--soak-minutes 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
KEEP = ("import ctypes; l = ctypes.CDLL('libc.so.6'); "
        "assert l.mallopt(-8, 1) and l.mallopt(-4, 0) and l.mallopt(-1, 2**31 - 1); ")
LAUNCH = "import runpy, sys; sys.argv = ['serve.py', *sys.argv[1:]]; runpy.run_path('scripts/serve.py', run_name='__main__')"


def vm(pid: int) -> dict:
    out = {}
    for line in open(f"/proc/{pid}/status"):
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(line.split()[1]) // 1024
    return out


def start(mode: str, port: int, serve_args: str, log: Path, by_server: bool):
    """by_server: the server sets malloc itself (D-45), and "off" opts out through GLIBC_TUNABLES."""
    env = dict(os.environ)
    if by_server:
        code = LAUNCH
        if mode == "off":
            env["GLIBC_TUNABLES"] = "glibc.malloc.check=0"
    else:
        code = (KEEP if mode == "keep" else "") + LAUNCH
    cmd = [sys.executable, "-c", code, "--port", str(port), *shlex.split(serve_args)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def wait_ready(log: Path, proc, timeout: float = 1500) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if "jaxserve ready" in log.read_text():
            return
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        time.sleep(1)
    raise TimeoutError(log)


def bench(port: int, bench_args: str, seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.serving.bench_serving", *shlex.split(bench_args), "--port", str(port),
           "--seed", str(seed), "--output-file", str(out), "--disable-tqdm"]
    if out.exists():
        out.unlink()
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(out.read_text().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--bench-args", action="append", help="bench_serving's flags, once per workload"
                    " (default: --case random-c8)")
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--soak-minutes", type=float, default=0)
    ap.add_argument("--logprob-prompts", type=int, default=0,
                    help="then this many ~2,000-token prompts asking for prompt top-5 logprobs (a large transient)")
    ap.add_argument("--dir", default="/tmp/malloc")
    ap.add_argument("--by-server", action="store_true", help="the server's own setting (D-45) against an opt-out")
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(exist_ok=True)
    print(f"uptime: {os.popen('uptime').read().strip()}", flush=True)
    modes = {"off": 30111, "keep": 30112}
    procs = {}
    try:
        for mode, port in modes.items():
            procs[mode] = start(mode, port, args.serve_args, d / f"serve-{mode}.log", args.by_server)
            wait_ready(d / f"serve-{mode}.log", procs[mode])
            time.sleep(2)
            print(f"{mode}: ready, {vm(procs[mode].pid)}", flush=True)
        workloads = args.bench_args or ["--case random-c8"]
        tok = {(m, w): [] for m in modes for w in range(len(workloads))}
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(modes)[::-1]
            for w, bench_args in enumerate(workloads):
                for mode in order:
                    res = bench(modes[mode], bench_args, 100 + r, d / f"bench-{mode}.jsonl")
                    tok[mode, w].append(res["output_throughput"])
                    print(f"round {r} workload {w} {mode}: output tok/s {res['output_throughput']:.1f}, mean TPOT "
                          f"{res.get('mean_tpot_ms', float('nan')):.2f} ms; {vm(procs[mode].pid)}", flush=True)
        for w, bench_args in enumerate(workloads):
            ratios = [k / o for k, o in zip(tok["keep", w], tok["off", w])]
            print(f"keep / off output tok/s per round, {bench_args}: " + " ".join(f"{x:.3f}" for x in ratios), flush=True)
        for mode, port in modes.items():
            for i in range(args.logprob_prompts):
                text = " ".join(f"word{(i * 7919 + j) % 5000}" for j in range(1000))
                body = {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5}
                r = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=600)
                r.raise_for_status()
            if args.logprob_prompts:
                print(f"{mode}: after {args.logprob_prompts} prompt-logprob requests, {vm(procs[mode].pid)}", flush=True)
        if args.soak_minutes:
            for mode, port in modes.items():
                subprocess.run([sys.executable, "-m", "benchmarks.serving.soak", "--minutes", str(args.soak_minutes),
                                "--url", f"http://127.0.0.1:{port}", "--pid", str(procs[mode].pid),
                                "--sample-s", "30"], cwd=REPO, capture_output=True, text=True)
                print(f"{mode}: after a {args.soak_minutes}-minute soak, {vm(procs[mode].pid)}", flush=True)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(60)
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
