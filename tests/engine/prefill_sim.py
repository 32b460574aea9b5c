"""A served closed-loop run simulated on step costs measured on this machine, for PrefillBudget's tests.

The machine: a step of d decodes beside a chunk filled to extend bucket T costs the decode-only step
of d plus the measured prefill part of T (docs/bench/itl_trace_fifth_grant.txt, in-process, idle slot:
8 decodes alone 57 ms, beside the 16-token bucket 94 ms, 32: 133, 64: 221, 128: 260, 192: 397,
384: 697, 512: 920; one decode beside 512: 890), times a lognormal noise per step. A request's tokens
arrive at the end of the steps that make them, so a step of duration s beside B decodes makes B ITLs
of s, as bench_serving counts them. Arrivals as served: the first request runs its first step alone,
the rest of the first wave arrives while it runs, and each later request arrives a few ms after one
finishes (bench_serving's next request over HTTP), so it is queued for the step after the next.
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np

from jaxserve.engine.prefill_budget import PrefillBudget

BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512)
CHUNK = 512
# seconds of a decode-only step by decode bucket, and the prefill part of a step by extend bucket
DECODE_SECONDS = {1: 0.026, 2: 0.035, 4: 0.048, 8: 0.057}
PREFILL_SECONDS = {16: 0.037, 32: 0.076, 64: 0.164, 128: 0.200, 192: 0.340, 256: 0.430, 384: 0.640, 512: 0.862}
ARRIVAL_SECONDS = 0.005  # a finished request's successor reaches the server this long after the finish


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _fill_bucket(n: int) -> int:
    return next((t for t in BUCKETS if t >= n), n)


def step_seconds(num_decodes: int, num_tokens: int) -> float:
    """Noise-free seconds of a step of `num_decodes` decodes and `num_tokens` tokens in all."""
    decode = DECODE_SECONDS[_pow2(num_decodes)] if num_decodes else 0.0
    prefill = PREFILL_SECONDS[_fill_bucket(num_tokens)] if num_tokens > num_decodes else 0.0
    return decode + prefill


@dataclasses.dataclass
class Run:
    itls: np.ndarray  # seconds, every ITL of every request
    output_tok_s: float
    num_stalls: int  # whole-chunk steps the stall credit paid for

    @property
    def p99_over_median(self) -> float:
        return float(np.percentile(self.itls, 99) / np.median(self.itls))

    @property
    def num_long(self) -> int:
        return int((self.itls > 3 * np.median(self.itls)).sum())


def random_workload(seed: int, num_requests: int = 24, input_len: int = 128, output_len: int = 64) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of bench_serving's random dataset: both uniform from 1 to the length."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(1, input_len + 1, size=num_requests)
    outputs = rng.integers(1, output_len + 1, size=num_requests)
    return list(zip(inputs.tolist(), outputs.tolist()))


def copy_heavy_workload(seed: int, num_requests: int = 16) -> list[tuple[int, int]]:
    """Copy-heavy prompts (~100-500 tokens, six sentences of a passage and an instruction), 128 out."""
    rng = random.Random(seed)
    return [(rng.randint(100, 500), 128) for _ in range(num_requests)]


def simulate(budget: PrefillBudget, workload: list[tuple[int, int]], seed: int, concurrency: int = 8,
             noise: float = 0.08) -> Run:
    """One served run of `workload` under `budget`, the scheduler's rule for a step's prefill tokens
    (Scheduler._schedule_prefill) and `concurrency` requests in flight (bench_serving's
    --max-concurrency). `noise`: the sigma of each step's lognormal factor."""
    rng = random.Random(seed)
    pending = list(enumerate(workload))
    arrivals: list[tuple[float, int, int, int]] = []  # (time it reaches the server, rid, prompt, output)
    waiting: list[list] = []  # [rid, remaining prompt tokens, output tokens]
    running: dict[int, list] = {}  # rid -> [last token time, tokens left]
    itls: list[float] = []
    clock, num_stalls, out_tokens = 0.0, 0, 0
    for n in (1, 2, 4, 8):  # the warm-up measures each decode bucket's step, as a server's first steps do
        budget.observe(n, 0, step_seconds(n, n))

    def send(at: float) -> None:
        rid, (prompt, output) = pending.pop(0)
        arrivals.append((at, rid, prompt, output))

    send(0.0)
    first = True
    while pending or arrivals or waiting or running:
        for a in [a for a in arrivals if a[0] <= clock]:
            arrivals.remove(a)
            budget.admit_request(str(a[1]), a[3])
            waiting.append([a[1], a[2], a[3]])
        if not waiting and not running:
            clock = min(a[0] for a in arrivals)
            continue
        n = len(running)
        after = min(concurrency, n + len(waiting))
        tokens = CHUNK
        stall = bool(n and waiting) and budget.can_stall(n)
        if n and waiting and not stall:
            cap = budget.budget(n, after)
            tokens = budget.step_tokens(n, cap, BUCKETS, after) if cap else n
        room = max(0, min(CHUNK, tokens) - n)
        prefills, joined = 0, []
        for w in waiting:
            if room == 0:
                break
            take = min(room, w[1])
            w[1] -= take
            room -= take
            prefills += take
            if w[1] == 0:
                joined.append(w)
        seconds = step_seconds(n, n + prefills) * math.exp(rng.gauss(0.0, noise))
        clock += seconds
        num_stalls += stall and prefills > 0
        budget.observe(n, prefills, seconds, _fill_bucket(n + prefills) if prefills else None, after)
        finished = []
        for rid, state in running.items():
            itls.append(clock - state[0])
            state[0] = clock
            state[1] -= 1
            out_tokens += 1
            if state[1] == 0:
                finished.append(rid)
        for w in joined:
            waiting.remove(w)
            out_tokens += 1
            running[w[0]] = [clock, w[2] - 1]
            if w[2] == 1:
                finished.append(w[0])
        for rid in finished:
            running.pop(rid)
            budget.finish_request(str(rid), workload[rid][1])
            if pending:
                send(clock + ARRIVAL_SECONDS)
        if first:  # the rest of the first wave reaches the server while the first step runs
            first = False
            while pending and len(arrivals) + len(waiting) + len(running) < concurrency:
                send(clock - seconds / 2)
        if not waiting and not running and not arrivals and not pending:
            break
    budget.end_busy_period()
    return Run(np.array(itls), out_tokens / clock, num_stalls)
