"""The prefill budget's decisions, traced: where a bounded run's long ITLs and lost throughput come from.

Runs `Engine` in-process (no HTTP) on the served benchmark's own workloads (bench_decode_latency's
DATASET:CONCURRENCY:NUM_PROMPTS, the same prompts and per-request output lengths as bench_serving),
closed loop (a new request as soon as one finishes, as `--max-concurrency` does), one Engine per
variant in turn in one process. Each step records what `PrefillBudget` knew when the scheduler chose
it (the decode step's moving average, the bound, whether the stall credit paid for a whole chunk,
the moving average of the extend bucket it filled) and what it then took. Printed per variant:

- throughput and its two factors (decoding slots per step, seconds per step), and where the
  concurrency's slot-seconds went: decoding, prefilling an admitted prompt, waiting in the queue,
  no request (the run's tail);
- admissions: TTFT and prefill steps per request;
- every ITL over 3x the run's median, by the step that ended it: decode only, a whole chunk on
  stall credit, a bounded chunk whose bucket was unmeasured / measured over the bound / measured
  within it, and ITLs that spanned more than one step;
- steps with a chunk beside decodes by (decode bucket, extend bucket): their cost over the median
  decode-only step of that batch and their marginal seconds per prefill token.

    python scripts/bench_prefill_budget_trace.py --variants "bound=" "unbounded=--prefill-decode-itl-ratio 0" \
        --workloads random:8:24 copy-heavy:8:16

Two options make the run arrive as a served one does (docs/benchmarks.md, "Fourth pass"):
`--served-idle` sends bench_serving's one warm-up request before each workload and then runs the
served loop's idle step (an `Engine.step()` with nothing to run: the stall credit restarts from 0), and
`--served-arrivals` runs a workload's first step with its first request alone (served, the others
arrive over HTTP while that step runs). (The Fourth pass's `--trial-credit-on-admission` experiment
is gone: the engine now grants the stall credit per request when it is queued, PrefillBudget.admit_request.)
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode_latency  # noqa: E402

LONG_ITL_FACTOR = 3.0  # the bound: P99 ITL <= 3x the median


@dataclass
class Step:
    t0: float
    seconds: float
    num_running: int  # decoding requests when the step was scheduled
    decodes: int
    prefill_tokens: int
    num_prefill_reqs: int
    fill_bucket: int
    stall: bool  # the stall credit paid for a whole chunk
    decode_ema: float | None  # the decode step the bound referred to (PrefillBudget.reference_seconds), seconds
    bucket_estimate: float | None  # PrefillBudget.mixed_seconds of this step's buckets when it was chosen
    limit: float | None  # itl_ratio x decode_ema
    in_flight: int  # requests sent and not finished
    waiting: int  # requests in the waiting queue after the step was scheduled
    stall_credit: float  # PrefillBudget.stall_credit when the step was scheduled


@dataclass
class ReqTrace:
    t_add: float
    output_len: int
    prompt_len: int
    prefill_steps: int = 0
    arrivals: list[tuple[float, int, int]] = field(default_factory=list)  # (time, tokens, step index)


def run_trace(engine, rows, concurrency: int, first_alone: bool = False) -> tuple[list[Step], dict[str, ReqTrace]]:
    """Closed-loop run of `rows` at `concurrency`; returns every step and every request's token arrivals.
    `first_alone`: the first step runs with one request added, the others are added after it."""
    sched = engine.scheduler
    schedule = sched.schedule
    pre: dict = {}

    def traced_schedule():
        n = len(sched.running)
        pb = sched.prefill_budget
        pre.clear()
        pre.update(running={id(r) for r in sched.running}, n=n, stall=pb.can_stall(n) if n else False,
                   credit=pb.stall_credit)
        pre["batch"] = schedule()
        pre["waiting"] = len(sched.waiting)
        # the budget changes only in observe, after the step: what it knew when this batch was chosen
        reference = pb.reference_seconds(n, sched._batch_after_admission) if n else None
        pre["decode"] = reference
        pre["limit"] = pb.itl_ratio * reference if reference is not None and pb.enabled else None
        if pre["batch"] is not None and n:
            pre["estimate"] = pb.mixed_seconds(n, sched._fill_bucket(sum(pre["batch"].extend_lens)))
        return pre["batch"]

    sched.schedule = traced_schedule
    pending = list(rows)
    reqs: dict[str, ReqTrace] = {}
    steps: list[Step] = []
    in_flight = 0
    try:
        while pending or engine.has_unfinished():
            while pending and in_flight < (1 if first_alone and not steps else concurrency):
                row = pending.pop(0)
                t = time.perf_counter()
                (rid,) = engine.add_request(row.prompt, {"max_new_tokens": row.output_len, "temperature": 0, "ignore_eos": True})
                reqs[rid] = ReqTrace(t, row.output_len, len(engine._reqs[rid].input_ids))
                in_flight += 1
            pre.clear()
            t0 = time.perf_counter()
            outs = engine.step()
            t1 = time.perf_counter()
            batch = pre.get("batch")
            if batch is not None:
                decodes = sum(1 for r in batch.reqs if id(r) in pre["running"])
                total = sum(batch.extend_lens)
                prefill_reqs = [r for r in batch.reqs if id(r) not in pre["running"]]
                for r in prefill_reqs:
                    if r.rid in reqs:
                        reqs[r.rid].prefill_steps += 1
                bucket = sched._fill_bucket(total)
                steps.append(Step(t0, t1 - t0, pre["n"], decodes, total - decodes, len(prefill_reqs), bucket, pre["stall"],
                                  pre["decode"], pre.get("estimate"), pre["limit"], in_flight, pre["waiting"],
                                  pre["credit"]))
            for o in outs:
                if o.new_token_ids and o.rid in reqs:
                    reqs[o.rid].arrivals.append((t1, len(o.new_token_ids), len(steps) - 1))
                if o.finished:
                    in_flight -= 1
    finally:
        sched.schedule = schedule
    return steps, reqs


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def long_itl_cause(step: Step, spanned: int) -> str:
    if spanned > 1:
        return f"spanned {spanned} steps"
    if step.prefill_tokens == 0:
        return "decode only"
    if step.decodes == 0:
        return "prefill only"
    if step.stall:
        return "whole chunk on stall credit"
    if step.limit is None:
        return "chunk beside an unmeasured decode step"
    if step.bucket_estimate is None:
        return "bounded chunk, bucket unmeasured"
    if step.bucket_estimate > step.limit:
        return "bounded chunk, bucket measured over the bound"
    return "bounded chunk, bucket measured within the bound"


def report(name: str, workload: str, steps: list[Step], reqs: dict[str, ReqTrace], concurrency: int) -> dict:
    """Prints the variant's tables (see the module docstring); returns its summary numbers."""
    itls, causes = [], []
    for rt in reqs.values():
        for (ta, _, ia), (tb, n, ib) in zip(rt.arrivals, rt.arrivals[1:]):
            itls += [(tb - ta) / n] * n
            causes += [(ib, ib - ia)] * n
    itls_ms = np.array(itls) * 1e3
    med, p99 = float(np.median(itls_ms)), float(np.percentile(itls_ms, 99))
    duration = steps[-1].t0 + steps[-1].seconds - steps[0].t0
    out_tokens = sum(n for rt in reqs.values() for _, n, _ in rt.arrivals)
    ttft = [(rt.arrivals[0][0] - rt.t_add) * 1e3 for rt in reqs.values() if rt.arrivals]
    summary = {
        "variant": name, "workload": workload, "output_tok_s": out_tokens / duration, "steps": len(steps),
        "decodes_per_step": statistics.mean(s.decodes for s in steps),
        "ms_per_step": 1e3 * statistics.mean(s.seconds for s in steps), "median_itl_ms": med, "p99_itl_ms": p99,
        "p99_over_median": p99 / med, "num_itls": len(itls), "median_ttft_ms": statistics.median(ttft),
        "num_long_itls": int((itls_ms > LONG_ITL_FACTOR * med).sum()),
        "median_prefill_steps": statistics.median(rt.prefill_steps for rt in reqs.values()),
    }
    print(f"\n## {name} on {workload}\n")
    print(f"output tok/s {summary['output_tok_s']:.1f} over {duration:.2f} s; {len(steps)} steps, "
          f"{summary['decodes_per_step']:.2f} decodes per step, {summary['ms_per_step']:.1f} ms per step; "
          f"ITL median {med:.1f} ms, P99 {p99:.1f} ms ({p99 / med:.2f}x); {summary['num_long_itls']} of {len(itls)} ITLs "
          f"over {LONG_ITL_FACTOR:g}x the median; TTFT median {summary['median_ttft_ms']:.0f} ms; "
          f"prefill steps per request: median {summary['median_prefill_steps']:g}")
    # slot-seconds of the concurrency: a slot decodes, prefills an admitted prompt, waits, or has no request
    slot = collections.Counter()
    for s in steps:
        slot["decoding"] += s.decodes * s.seconds
        slot["admitted, not decoding (prefilling)"] += (s.in_flight - s.decodes - s.waiting) * s.seconds
        slot["waiting (not admitted)"] += s.waiting * s.seconds
        slot["no request (tail)"] += (concurrency - s.in_flight) * s.seconds
    total_slot = concurrency * sum(s.seconds for s in steps)
    print("slot-seconds: " + ", ".join(f"{k} {v / total_slot:.1%}" for k, v in slot.items()))
    summary["slot_shares"] = {k: v / total_slot for k, v in slot.items()}
    tally = collections.Counter()
    for v, (idx, spanned) in zip(itls_ms, causes):
        if v > LONG_ITL_FACTOR * med:
            tally[long_itl_cause(steps[idx], spanned)] += 1
    print(f"ITLs over {LONG_ITL_FACTOR:g}x the median, by the step that ended them: {dict(tally.most_common())}")
    summary["long_itl_causes"] = dict(tally)
    decode_med: dict[int, float] = {}
    for key in {_pow2(s.decodes) for s in steps if s.decodes}:
        secs = [s.seconds for s in steps if s.prefill_tokens == 0 and s.decodes and _pow2(s.decodes) == key]
        if secs:
            decode_med[key] = statistics.median(secs)
    print("\n| decode bucket | extend bucket | steps | median (ms) | x decode-only | median prefill tokens | "
          "ms per prefill token | on stall credit | over the bound | over 3x the decode estimate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    groups = collections.defaultdict(list)
    for s in steps:
        if s.decodes and s.prefill_tokens:
            groups[(_pow2(s.decodes), s.fill_bucket)].append(s)
    rows = []
    for (db, eb), ss in sorted(groups.items()):
        base = decode_med.get(db)
        secs = statistics.median(s.seconds for s in ss)
        ratio = secs / base if base else float("nan")
        per_tok = statistics.median((s.seconds - base) / s.prefill_tokens for s in ss) * 1e3 if base else float("nan")
        over = sum(1 for s in ss if s.limit is not None and s.seconds > s.limit)
        long = sum(1 for s in ss if s.decode_ema is not None and s.seconds > LONG_ITL_FACTOR * s.decode_ema)
        print(f"| {db} | {eb} | {len(ss)} | {secs * 1e3:.1f} | {ratio:.2f} | "
              f"{statistics.median(s.prefill_tokens for s in ss):.0f} | {per_tok:.2f} | {sum(s.stall for s in ss)} | {over} | {long} |")
        rows.append({"decode_bucket": db, "extend_bucket": eb, "steps": len(ss), "median_ms": secs * 1e3,
                     "x_decode": ratio, "ms_per_prefill_token": per_tok})
    summary["mixed_buckets"] = rows
    summary["decode_only_median_ms"] = {k: v * 1e3 for k, v in decode_med.items()}
    return summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", required=True, help='NAME=FLAGS, e.g. "bound=" "unbounded=--prefill-decode-itl-ratio 0"')
    p.add_argument("--workloads", nargs="+", required=True, help="DATASET:CONCURRENCY:NUM_PROMPTS (bench_decode_latency's)")
    p.add_argument("--server-flags", default="--max-total-tokens 16384 --log-level warning", help="flags of every variant")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append one JSON line per (variant, workload) with the summary and every step")
    p.add_argument("--served-idle", action="store_true", help="before each workload: one warm-up request, then an idle step")
    p.add_argument("--served-arrivals", action="store_true", help="a workload's first step runs its first request alone")
    args = p.parse_args(argv)

    from jaxserve.config import ServerArgs
    from jaxserve.engine.engine import Engine

    bench_serving = bench_decode_latency.bench_serving
    results = []
    for v in args.variants:
        name, _, flags = v.partition("=")
        engine = Engine(ServerArgs.from_cli(shlex.split(args.server_flags) + shlex.split(flags)))
        engine.generate("warm-up", {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        for w in args.workloads:
            bargs = bench_serving.parse_args(bench_decode_latency.workload_argv(w, 0, args.seed))
            rows = bench_serving.build_dataset(bargs, engine.tokenizer, np.random.default_rng(args.seed))
            if args.served_idle:  # bench_serving's warm-up request, then the served loop's idle step
                engine.generate(rows[0].prompt, {"max_new_tokens": min(rows[0].output_len, 16), "temperature": 0, "ignore_eos": True})
                engine.step()
            steps, reqs = run_trace(engine, rows, int(w.split(":")[1]), args.served_arrivals)
            summary = report(name, w, steps, reqs, int(w.split(":")[1]))
            results.append(summary)
            if args.output_file:
                with open(args.output_file, "a") as f:
                    f.write(json.dumps({**summary, "flags": flags, "steps_trace": [asdict(s) for s in steps]}) + "\n")
        del engine
    print("\n| variant | workload | output tok/s | decodes per step | ms per step | P99 / median ITL | long ITLs | median TTFT (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['workload']} | {r['output_tok_s']:.1f} | {r['decodes_per_step']:.2f} | {r['ms_per_step']:.1f} | "
              f"{r['p99_over_median']:.2f} | {r['num_long_itls']} of {r['num_itls']} | {r['median_ttft_ms']:.0f} |")


if __name__ == "__main__":
    main()
