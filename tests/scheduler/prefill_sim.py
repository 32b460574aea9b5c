"""A closed-loop served run simulated with the scheduler's rule for a step's prefill tokens, for
PrefillBudget's tests: one `simulate`, its machine (step costs and extend buckets), arrivals and early
stops given as parameters.

The measured machine (`MEASURED`): a step of d decodes beside a chunk filled to extend bucket T costs
the decode-only step of d plus the measured prefill part of T (measured in-process on an idle machine,
D-27: 8 decodes alone 57 ms, beside the 16-token bucket 94 ms, 32: 133, 64: 221, 128: 260, 192: 397,
384: 697, 512: 920; one decode beside 512: 890), times a lognormal noise per step. A request's tokens
arrive at the end of the steps that make them, so a step of duration s beside B decodes makes B ITLs of
s, as bench_serving counts them. Arrivals as served: the first request runs its
first step alone, the rest of the first wave arrives while it runs, and each later request arrives
`arrival_seconds` after one finishes (bench_serving's next request over HTTP: a few ms, so it is queued
for the step after the next; 0: for the next step).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Callable, Sequence

import numpy as np

from jaxserve.scheduler.prefill_budget import PrefillBudget

BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512)
CHUNK = 512
# seconds of a decode-only step by decode bucket, and the prefill part of a step by extend bucket
DECODE_SECONDS = {1: 0.026, 2: 0.035, 4: 0.048, 8: 0.057}
PREFILL_SECONDS = {16: 0.037, 32: 0.076, 64: 0.164, 128: 0.200, 192: 0.340, 256: 0.430, 384: 0.640, 512: 0.862}
ARRIVAL_SECONDS = 0.005  # a finished request's successor reaches the server this long after the finish


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def fill_bucket(n: int, buckets: Sequence[int]) -> int:
    """`n` tokens rounded up to the smallest of `buckets` that holds them (unchanged past the largest)."""
    return next((t for t in buckets if t >= n), n)


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the simulated server runs on: its extend buckets (ascending) and the noise-free seconds of a
    step of `num_decodes` decodes and `num_tokens` tokens in all (`step_seconds`)."""

    buckets: tuple[int, ...]
    step_seconds: Callable[[int, int], float]


def measured_machine(prefill_seconds: dict[int, float] | None = None) -> Machine:
    """The measured machine (module docstring); `prefill_seconds` (extend bucket -> seconds of a step's
    prefill part) replaces the measured buckets, e.g. to add one between two of them."""
    prefill = dict(PREFILL_SECONDS if prefill_seconds is None else prefill_seconds)
    buckets = tuple(sorted(prefill))

    def step_seconds(num_decodes: int, num_tokens: int) -> float:
        decode = DECODE_SECONDS[pow2(num_decodes)] if num_decodes else 0.0
        return decode + (prefill[fill_bucket(num_tokens, buckets)] if num_tokens > num_decodes else 0.0)

    return Machine(buckets, step_seconds)


MEASURED = measured_machine()


def step_seconds(num_decodes: int, num_tokens: int) -> float:
    """Noise-free seconds of a step of `num_decodes` decodes and `num_tokens` tokens on `MEASURED`."""
    return MEASURED.step_seconds(num_decodes, num_tokens)


@dataclasses.dataclass
class Run:
    itls: np.ndarray  # seconds, every ITL of every request
    output_tok_s: float
    num_stalls: int  # whole-chunk steps the stall credit paid for
    num_charged: int  # ITLs of the steps the budget counted as long (over long_ratio x their decode step)

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


def early_stop_workload(seed: int, num_requests: int = 64, early_stop: float = 0.0) -> list[tuple[int, int, int]]:
    """(prompt tokens, max_new_tokens, tokens made): prompts 16-480, max_new_tokens 2-128; with
    probability `early_stop` a request stops (EOS) at a random token before its max_new_tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        max_new = rng.randint(2, 128)
        stop = rng.randint(1, max_new) if rng.random() < early_stop else max_new
        out.append((rng.randint(16, 480), max_new, stop))
    return out


def simulate(budget: PrefillBudget, workload: Sequence[tuple[int, ...]], seed: int, concurrency: int = 8,
             noise: float = 0.08, machine: Machine = MEASURED, arrival_seconds: float = ARRIVAL_SECONDS) -> Run:
    """One served run of `workload` under `budget`, the scheduler's rule for a step's prefill tokens
    (Scheduler._schedule_prefill) and `concurrency` requests in flight (bench_serving's
    --max-concurrency). A request is (prompt tokens, max_new_tokens) or (prompt tokens,
    max_new_tokens, tokens made) when it stops early. `noise`: the sigma of each step's lognormal
    factor (0: none); `machine`: step costs and buckets; `arrival_seconds`: a finished request's
    successor reaches the server this long after the finish."""
    rng = random.Random(seed)
    specs = [(w[0], w[1], w[2] if len(w) > 2 else w[1]) for w in workload]
    pending = list(enumerate(specs))
    arrivals: list[tuple[float, int]] = []  # (time it reaches the server, rid)
    waiting: list[list] = []  # [rid, remaining prompt tokens]
    running: dict[int, list] = {}  # rid -> [last token time, tokens left]
    itls: list[float] = []
    clock, num_stalls, num_charged, out_tokens = 0.0, 0, 0, 0
    for n in (1, 2, 4, 8):  # the warm-up measures each decode bucket's step, as a server's first steps do
        budget.observe(n, 0, machine.step_seconds(n, n))

    def send(at: float) -> None:
        arrivals.append((at, pending.pop(0)[0]))

    send(0.0)
    first = True
    while pending or arrivals or waiting or running:
        for a in [a for a in arrivals if a[0] <= clock]:
            arrivals.remove(a)
            budget.admit_request(str(a[1]), specs[a[1]][1])
            waiting.append([a[1], specs[a[1]][0]])
        if not waiting and not running:
            clock = min(a[0] for a in arrivals)
            continue
        n = len(running)
        after = min(concurrency, n + len(waiting))
        tokens = CHUNK
        stall = bool(n and waiting) and budget.can_stall(n)
        if n and waiting and not stall:
            cap = budget.budget(n, after)
            tokens = budget.step_tokens(n, cap, machine.buckets, after) if cap else n
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
        seconds = machine.step_seconds(n, n + prefills) * (math.exp(rng.gauss(0.0, noise)) if noise else 1.0)
        clock += seconds
        if n and prefills:
            num_stalls += stall
            num_charged += n if seconds > budget.long_ratio * budget.reference_seconds(n, after) else 0
        budget.observe(n, prefills, seconds, fill_bucket(n + prefills, machine.buckets) if prefills else None, after)
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
            running[w[0]] = [clock, specs[w[0]][2] - 1]
            if specs[w[0]][2] == 1:
                finished.append(w[0])
        for rid in finished:
            running.pop(rid)
            budget.finish_request(str(rid), specs[rid][2])
            if pending:
                send(clock + arrival_seconds)
        if first:  # the rest of the first wave reaches the server while the first step runs
            first = False
            while pending and len(arrivals) + len(waiting) + len(running) < concurrency:
                send(clock - seconds / 2)
    budget.end_busy_period()
    return Run(np.array(itls), out_tokens / clock, num_stalls, num_charged)
