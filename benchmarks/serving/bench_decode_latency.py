"""Decode latency, served: servers with different flags in turn, each measured by bench_serving.py.

Served decode latency of server variants in one invocation: (1) ITL at 8 concurrent requests with prefill chunks
bounded or not, (2) n-gram speculation on against off on the copy-heavy and random workloads at 1
and 8 concurrent requests, (3) the server's TPOT at one request against `Engine.generate`'s ITL on
the same prompts, in-process (`--engine-itl`; with `--engine-itl-per-variant` once per variant, with
that variant's flags, right after its server stopped, and a served / in-process ratio per variant).
Each variant is one server (`scripts/serve.py`, started and stopped here); its workloads run one after
the other against it.

    python -m benchmarks.serving.bench_decode_latency --variants "off=" "ngram=--speculative-algorithm NGRAM" \
        --workloads copy-heavy:1:6 --engine-itl copy-heavy:1:6 --engine-itl-per-variant

`--paired WORKLOAD` measures (3) request by request instead: each prompt served, then through
`Engine.generate` in this process, with both resident (`paired_overhead`), so a shared machine's
drift between runs does not enter the ratio:

    python -m benchmarks.serving.bench_decode_latency --variants "off=" "ngram=--speculative-algorithm NGRAM" \
        --paired copy-heavy:1:6 --paired-rounds 3

    python -m benchmarks.serving.bench_decode_latency --variants "off=" "ngram=--speculative-algorithm NGRAM" \
        --workloads copy-heavy:1:6 copy-heavy:8:16 --output-file spec.jsonl

`--interleaved` measures (1) with every server up at once and the workloads run in rounds, the
servers taking turns (ABBA) on the same new prompts each round (`interleaved`), so that the machine's
drift between servers started minutes apart does not enter the comparison:

    python -m benchmarks.serving.bench_decode_latency --interleaved --rounds 6 \
        --variants "default=" "unbounded=--prefill-decode-itl-ratio 0" --workloads random:8:24 copy-heavy:8:16

A workload is DATASET:CONCURRENCY:NUM_PROMPTS (random: 128 in / 64 out; shared-prefix: groups of 8
sharing a 512-token system prompt, 64-token questions, 32 out; copy-heavy: 6 sentences,
128 out). Acceptance comes from the server's `jaxserve_spec_*_total` counters, before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx

from benchmarks.cases import with_case
from benchmarks.serving import bench_serving

SERVE = Path(__file__).resolve().parents[2] / "scripts" / "serve.py"

DATASET_ARGS = {
    "random": ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64"],
    "copy-heavy": ["--dataset-name", "copy-heavy", "--copy-num-sentences", "6", "--copy-output-len", "128"],
    # NUM_PROMPTS in groups of SHARED_PREFIX_GROUP that share a 512-token system prompt
    "shared-prefix": ["--dataset-name", "generated-shared-prefix", "--gsp-system-prompt-len", "512",
                      "--gsp-question-len", "64", "--gsp-output-len", "32"],
}
SHARED_PREFIX_GROUP = 8
SPEC_COUNTERS = ("verifications", "draft_tokens", "accepted_tokens")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], port: int, log_path: Path, pythonpath: str | None = None) -> subprocess.Popen:
    """`scripts/serve.py` on `port` with `flags`, once healthy; `pythonpath`: the server's PYTHONPATH (the
    jaxserve it imports: another checkout's code), else this process's environment."""
    log = open(log_path, "w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    proc = subprocess.Popen([sys.executable, str(SERVE), "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    return wait_healthy(proc, port, log_path, timeout_s=900, what="server")


def peak_rss_mib(pid: int) -> float | None:
    """The process's peak resident set (VmHWM, MiB), None where /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


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


def workload_argv(workload: str, port: int, seed: int, backend: str = "jaxserve") -> list[str]:
    dataset, concurrency, num = workload.split(":")
    groups = (["--gsp-num-groups", str(max(1, int(num) // SHARED_PREFIX_GROUP)), "--gsp-prompts-per-group",
               str(SHARED_PREFIX_GROUP)] if dataset == "shared-prefix" else [])
    return [
        "--backend", backend, "--port", str(port), *DATASET_ARGS[dataset], *groups, "--num-prompts", num,
        "--max-concurrency", concurrency, "--seed", str(seed), "--disable-tqdm",
    ]


def request_tpots_ms(record: dict) -> list[float]:
    """Each request's TPOT in ms ((E2E - TTFT) / (output - 1), bench_serving's definition), in row order."""
    return [(e - t) / (n - 1) * 1e3 for e, t, n in zip(record["e2e_latencies"], record["ttfts"], record["output_lens"])
            if n > 1]


def measure_workload(name: str, flags: list[str], workload: str, port: int, seed: int, backend: str = "jaxserve",
                     extra_argv: tuple[str, ...] = ()) -> dict:
    """One bench_serving run of `workload` against the server on `port`: its throughput, TPOT, ITL and TTFT
    figures, each request's ITLs (s) and TPOT (ms), the run's duration (s) and total output tokens, and
    the speculative acceptance from the server's counters before and after."""
    before = spec_counters(port)
    record = bench_serving.main(workload_argv(workload, port, seed, backend) + list(extra_argv))
    after = spec_counters(port)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
    ver = delta["verifications"]
    return {
        "variant": name, "flags": " ".join(flags), "workload": workload, "seed": seed,
        "output_throughput": record["output_throughput"],
        "duration_s": record["duration"], "total_output_tokens": record["total_output_tokens"],
        "median_tpot_ms": record["median_tpot_ms"], "median_itl_ms": record["median_itl_ms"],
        "p99_itl_ms": record["p99_itl_ms"], "median_ttft_ms": record["median_ttft_ms"],
        "spec_accept_length": (delta["accepted_tokens"] + ver) / ver if ver else None,
        "spec_accept_rate": delta["accepted_tokens"] / delta["draft_tokens"] if delta["draft_tokens"] else None,
        "itls": record["itls"],
        "tpots_ms": request_tpots_ms(record),
    }


def run_variant(name: str, flags: list[str], workloads: list[str], seed: int, log_dir: Path,
                backend: str = "jaxserve", port: int | None = None, pythonpath: str | None = None) -> list[dict]:
    port = port or free_port()
    started = time.monotonic()
    proc = start_server(flags, port, log_dir / f"server_{name}.log", pythonpath)
    startup_s = time.monotonic() - started
    rows = []
    try:
        for w in workloads:
            rows.append({**measure_workload(name, flags, w, port, seed, backend),
                         "pythonpath": pythonpath, "startup_s": startup_s})
        rss = peak_rss_mib(proc.pid)
        for r in rows:
            r["server_peak_rss_mib"] = rss
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


class Target(NamedTuple):
    """A running server that `run_rounds` measures: its name in the rows, the flags it was started with
    (for the rows), its port and its start-up seconds."""

    name: str
    flags: list[str]
    port: int
    startup_s: float


def run_rounds(targets: list[Target], workloads: list[str], rounds: int, settle_rounds: int, seed: int,
               backend: str = "jaxserve", extra_argv: tuple[str, ...] = ()) -> list[dict]:
    """The workloads in rounds over servers that are all up: round r (from -settle_rounds; rounds below 0
    settle the machine and are not counted) runs each workload on every target with seed `seed + r +
    settle_rounds`, so all targets get the same prompts within a round and new ones in each round; the
    targets take turns in ABBA order (the order reversed every other round), so that a drift of the
    machine's speed within the invocation falls on every target alike and the runs compared sit seconds
    apart instead of one server's lifetime. Returns one row per (round, workload, target):
    `measure_workload`'s plus `round` and the target's start-up seconds. Servers measured one after the
    other each met a different machine (two servers of the same code differed by up to 9%)."""
    rows: list[dict] = []
    for r in range(-settle_rounds, rounds):
        order = targets if (r + settle_rounds) % 2 == 0 else targets[::-1]
        for w in workloads:
            for t in order:
                row = measure_workload(t.name, t.flags, w, t.port, seed + r + settle_rounds, backend, extra_argv)
                rows.append({**row, "round": r, "startup_s": t.startup_s})
                print(f"round {r} {w} {t.name}: {row['output_throughput']:.1f} tok/s, median TPOT "
                      f"{row['median_tpot_ms']:.2f} ms, P99/median ITL {row['p99_itl_ms'] / row['median_itl_ms']:.2f}",
                      flush=True)
    return rows


def interleaved(variants: list[tuple[str, list[str]]], workloads: list[str], rounds: int, settle_rounds: int, seed: int,
                log_dir: Path, backend: str = "jaxserve", port_base: int | None = None,
                pythonpaths: dict[str, str] | None = None) -> list[dict]:
    """Every variant's server started (one after the other) and kept up, then `run_rounds` over them;
    each run flushes its server's prefix cache after bench_serving's warm-up request (--flush-cache; the
    native backend only, bench_serving's OpenAI backends do not flush), so no round finds an earlier
    round's prompts cached. Rows as `run_rounds`'s, with
    the server's PYTHONPATH (`--variant-pythonpath`)."""
    pythonpaths = pythonpaths or {}
    procs, targets = [], []
    try:
        for i, (name, flags) in enumerate(variants):
            port = port_base + i if port_base is not None else free_port()
            started = time.monotonic()
            procs.append(start_server(flags, port, log_dir / f"server_{name}.log", pythonpaths.get(name)))
            targets.append(Target(name, flags, port, time.monotonic() - started))
        rows = run_rounds(targets, workloads, rounds, settle_rounds, seed, backend, ("--flush-cache",))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
    return [{**r, "pythonpath": pythonpaths.get(r["variant"])} for r in rows]


def print_interleaved(rows: list[dict], baseline: str, ratio_bound: float = 3.0, loss_bound: float = 0.05) -> None:
    """The counted rounds (round >= 0) of `interleaved`, per workload and variant: ITLs pooled over all
    rounds (median, P99, P99 / median), output tok/s over all rounds (tokens / seconds), and each round's
    tok/s against `baseline`'s run in the same round (mean, min, max of the per-round changes); the last
    column counts the rounds that met the ITL goal on their own (P99 <= `ratio_bound` x median ITL
    and at most `loss_bound` of the baseline's tok/s lost)."""
    import numpy as np

    counted = [r for r in rows if r["round"] >= 0]
    print("\n| workload | variant | rounds | output tok/s (pooled) | vs baseline: mean / min / max per round | "
          "median ITL (ms) | P99 ITL (ms) | P99 / median (pooled) | rounds meeting the goal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w in dict.fromkeys(r["workload"] for r in counted):
        base = {r["round"]: r for r in counted if r["workload"] == w and r["variant"] == baseline}
        for v in dict.fromkeys(r["variant"] for r in counted):
            mine = [r for r in counted if r["workload"] == w and r["variant"] == v]
            itls = np.asarray([g for r in mine for req in r["itls"] for g in req]) * 1e3
            med, p99 = float(np.median(itls)), float(np.percentile(itls, 99))
            tok_s = sum(r["total_output_tokens"] for r in mine) / sum(r["duration_s"] for r in mine)
            paired = [(r, r["output_throughput"] / base[r["round"]]["output_throughput"] - 1) for r in mine if r["round"] in base]
            changes = [c for _, c in paired]
            met = sum(1 for r, c in paired if r["p99_itl_ms"] <= ratio_bound * r["median_itl_ms"] and c >= -loss_bound)
            vs = (f"{100 * statistics.mean(changes):+.1f}% / {100 * min(changes):+.1f}% / {100 * max(changes):+.1f}%"
                  if v != baseline else "(baseline)")
            print(f"| {w} | {v} | {len(mine)} | {tok_s:.1f} | {vs} | {med:.1f} | {p99:.1f} | {p99 / med:.2f} | "
                  f"{met if v != baseline else '-'} of {len(mine)} |")


def engine_itl(flags: list[str], workload: str, seed: int, variant: str = "engine") -> dict:
    """Median per-request ITL ((E2E - TTFT) / (output - 1), in ms: bench_serving's TPOT) of
    `Engine.generate`, one request at a time, on the workload's prompts (the same warm-up request
    first, as bench_serving sends), with the server's flags. The engine is dropped before returning."""
    import gc

    import numpy as np

    from jaxserve.engine.engine import Engine
    from jaxserve.server_args import ServerArgs

    args = ServerArgs.from_cli(flags)
    engine = Engine(args)
    bargs = bench_serving.parse_args(workload_argv(workload, 0, seed))
    rows = bench_serving.build_dataset(bargs, engine.tokenizer, np.random.default_rng(seed))
    engine.generate(rows[0].prompt, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})  # warm-up
    itls = []
    for row in rows:
        itls.append(in_process_tpot_ms(engine, row.prompt, row.output_len))
    del engine
    gc.collect()
    return {"variant": variant, "flags": " ".join(flags), "workload": workload,
            "median_tpot_ms": statistics.median(itls), "tpots_ms": itls}


def in_process_tpot_ms(engine, prompt, output_len: int) -> float:
    """One request through `engine` alone (greedy, `output_len` tokens): its TPOT in ms, from its finished
    output's own times (e2e latency - TTFT over the tokens after the first)."""
    (rid,) = engine.add_request(prompt, {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True})
    done = None
    while done is None:
        done = next((o for o in engine.step() if o.rid == rid and o.finished), None)
    m = done.meta
    return (m.e2e_latency - m.ttft) / max(1, m.completion_tokens - 1) * 1e3


def _is_engine(row: dict) -> bool:
    return row["variant"] == "engine" or row["variant"].startswith(("engine:", "paired:"))


def paired_overhead(name: str, flags: list[str], workload: str, seed: int, log_dir: Path, backend: str,
                    rounds: int) -> dict:
    """Served TPOT against `Engine.generate`'s on the same prompts, request by request: one server with
    `flags` and an `Engine` with the same flags in this process, both resident; each prompt goes to the
    server (one streamed request, timed as bench_serving times it), then through `Engine.generate`,
    then the next prompt, `rounds` times over the workload with both prefix caches flushed between
    rounds. Both sides see the same prompts in the same order (so the same cache and draft state) and
    the same machine state, within seconds of each other: a shared machine's drift between two
    invocations (~10% here) does not enter the ratio. Returns each request's TPOT (ms) on both sides."""
    import asyncio

    import numpy as np

    from jaxserve.engine.engine import Engine
    from jaxserve.server_args import ServerArgs

    port = free_port()
    proc = start_server(flags, port, log_dir / f"server_paired_{name}.log")
    served: list[float] = []
    inproc: list[float] = []
    try:
        engine = Engine(ServerArgs.from_cli(flags))
        bargs = bench_serving.parse_args(workload_argv(workload, port, seed, backend))
        rows = bench_serving.build_dataset(bargs, engine.tokenizer, np.random.default_rng(seed))
        base_url = f"http://127.0.0.1:{port}"
        model = (bench_serving.get_json(base_url, "/v1/models", None) or {}).get("data", [{}])[0].get("id")
        settings = bench_serving.RequestSettings(backend, base_url, model, None, True, False, {})

        def in_process(row) -> float:
            return in_process_tpot_ms(engine, row.prompt, row.output_len)

        async def run() -> None:
            async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=60), trust_env=False) as client:
                warm = bench_serving.DatasetRow(rows[0].prompt, rows[0].prompt_len, min(rows[0].output_len, 16))
                for r in range(rounds):
                    if r:
                        (await client.post(base_url + "/flush_cache")).raise_for_status()
                        engine.flush_cache()
                    await bench_serving.send_request(client, warm, settings, None)
                    in_process(warm)
                    for row in rows:
                        out = await bench_serving.send_request(client, row, settings, None)
                        if not out.success:
                            raise RuntimeError(f"a served request failed: {out.error}")
                        served.append((out.latency - out.ttft) / max(1, out.output_len - 1) * 1e3)
                        inproc.append(in_process(row))

        asyncio.run(run())
        engine = None  # the model's memory goes before the next variant's server starts
    finally:
        proc.terminate()
        proc.wait(60)
    return {"variant": f"paired:{name}", "flags": " ".join(flags), "workload": workload, "rounds": rounds,
            "served_tpots_ms": served, "engine_tpots_ms": inproc}


def print_paired(rows: list[dict]) -> None:
    """The paired runs: medians, the ratio of total decode time per token (sum over requests of
    TPOT x (tokens - 1) is dominated by the long requests alike on both sides) and the mean of the
    per-request ratios."""
    if not rows:
        return
    print("\n| variant | workload | requests | served median TPOT (ms) | Engine.generate median ITL (ms) | "
          "served / in-process, medians | mean of per-request ratios | min / max per-request ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s, e = r["served_tpots_ms"], r["engine_tpots_ms"]
        ratios = [a / b for a, b in zip(s, e)]
        print(f"| {r['variant'][len('paired:'):]} | {r['workload']} | {len(s)} | {statistics.median(s):.2f} | "
              f"{statistics.median(e):.2f} | {statistics.median(s) / statistics.median(e):.3f} | "
              f"{statistics.mean(ratios):.3f} | {min(ratios):.3f} / {max(ratios):.3f} |")


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = [r for r in results if not _is_engine(r)]
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


def print_overhead(results: list[dict]) -> None:
    """Served median TPOT over `Engine.generate`'s, per variant run in-process on the same workload, and
    the mean of the per-request ratios (the same prompts in the same order, one request at a time, so
    request i is the same prompt on both sides; the median of a few requests whose TPOTs differ 3x
    between prompts moves with whichever lands in the middle)."""
    pairs = []
    for e in results:
        if not e["variant"].startswith("engine:"):
            continue
        name = e["variant"][len("engine:"):]
        served = next((r for r in results if r["variant"] == name and r["workload"] == e["workload"]), None)
        if served is not None:
            paired = served.get("tpots_ms", [])
            per_request = [a / b for a, b in zip(paired, e["tpots_ms"])] if len(paired) == len(e["tpots_ms"]) else []
            pairs.append((name, e["workload"], served["median_tpot_ms"], e["median_tpot_ms"],
                          statistics.mean(per_request) if per_request else float("nan")))
    if not pairs:
        return
    print("\n| variant | workload | served median TPOT (ms) | Engine.generate median ITL (ms) | served / in-process, "
          "medians | mean of per-request ratios |")
    print("|---|---|---|---|---|---|")
    for name, workload, served, inproc, paired in pairs:
        print(f"| {name} | {workload} | {served:.2f} | {inproc:.2f} | {served / inproc:.3f} | {paired:.3f} |")


# the modes that read each option; the others would ignore it, so it is refused there
_OPTION_MODES = {
    "paired_rounds": ("paired",),
    "rounds": ("interleaved",),
    "settle_rounds": ("interleaved",),
    "baseline": ("interleaved",),
    "engine_itl": ("sequential",),
    "engine_itl_per_variant": ("sequential",),
    "plot": ("sequential",),
    "variant_pythonpath": ("sequential", "interleaved"),
    "port_base": ("sequential", "interleaved"),
}


def _check_mode_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit (argparse's status 2) on a combination that would be silently ignored: --paired with
    --interleaved or with --workloads, no workload at all, or an option its mode does not read
    (`_OPTION_MODES`)."""
    if args.paired and args.interleaved:
        p.error("--paired and --interleaved are two ways to run: give one")
    if not args.paired and not args.workloads:
        p.error("give --workloads (or --paired)")
    if args.paired and args.workloads:
        p.error("--paired runs its own workload: --workloads would be ignored")
    mode = "paired" if args.paired else "interleaved" if args.interleaved else "sequential"
    for name, modes in _OPTION_MODES.items():
        if mode not in modes and getattr(args, name) != p.get_default(name):  # given (defaults: None, False, [])
            here = "without --paired or --interleaved" if mode == "sequential" else f"with --{mode}"
            p.error(f"--{name.replace('_', '-')} does nothing {here}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", required=True, help='NAME=FLAGS, e.g. "off=" "ngram=--speculative-algorithm NGRAM"')
    p.add_argument("--workloads", nargs="+", default=[], help="DATASET:CONCURRENCY:NUM_PROMPTS")
    p.add_argument("--server-flags", default="--max-total-tokens 16384 --log-level warning", help="flags of every server")
    p.add_argument("--engine-itl", default=None, help="also run this workload through Engine.generate in-process (after the servers)")
    p.add_argument("--backend", choices=["jaxserve", "openai", "openai-chat"], default="jaxserve",
                   help="bench_serving's backend for the served runs (jaxserve: /generate; openai: /v1/completions)")
    p.add_argument("--engine-itl-per-variant", action="store_true",
                   help="run --engine-itl once per variant with that variant's flags, after its server (default: once, "
                   "with --server-flags only, after all servers)")
    p.add_argument("--paired", default=None, metavar="WORKLOAD",
                   help="instead of the runs above: per variant, this workload's prompts alternately served and "
                   "through Engine.generate in this process, request by request (`paired_overhead`); "
                   "concurrency must be 1")
    p.add_argument("--paired-rounds", type=int, default=None, help="--paired: passes over the workload (default 2)")
    p.add_argument("--variant-pythonpath", nargs="+", default=[], metavar="NAME=DIR",
                   help="the server of variant NAME imports jaxserve from DIR (its PYTHONPATH): another checkout's "
                   "code, e.g. a candidate rule against this one in one invocation")
    p.add_argument("--port-base", type=int, default=None,
                   help="variant i's server listens on PORT_BASE + i (default: a free port each)")
    p.add_argument("--interleaved", action="store_true",
                   help="every variant's server up at once and the workloads run in rounds, the variants in ABBA "
                   "order, new prompts each round (`interleaved`); a table per workload against --baseline")
    p.add_argument("--rounds", type=int, default=None, help="--interleaved: counted rounds (default 6)")
    p.add_argument("--settle-rounds", type=int, default=None, help="--interleaved: rounds run first and not counted (default 1)")
    p.add_argument("--baseline", default=None, help="--interleaved: the variant the others' tok/s is compared with "
                   "(default: the last)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--output-file", default=None, help="append one JSON line per (variant, workload), with each request's ITLs (s)")
    p.add_argument("--plot", default=None, help="write a PNG: median TPOT per workload, one bar per variant")
    return p


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(with_case(p, argv, bench_serving.CASES, "benchmarks.serving.bench_decode_latency"))
    _check_mode_options(p, args)
    base = shlex.split(args.server_flags)
    results = []
    if args.paired:
        if args.paired.split(":")[1] != "1":
            p.error("--paired runs one request at a time: give DATASET:1:NUM_PROMPTS")
        sys.modules.setdefault("torch", None)  # as the server does (jaxserve/launch/__main__.py)
        for v in args.variants:
            name, _, flags = v.partition("=")
            results.append(paired_overhead(name, base + shlex.split(flags), args.paired, args.seed, Path(args.log_dir),
                                           args.backend, 2 if args.paired_rounds is None else args.paired_rounds))
        print_paired(results)
        if args.output_file:
            with open(args.output_file, "a") as f:
                for r in results:
                    f.write(json.dumps(r) + "\n")
        return
    pythonpaths = dict(v.partition("=")[::2] for v in args.variant_pythonpath)
    if args.interleaved:
        variants = [(name, base + shlex.split(flags)) for name, _, flags in (v.partition("=") for v in args.variants)]
        baseline = args.baseline or variants[-1][0]
        if baseline not in dict(variants):
            p.error(f"--baseline {baseline} is not one of the variants")
        rows = interleaved(variants, args.workloads, 6 if args.rounds is None else args.rounds,
                           1 if args.settle_rounds is None else args.settle_rounds, args.seed, Path(args.log_dir),
                           args.backend, args.port_base, pythonpaths)
        if args.output_file:
            with open(args.output_file, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
        print_interleaved(rows, baseline)
        return
    for i, v in enumerate(args.variants):
        name, _, flags = v.partition("=")
        port = args.port_base + i if args.port_base is not None else None
        rows = run_variant(name, base + shlex.split(flags), args.workloads, args.seed, Path(args.log_dir), args.backend,
                           port, pythonpaths.get(name))
        results += rows
        if args.output_file:  # each server's rows as soon as it is done: a run cut short keeps them
            with open(args.output_file, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
        if args.engine_itl and args.engine_itl_per_variant:
            results.append(engine_itl(base + shlex.split(flags), args.engine_itl, args.seed, f"engine:{name}"))
    if args.engine_itl and not args.engine_itl_per_variant:
        results.append(engine_itl(base, args.engine_itl, args.seed))
    print("\n| variant | workload | output tok/s | median TPOT (ms) | median ITL (ms) | P99 ITL (ms) | P99 / median ITL | accept length | accept rate | start-up (s) | peak RSS (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if _is_engine(r):
            print(f"| Engine.generate{r['variant'][len('engine'):]} | {r['workload']} | | {r['median_tpot_ms']:.2f} | | | | | | | |")
            continue
        ratio = r["p99_itl_ms"] / r["median_itl_ms"] if r["median_itl_ms"] else float("nan")
        acc = f"{r['spec_accept_length']:.2f}" if r["spec_accept_length"] else "-"
        rate = f"{r['spec_accept_rate']:.2f}" if r["spec_accept_rate"] is not None else "-"
        print(f"| {r['variant']} | {r['workload']} | {r['output_throughput']:.1f} | {r['median_tpot_ms']:.1f} | "
              f"{r['median_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} | {ratio:.2f} | {acc} | {rate} | "
              f"{r['startup_s']:.1f} | {r['server_peak_rss_mib'] or float('nan'):.0f} |")
    print_overhead(results)
    if args.plot:
        plot(results, args.plot)
    if args.output_file:
        with open(args.output_file, "a") as f:
            for r in results:
                if _is_engine(r):  # the servers' rows are written above
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
