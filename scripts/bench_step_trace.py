"""Where the ITL tail comes from: every engine step of a closed-loop run, timed and classified.

Runs `Engine` in-process (no HTTP) with the given server flags and keeps --concurrency requests of
the random workload in flight (a new one is added as soon as one finishes, as bench_serving's
--max-concurrency does). Each step is recorded with its wall time, its batch (decodes, prefill
tokens, whether it verified drafts), the Python GC pauses inside it and whether it compiled. Each
request's ITLs are the gaps between the steps that gave it tokens (spread over the tokens of a
step, as bench_serving does). Printed: median and P99 ITL, and the P99 tail's steps by kind.

    python scripts/bench_step_trace.py --flags "--max-total-tokens 16384" --concurrency 8 --num-prompts 24

With --dataset-output-lens each random request runs its own output length (uniform in [1, --output-len]
at the default --random-range-ratio 0), as bench_serving's random workload does served: requests end
all through the run and new prompts are prefilled beside the decodes, which is where the prefill
budget's throughput cost shows (docs/benchmarks.md, issue 20).
"""

from __future__ import annotations

import argparse
import collections
import gc
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_datasets import PromptSampler, sample_copy_heavy_requests, sample_random_requests  # noqa: E402


def step_kind(num_decodes: int, prefill_tokens: int, verified: bool, why_no_draft: str = "") -> str:
    if verified:
        return "verify"
    if why_no_draft and not prefill_tokens:
        return f"decode only ({why_no_draft})"
    if prefill_tokens and num_decodes:
        return "prefill chunk + decodes"
    if prefill_tokens:
        return "prefill only"
    return "decode only"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flags", default="--max-total-tokens 16384", help="ServerArgs flags")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dataset", choices=("random", "copy-heavy"), default="random",
                   help="copy-heavy: bench_serving's copy-heavy prompts (--copy-num-sentences, --copy-output-len)")
    p.add_argument("--copy-num-sentences", type=int, default=6)
    p.add_argument("--copy-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: input (and, with --dataset-output-lens, output) lengths uniform in [len x ratio, len], "
                   "as bench_serving's flag")
    p.add_argument("--dataset-output-lens", action="store_true",
                   help="random: each request runs its own sampled output length (bench_serving's random workload: "
                   "requests end all through the run and prompts keep arriving) instead of --output-len for all")
    p.add_argument("--breakdown", action="store_true",
                   help="print each step kind's share of the time per output token (speculation on)")
    args = p.parse_args(argv)
    if args.dataset_output_lens and args.dataset != "random":
        p.error("--dataset-output-lens is for --dataset random (copy-heavy requests all run --copy-output-len)")

    from jaxserve.config import ServerArgs
    from jaxserve.engine.engine import Engine

    engine = Engine(ServerArgs.from_cli(shlex.split(args.flags)))
    rng = np.random.default_rng(args.seed)
    if args.dataset == "copy-heavy":
        rows = sample_copy_heavy_requests(engine.tokenizer, rng, args.num_prompts, args.copy_num_sentences,
                                          args.copy_output_len)
        args.output_len = args.copy_output_len
    else:
        rows = sample_random_requests(PromptSampler(engine.tokenizer, rng), args.num_prompts,
                                      args.input_len, args.output_len, args.random_range_ratio)
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    engine.generate(rows[0].prompt, {**params, "max_new_tokens": 8})  # warm-up

    gc_pauses: list[tuple[float, float]] = []
    gc_start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_pauses.append((gc_start[0], time.perf_counter()))

    gc.callbacks.append(on_gc)
    last_batch = [None]
    schedule = engine.scheduler.schedule

    def traced_schedule():
        last_batch[0] = schedule()
        return last_batch[0]

    engine.scheduler.schedule = traced_schedule
    probe = _SpecProbe(engine)
    pending = list(rows)
    arrivals: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
    steps = []
    in_flight = 0
    while pending or engine.has_unfinished():
        while pending and in_flight < args.concurrency:
            row = pending.pop(0)
            engine.add_request(row.prompt, {**params, "max_new_tokens": row.output_len} if args.dataset_output_lens else params)
            in_flight += 1
        compiles = engine.runner.num_compiles_after_warmup
        verifications = engine.stats.num_spec_verifications
        accepted = engine.stats.num_spec_accepted_tokens
        last_batch[0] = None
        probe.reset()
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        batch = last_batch[0]
        if batch is not None:
            running = {id(r) for r in engine.scheduler.running}
            decodes = sum(1 for r, n in zip(batch.reqs, batch.extend_lens) if n == 1 and r.kv_len >= len(r.input_ids))
            prefill = sum(batch.extend_lens) - decodes
            gc_s = sum(min(b, t1) - max(a, t0) for a, b in gc_pauses if b > t0 and a < t1)
            steps.append({"t0": t0, "seconds": t1 - t0, "decodes": decodes, "prefill_tokens": prefill,
                          "verified": engine.stats.num_spec_verifications > verifications,
                          "compiled": engine.runner.num_compiles_after_warmup > compiles, "gc_seconds": gc_s,
                          "num_running": len(running), "runner_seconds": probe.runner_seconds,
                          "num_draft": probe.num_draft, "num_accepted": engine.stats.num_spec_accepted_tokens - accepted,
                          "why_no_draft": probe.why_no_draft(), "num_tokens": sum(len(o.new_token_ids) for o in outs)})
        for o in outs:
            if o.new_token_ids:
                arrivals[o.rid].append((t1, len(o.new_token_ids)))
            if o.finished:
                in_flight -= 1
    gc.callbacks.remove(on_gc)

    itls, itl_step = [], []
    step_ends = [s["t0"] + s["seconds"] for s in steps]
    for events in arrivals.values():
        for (ta, _), (tb, n) in zip(events, events[1:]):
            idx = int(np.searchsorted(step_ends, tb - 1e-9))
            itls += [(tb - ta) / n] * n
            itl_step += [idx] * n
    itls_ms = np.array(itls) * 1e3
    med, p99 = float(np.median(itls_ms)), float(np.percentile(itls_ms, 99))
    decode_s = [s["seconds"] for s in steps if step_kind(s["decodes"], s["prefill_tokens"], s["verified"], s["why_no_draft"]).startswith("decode only")]
    print(f"\n{len(steps)} steps, {len(itls)} ITLs: median {med:.1f} ms, P99 {p99:.1f} ms, P99 / median {p99 / med:.2f}; "
          f"median decode-only step {statistics.median(decode_s) * 1e3:.1f} ms" if decode_s else "")
    tail = collections.Counter()
    for v, idx in zip(itls_ms, itl_step):
        if v >= p99 and idx < len(steps):
            s = steps[idx]
            kind = step_kind(s["decodes"], s["prefill_tokens"], s["verified"], s["why_no_draft"])
            extra = (" +compile" if s["compiled"] else "") + (" +gc" if s["gc_seconds"] > 0.005 else "")
            tail[f"{kind}{extra}"] += 1
    print("ITLs at or above P99, by the step that ended them:", dict(tail))
    print("\n| step kind | steps | median (ms) | max (ms) | median prefill tokens |")
    print("|---|---|---|---|---|")
    by_kind = collections.defaultdict(list)
    for s in steps:
        by_kind[step_kind(s["decodes"], s["prefill_tokens"], s["verified"], s["why_no_draft"])].append(s)
    for kind, ss in by_kind.items():
        secs = [s["seconds"] * 1e3 for s in ss]
        print(f"| {kind} | {len(ss)} | {statistics.median(secs):.1f} | {max(secs):.1f} | "
              f"{statistics.median([s['prefill_tokens'] for s in ss]):.0f} |")
    mixed = collections.Counter(s["decodes"] + s["prefill_tokens"] for s in steps if s["decodes"] and s["prefill_tokens"])
    print("\nsteps with a chunk beside decodes, by their tokens:", dict(sorted(mixed.items())))
    out_tokens = sum(len(v) and sum(n for _, n in v) for v in arrivals.values())
    print(f"output tok/s {out_tokens / (steps[-1]['t0'] + steps[-1]['seconds'] - steps[0]['t0']):.1f}")
    if args.breakdown:
        print_breakdown(steps, out_tokens)
        if probe.by_class:
            print("\naccepted draft tokens per verification by the draft's match-length class "
                  "(1: 1 token, 2: 2-3, 3: 4-7, 4: 8+ or a radix-tree continuation):")
            for cls, v in sorted(probe.by_class.items()):
                acc = [a for _, a in v]
                print(f"  {cls}: {len(v)} verifications, drafted {np.mean([d for d, _ in v]):.1f}, accepted "
                      f"{np.mean(acc):.2f} (none accepted in {np.mean([a == 0 for a in acc]):.0%})")
        tpots = [(ev[-1][0] - ev[0][0]) / (sum(n for _, n in ev) - ev[0][1]) * 1e3
                 for ev in arrivals.values() if sum(n for _, n in ev) > ev[0][1]]
        print(f"median TPOT (first token to last, per request) {statistics.median(tpots):.2f} ms")
    slow = sorted(steps, key=lambda s: -s["seconds"])[:8]
    print("\nslowest steps:")
    for s in slow:
        print(f"  {s['seconds'] * 1e3:.1f} ms: {s['decodes']} decodes, {s['prefill_tokens']} prefill tokens, "
              f"verified={s['verified']}, compiled={s['compiled']}, gc {s['gc_seconds'] * 1e3:.1f} ms")


class _SpecProbe:
    """Wraps the engine's runner calls and draft proposals to record, per step, the seconds spent in
    `ModelRunner.forward` + `sample` (the device step with its dispatch; the sampled ids come back to
    the host inside `sample`), the drafted tokens and why a decode step drafted nothing."""

    def __init__(self, engine):
        self.runner_seconds = 0.0
        self.num_draft = 0
        self._raw: list[int] = []  # each request's draft length before the policy and the page check
        self._declined = 0
        runner = engine.runner
        for name in ("forward", "sample"):
            setattr(runner, name, self._timed(getattr(runner, name)))
        spec = engine.speculator
        if spec is not None:
            propose, wants = spec.propose, spec.policy.wants_draft
            spec.propose = lambda req, k: self._note(self._raw, propose(req, k))
            spec.policy.wants_draft = lambda *a: self._note_policy(wants(*a))
            observe = spec.observe_verify
            spec.observe_verify = lambda drafts, seconds: (setattr(self, "num_draft", sum(map(len, drafts))),
                                                           observe(drafts, seconds))[1]
            record = spec.record
            spec.record = lambda req, nd, na: (self._note_class(req, nd, na), record(req, nd, na))[1]
        self._spec = spec
        self.by_class: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)

    def _note_class(self, req, num_draft: int, num_accepted: int) -> None:
        from jaxserve.speculative.policy import match_class

        state = req.draft_state
        if num_draft and state is not None and getattr(state, "match_len", None) is not None:
            self.by_class[f"class {match_class(state.match_len)}"].append((num_draft, num_accepted))

    def _timed(self, fn):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.runner_seconds += time.perf_counter() - t0
        return wrapped

    @staticmethod
    def _note(into: list, draft):
        into.append(len(draft))
        return draft

    def _note_policy(self, ok: bool) -> bool:
        self._declined += not ok
        return ok

    def reset(self) -> None:
        self.runner_seconds, self.num_draft, self._raw, self._declined = 0.0, 0, [], 0

    def why_no_draft(self) -> str:
        if self._spec is None or self.num_draft:
            return ""
        if self._declined:
            return "policy declined"
        if self._raw and not any(self._raw):
            return "no n-gram match"
        if not self._raw:
            return "not drafting"
        return "no pages"


def print_breakdown(steps: list[dict], out_tokens: int) -> None:
    """Each step kind's count, time and share of the run's time per output token; host = step time
    outside the runner's forward and sample calls."""
    total = sum(s["seconds"] for s in steps)
    print(f"\nbreakdown: {len(steps)} steps, {out_tokens} output tokens, {total * 1e3 / max(out_tokens, 1):.2f} ms of "
          "step time per output token")
    print("\n| step kind | steps | tokens out | median step (ms) | median host (ms) | ms per output token of the run "
          "| drafted / accepted per step |")
    print("|---|---|---|---|---|---|---|")
    by_kind = collections.defaultdict(list)
    for s in steps:
        by_kind[step_kind(s["decodes"], s["prefill_tokens"], s["verified"], s["why_no_draft"])].append(s)
    for kind, ss in sorted(by_kind.items(), key=lambda kv: -sum(s["seconds"] for s in kv[1])):
        secs = [s["seconds"] * 1e3 for s in ss]
        host = [(s["seconds"] - s["runner_seconds"]) * 1e3 for s in ss]
        drafted = sum(s["num_draft"] for s in ss) / len(ss)
        acc = sum(s["num_accepted"] for s in ss) / len(ss)
        print(f"| {kind} | {len(ss)} | {sum(s['num_tokens'] for s in ss)} | {statistics.median(secs):.1f} | "
              f"{statistics.median(host):.2f} | {sum(secs) / max(out_tokens, 1):.2f} | "
              f"{drafted:.2f} / {acc:.2f} |")
    gaps = [b["t0"] - (a["t0"] + a["seconds"]) for a, b in zip(steps, steps[1:])]
    print(f"between steps (the bench loop, add_request): {sum(gaps) * 1e3 / max(out_tokens, 1):.2f} ms per output token")


if __name__ == "__main__":
    main()
