"""The storage tier (--hicache-storage-backend file): TTFT of a prefix read from storage after a restart
against recomputing a fresh prompt of the same length, and ITL with storage writes against storage off.

TTFT. A first process serves --rounds + 1 long prompts with the storage tier on and exits (its writes
reach the directory). A second process (the restart) starts an engine on the same directory, warms up
with one stored prompt and one fresh prompt (so both paths are compiled), then per round serves one
stored prompt (a storage hit: cached_tokens is checked) and one fresh random prompt of the same length,
in alternating order, and reports TTFT (the time from `add_request` to the first output token, in
process, no HTTP) of each and their ratio. The greedy output of each stored prompt is compared with the
one the first process produced.

ITL. One engine with storage off and one with storage on (write_through to an empty directory) run the
same closed loop (--itl-concurrency requests in flight, fresh prompts, so every prefill is written to
storage while the others decode); ITL is the time between a request's consecutive output tokens.

    python -m benchmarks.cache.bench_storage --input-len 1600 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

FLAGS = "--max-total-tokens 8192 --context-length 2048 --disable-precompile --chunked-prefill-size 512"


def prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(100, vocab - 100, length))) for _ in range(n)]


def make_engine(flags: str, storage_dir: str | None):
    from jaxserve.engine.engine import Engine
    from jaxserve.server_args import ServerArgs

    if storage_dir is not None:
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = storage_dir
        flags += " --hicache-storage-backend file"
    return Engine(ServerArgs.from_cli(shlex.split(flags)))


def timed(engine, tokens: list[int], max_new_tokens: int) -> tuple[float, list[int], int]:
    """(TTFT in seconds, output ids, cached_tokens) of one request served alone."""
    t0 = time.perf_counter()
    rid = engine.add_request(tokens, {"max_new_tokens": max_new_tokens, "temperature": 0})[0]
    ttft, output, cached = None, [], 0
    while True:
        for out in engine.step():
            if out.rid != rid:
                continue
            if out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            if out.finished:
                output, cached = out.output_ids, out.meta.cached_tokens
                engine.step()  # an idle iteration: new pages go to the writer
                return ttft, output, cached


def closed_loop(engine, batch: list[list[int]], output_len: int, concurrency: int) -> list[float]:
    """ITLs (seconds) of every request of `batch`, `concurrency` in flight."""
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    pending, in_flight, last, itls = list(batch), set(), {}, []
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            in_flight.add(engine.add_request(pending.pop(0), params)[0])
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                if out.rid in last:
                    itls.append((now - last[out.rid]) / len(out.new_token_ids))
                last[out.rid] = now
            if out.finished:
                in_flight.discard(out.rid)
    return itls


def first_life(args) -> None:
    engine = make_engine(args.flags, args.storage_dir)
    stored = prompts(args.seed, args.rounds + 1, args.input_len, engine.runner.model_config.vocab_size)
    outputs = [timed(engine, p, args.output_len)[1] for p in stored]
    engine.close()
    print(json.dumps(outputs))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flags", default=FLAGS, help="ServerArgs flags of the engines")
    p.add_argument("--input-len", type=int, default=1600)
    p.add_argument("--output-len", type=int, default=8, help="output tokens of the TTFT requests")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--itl-concurrency", type=int, default=4)
    p.add_argument("--itl-prompts", type=int, default=8, help="requests per ITL run")
    p.add_argument("--itl-input-len", type=int, default=512)
    p.add_argument("--itl-output-len", type=int, default=64)
    p.add_argument("--skip-itl", action="store_true")
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--storage-dir", help=argparse.SUPPRESS)  # the first life's directory
    p.add_argument("--first-life", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.first_life:
        return first_life(args)

    with tempfile.TemporaryDirectory(prefix="bench_storage_") as tmp:
        if not args.skip_ttft:
            bench_ttft(args, tmp)
        if not args.skip_itl:
            bench_itl(args, tmp)


def bench_ttft(args, tmp: str) -> None:
    storage_dir = os.path.join(tmp, "ttft")
    child = [sys.executable, "-m", "benchmarks.cache.bench_storage", "--first-life", "--storage-dir", storage_dir,
             "--flags", args.flags, "--input-len", str(args.input_len), "--output-len", str(args.output_len),
             "--rounds", str(args.rounds), "--seed", str(args.seed)]
    first_outputs = json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    engine = make_engine(args.flags, storage_dir)  # the restart
    vocab = engine.runner.model_config.vocab_size
    stored = prompts(args.seed, args.rounds + 1, args.input_len, vocab)
    fresh = prompts(args.seed + 1000, args.rounds + 1, args.input_len, vocab)
    timed(engine, stored[0], args.output_len)  # warm-up: a storage hit and a recompute, compiled
    timed(engine, fresh[0], args.output_len)
    hit_ttft, fresh_ttft = [], []
    for rnd in range(1, args.rounds + 1):
        order = ("hit", "fresh") if rnd % 2 else ("fresh", "hit")
        for kind in order:
            tokens = stored[rnd] if kind == "hit" else fresh[rnd]
            ttft, output, cached = timed(engine, tokens, args.output_len)
            if kind == "hit":
                assert cached >= min(1024, args.input_len // 2), f"not a storage hit: cached_tokens {cached}"
                assert output == first_outputs[rnd], "the greedy output differs from the first life's"
                hit_ttft.append(ttft)
            else:
                fresh_ttft.append(ttft)
            print(f"round {rnd} {kind}: TTFT {1e3 * ttft:.1f} ms, cached_tokens {cached}", flush=True)
    stats = engine.radix_cache_stats()
    engine.close()
    hit, rec = statistics.median(hit_ttft), statistics.median(fresh_ttft)
    print(f"TTFT {args.input_len} tokens, median of {args.rounds}: storage hit {1e3 * hit:.1f} ms, recompute "
          f"{1e3 * rec:.1f} ms, ratio {hit / rec:.3f}; storage read {stats.storage_bytes_read / 1e6:.1f} MB", flush=True)


def bench_itl(args, tmp: str) -> None:
    off = make_engine(args.flags, None)
    on = make_engine(args.flags, os.path.join(tmp, "itl"))
    vocab = on.runner.model_config.vocab_size
    closed_loop(off, prompts(args.seed + 1, 2, args.itl_input_len, vocab), 8, 2)  # settle
    closed_loop(on, prompts(args.seed + 2, 2, args.itl_input_len, vocab), 8, 2)
    itl, ratios = {"off": [], "on": []}, []
    for rnd in range(args.rounds):  # the same new prompts for both, ABBA order (D-40)
        batch = prompts(args.seed + 10 + rnd, args.itl_prompts, args.itl_input_len, vocab)
        means = {}
        for mode in (("on", "off") if rnd % 2 else ("off", "on")):
            run = closed_loop(on if mode == "on" else off, batch, args.itl_output_len, args.itl_concurrency)
            itl[mode] += run
            means[mode] = statistics.mean(run)
        ratios.append(means["on"] / means["off"])
        print(f"round {rnd}: mean ITL {1e3 * means['on']:.2f} ms with storage writes, {1e3 * means['off']:.2f} ms "
              f"off, ratio {ratios[-1]:.3f}", flush=True)
    written = on.radix_cache_stats().storage_bytes_written
    on.close()
    m_on, m_off = statistics.mean(itl["on"]), statistics.mean(itl["off"])
    print(f"ITL mean {1e3 * m_on:.2f} vs {1e3 * m_off:.2f} ms with storage writes vs off; median per-round ratio "
          f"{statistics.median(ratios):.3f} (rounds {', '.join(f'{r:.3f}' for r in ratios)}); "
          f"{written / 1e6:.1f} MB written", flush=True)


if __name__ == "__main__":
    main()
