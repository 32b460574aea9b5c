"""The overlap schedule on and off in one process: TPOT and output tok/s of closed-loop decoding.

One `Engine` (no HTTP) with the given server flags; each round runs the same random prompts with the
overlap schedule on and then off (the order alternates between rounds), at each --concurrency (that
many requests in flight, a new one added as one finishes), the radix cache flushed before each run so
neither mode reuses the other's prefill. Printed per mode and concurrency: TPOT (a request's
(last token time - first token time) / (output tokens - 1)) mean and median over all rounds' requests,
output tok/s per run, and the ratio on / off.

    python -m benchmarks.engine.bench_overlap --flags "--max-total-tokens 16384" --concurrency 1 8 --rounds 6
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import time

import numpy as np


def run(engine, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    """Closed loop over `prompts`: per-request TPOT (s) and the run's output tok/s."""
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    pending, in_flight, first, last, count = list(prompts), set(), {}, {}, {}
    tokens, start = 0, time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            in_flight.add(engine.add_request(pending.pop(0), params)[0])
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(out.rid, now)
                last[out.rid] = now
                count[out.rid] = count.get(out.rid, 0) + len(out.new_token_ids)
                tokens += len(out.new_token_ids)
            if out.finished:
                in_flight.discard(out.rid)
    wall = time.perf_counter() - start
    tpots = [(last[r] - first[r]) / (count[r] - 1) for r in count if count[r] > 1]
    return {"tpot": tpots, "tok_s": tokens / wall}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flags", default="--max-total-tokens 16384", help="ServerArgs flags of the engine")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--num-prompts", type=int, default=8, help="requests per run")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", help="append one JSON line per run")
    args = p.parse_args(argv)

    from jaxserve.engine.engine import Engine
    from jaxserve.server_args import ServerArgs

    engine = Engine(ServerArgs.from_cli(shlex.split(args.flags)))
    rng = np.random.default_rng(args.seed)
    vocab = engine.runner.model_config.vocab_size
    results = {(mode, c): {"tpot": [], "tok_s": []} for mode in ("on", "off") for c in args.concurrency}
    run(engine, [list(map(int, rng.integers(100, vocab - 100, args.input_len)))], 8, 1)  # settle
    for rnd in range(args.rounds):
        prompts = [list(map(int, rng.integers(100, vocab - 100, args.input_len))) for _ in range(args.num_prompts)]
        order = ("on", "off") if rnd % 2 == 0 else ("off", "on")
        for c in args.concurrency:
            for mode in order:
                engine.args = dataclasses.replace(engine.args, disable_overlap_schedule=mode == "off")
                engine.flush_cache()
                r = run(engine, prompts, args.output_len, c)
                results[(mode, c)]["tpot"] += r["tpot"]
                results[(mode, c)]["tok_s"].append(r["tok_s"])
                print(f"round {rnd} concurrency {c} overlap {mode}: TPOT median {1e3 * statistics.median(r['tpot']):.2f} ms, "
                      f"{r['tok_s']:.1f} tok/s", flush=True)
                if args.output_file:
                    with open(args.output_file, "a") as f:
                        f.write(json.dumps({"round": rnd, "concurrency": c, "overlap": mode, **r}) + "\n")
    print("\n| concurrency | overlap | TPOT mean / median (ms) | output tok/s (mean of runs) |")
    print("|---|---|---|---|")
    for c in args.concurrency:
        for mode in ("off", "on"):
            r = results[(mode, c)]
            print(f"| {c} | {mode} | {1e3 * statistics.mean(r['tpot']):.2f} / {1e3 * statistics.median(r['tpot']):.2f} "
                  f"| {statistics.mean(r['tok_s']):.1f} |")
    for c in args.concurrency:
        on, off = results[("on", c)], results[("off", c)]
        print(f"concurrency {c}: TPOT on / off {statistics.mean(on['tpot']) / statistics.mean(off['tpot']):.3f} (mean), "
              f"{statistics.median(on['tpot']) / statistics.median(off['tpot']):.3f} (median); "
              f"tok/s on / off {statistics.mean(on['tok_s']) / statistics.mean(off['tok_s']):.3f}")


if __name__ == "__main__":
    main()
