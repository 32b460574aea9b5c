"""The prefill token budget of a step that also runs decodes, sized from measured step times.

A step that prefills a chunk beside running decodes delays every one of those decodes' next token
by the chunk's cost. `PrefillBudget` keeps that delay bounded: a step with a chunk may take at most
`itl_ratio` times a decode-only step of the batch the running decodes will have once the waiting
prompts join them (`reference_seconds`), so its prefill tokens are

    budget(n) = (itl_ratio - 1) x decode_seconds(batch after admission) / prefill_seconds_per_token

clamped to [min_tokens, max_tokens], from what the steps took: decode_seconds per decode bucket
(the power of two of the running batch, which is what the compiled step costs; the median of its
last `COST_WINDOW` steps), and the marginal seconds per prefill token of steps that had a chunk (a
moving average). A step is then filled to the largest extend bucket whose own measured cost keeps
the bound (`step_tokens`). The more decodes
run, the longer a decode step and the larger the chunk they can absorb. Measured (D-25): a
512-token chunk holding 8 decodes for ~2.5 s against ~120 ms decode steps (P99 / median ITL 1037 /
118 ms); the bound makes that ratio a setting (`--prefill-decode-itl-ratio`).

The goal is a bound on the P99 ITL, not on every ITL, so a few steps may exceed it: the stall
allowance (`stall_fraction`, `--prefill-decode-stall-fraction`) lets a step take a whole chunk while
the steps measured over the bound have delayed at most that fraction of all ITLs. It is a token
bucket (the idea of a leaky-bucket rate limiter, applied to latency-SLO error budgets) whose credit is
granted per request, in advance: a request that enters the queue (`admit_request`) brings
`stall_fraction` x the ITLs it may have (max_new_tokens - 1), and when it finishes
(`finish_request`) the part it did not earn (a stop before max_new_tokens, an abort) is taken back.
Every decode token of a step measured over `LONG_ITL_RATIO` (3, the goal's own factor; `itl_ratio` if
larger) x its decode step spends one, and a step may ignore the budget when its running decodes can
all be paid for. Over a busy period of requests that run to max_new_tokens, the steps the credit paid
for delay at most `stall_fraction` of the period's ITLs; a request that stops early can have lent
credit that a stall spent before the take-back, and the take-back's debt then blocks the period's
later stalls (the excess is at most the unearned grants of the requests live at the last stall).
Granted in advance, a busy period's first wave can pay for its prompts: served, the first request runs
alone and the others arrive while it runs, and with credit earned per decode token (D-26) the wave was
prefilled 10-30 tokens per step beside the 1-5 decodes then running, about half of the bound's
throughput loss; a whole-chunk step beside one decode is one long ITL. Credit is capped at
`STALL_CREDIT_WINDOW` ITLs' worth, so a deep queue does not bank a burst of stalls, and it restarts
from 0 when the engine goes idle (`end_busy_period`), so a short run cannot spend what an earlier one
earned. Measured served at 8 concurrent requests against no bound (D-26, three invocations in the idle
slot; today: docs/results.md, "ITL"): copy-heavy prompts +5.3, -4.2 and +8.4% output tok/s with P99 /
median ITL 1.28-1.36 (credit earned per decode token: -11..-13%), random ones -3.0, -5.4 and -13.1%
with 2.05-2.77; a run of 650 ITLs has 6.5 long ones to spend, and its P99 stays under 3x the median
only with at most 6.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Sequence

from jaxserve.core.batch import COST_WINDOW, pow2_at_least

# weight of the newest step in the moving average of seconds per prefill token: about the last ten count
EMA_WEIGHT = 0.1
# the stall credit never exceeds stall_fraction x this many ITLs (16 stalled tokens at 1%)
STALL_CREDIT_WINDOW = 1600
# the ITL goal (docs/results.md, "ITL"): P99 ITL at most 3x the median, so an ITL over 3x a
# decode step is a long one
LONG_ITL_RATIO = 3.0
# a bucket over the bound is tried again until it has this many steps (their median is its cost)
MIN_COST_STEPS = 3


class PrefillBudget:
    """Per-step prefill tokens beside running decodes (see the module docstring).

    Args:
        itl_ratio: the bound on a chunk step / a decode-only step (> 1); 0 turns the bound off.
        min_tokens: the least a step with decodes may prefill (prompts always progress).
        max_tokens: the most (the chunk size).
        stall_fraction: the share of ITLs (0 to 1) that long steps (`long_ratio`) may delay, granted
            per request in advance (`admit_request`, `finish_request`); 0: every step keeps the bound.
    """

    def __init__(self, itl_ratio: float, min_tokens: int, max_tokens: int, stall_fraction: float = 0.0):
        if not 0.0 <= stall_fraction < 1.0:
            raise ValueError(f"stall_fraction must be in [0, 1), got {stall_fraction}")
        self.itl_ratio = itl_ratio
        self.stall_fraction = stall_fraction
        self.stall_credit = 0.0  # decode tokens that a long step may still delay
        self.min_tokens = max(1, min(min_tokens, max_tokens))
        self.max_tokens = max_tokens
        # decode bucket -> seconds of its last decode-only steps; (decode bucket, extend bucket of the
        # whole step) -> seconds of its last steps with a chunk. Costs are their medians (COST_WINDOW).
        self._decode_steps: dict[int, collections.deque[float]] = {}
        self._mixed_steps: dict[tuple[int, int], collections.deque[float]] = {}
        self._seconds_per_token: float | None = None
        # request id -> (credit granted when it was queued, its max_new_tokens), until it finishes
        self._grants: dict[str, tuple[float, int]] = {}

    @property
    def enabled(self) -> bool:
        return self.itl_ratio > 0

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float, step_bucket: int | None = None,
                batch_size: int = 0) -> None:
        """Record one step: `num_decodes` decoding requests, `num_prefill_tokens` prompt tokens, wall
        seconds; `step_bucket`: the extend bucket (tokens) the step ran in, when it had a chunk;
        `batch_size`: the decode batch its bound referred to (`reference_seconds`)."""
        self._account_stall(num_decodes, num_prefill_tokens, seconds, batch_size)
        if num_prefill_tokens == 0:
            if num_decodes > 0:
                _record(self._decode_steps, pow2_at_least(num_decodes), seconds)
            return
        if num_decodes and step_bucket is not None:
            _record(self._mixed_steps, (pow2_at_least(num_decodes), step_bucket), seconds)
        base = self.decode_seconds(num_decodes) if num_decodes else 0.0
        per_token = max(seconds - (base or 0.0), 0.0) / num_prefill_tokens
        self._seconds_per_token = _ema(self._seconds_per_token, per_token)

    def _account_stall(self, num_decodes: int, num_prefill_tokens: int, seconds: float, batch_size: int) -> None:
        if not self._grants_credit or num_decodes == 0 or not num_prefill_tokens:
            return
        reference = self.reference_seconds(num_decodes, batch_size)
        # an unmeasured decode step counts the chunk step as long: the credit never pays less than it lost
        if reference is None or seconds > self.long_ratio * reference:
            self.stall_credit -= num_decodes  # each running decode waited one long ITL

    @property
    def _grants_credit(self) -> bool:
        return self.enabled and self.stall_fraction > 0

    def admit_request(self, rid: str, max_new_tokens: int) -> None:
        """A request entered the queue: it brings `stall_fraction` of a credit per ITL it may have
        (`max_new_tokens` - 1), up to the cap (`STALL_CREDIT_WINDOW`). Once per request: a retracted
        request queued again (same `rid`) brings nothing more."""
        if not self._grants_credit or rid in self._grants:
            return
        cap = self.stall_fraction * STALL_CREDIT_WINDOW
        grant = max(0.0, min(self.stall_fraction * max(0, max_new_tokens - 1), cap - self.stall_credit))
        self._grants[rid] = (grant, max_new_tokens)
        self.stall_credit += grant

    def finish_request(self, rid: str, num_output_tokens: int) -> None:
        """A request finished (or was aborted) after `num_output_tokens` tokens: the credit it was
        granted for ITLs it did not have (`max_new_tokens` - `num_output_tokens`) is taken back, up to
        what it was granted (a grant the cap cut takes back no more than it gave). Unknown `rid`s
        (never queued, or queued while the budget was off) are ignored."""
        entry = self._grants.pop(rid, None)
        if entry is None:
            return
        grant, max_new_tokens = entry
        unearned = self.stall_fraction * max(0, max_new_tokens - max(1, num_output_tokens))
        self.stall_credit -= min(grant, unearned)

    @property
    def long_ratio(self) -> float:
        """A step over this multiple of its decode step makes its decodes' ITLs long, and is charged to
        the stall credit: the P99 goal's own factor (`LONG_ITL_RATIO`), or the bound if that is larger.
        A bounded step that overshoots `itl_ratio` a little is not a long ITL by the goal's measure."""
        return max(self.itl_ratio, LONG_ITL_RATIO)

    def end_busy_period(self) -> None:
        """The engine has nothing to run: the stall credit starts again from 0, so that the steps of one
        busy period delay at most `stall_fraction` of that period's own ITLs. A credit banked
        earlier let a short run have more long ITLs than its share (the cap of 16 plus 1% of a
        2,032-ITL run, D-26); a debt from one period's first tries of unmeasured
        buckets is not held against the next. Every request has finished by then, so no grant is
        outstanding (any left, from a request that never reached `finish_request`, is dropped)."""
        self.stall_credit = 0.0
        self._grants.clear()

    def can_stall(self, num_decodes: int) -> bool:
        """Whether a step beside `num_decodes` running decodes may take a whole chunk, over the bound:
        the stall credit pays one long ITL for each of them (see the module docstring), and their
        decode step was measured (else the bound itself is unknown, and `budget` measures it first)."""
        return (self.enabled and self.stall_fraction > 0 and num_decodes > 0 and self.stall_credit >= num_decodes
                and self.decode_seconds(num_decodes) is not None)

    def decode_seconds(self, num_decodes: int) -> float | None:
        """Estimated seconds of a decode-only step of `num_decodes` requests (None before any was seen):
        the cost (`COST_WINDOW`) of the measured bucket, else that of the nearest smaller measured one."""
        key = pow2_at_least(num_decodes)
        if key in self._decode_steps:
            return statistics.median(self._decode_steps[key])
        smaller = [k for k in self._decode_steps if k < key]
        if smaller:
            return statistics.median(self._decode_steps[max(smaller)])  # a lower bound: more decodes never take less time
        return None

    def reference_seconds(self, num_decodes: int, batch_size: int = 0) -> float | None:
        """The decode step that the bound multiplies (seconds; None before any was measured): that of
        `batch_size` decodes when it is larger than `num_decodes`. The scheduler passes the batch the
        running decodes will have once the requests now prefilling or waiting join them: the ITL the
        streams see in steady state, which is what the P99 goal compares with, where the step of the
        few decodes left running during a wave of admissions is much shorter (measured at 8
        concurrent copy-heavy requests: 4 decodes beside 32-token chunks were 3.1x their own decode
        step and 2.4x that of 8, so they were cut to 16-token chunks at 3.9 ms per prompt token
        against 2.5, D-25)."""
        return self.decode_seconds(max(num_decodes, batch_size))

    def budget(self, num_decodes: int, batch_size: int = 0) -> int:
        """Prefill tokens a step beside `num_decodes` running decodes may take: `max_tokens` when the
        bound is off or no decode runs; 0 while no decode-only step of this decode bucket has been
        measured, so the scheduler runs one and measures it (steps with a chunk never show the decode
        cost alone, and a smaller bucket's step is only a lower bound: measured, charging chunk steps
        against it put a whole wave of admissions in debt); `min_tokens` while no prefill has been
        measured."""
        if not self.enabled or num_decodes == 0:
            return self.max_tokens
        if pow2_at_least(num_decodes) not in self._decode_steps:
            return 0
        if self._seconds_per_token is None:
            return self.min_tokens
        if self._seconds_per_token <= 0:
            return self.max_tokens
        decode = self.reference_seconds(num_decodes, batch_size)
        tokens = math.floor((self.itl_ratio - 1) * decode / self._seconds_per_token)
        return max(self.min_tokens, min(self.max_tokens, tokens))

    def mixed_seconds(self, num_decodes: int, step_bucket: int) -> float | None:
        """Estimated seconds of a step of `num_decodes` decodes filled to `step_bucket` tokens: the cost
        (`COST_WINDOW`) of such steps, None if none was measured."""
        steps = self._mixed_steps.get((pow2_at_least(num_decodes), step_bucket))
        return statistics.median(steps) if steps else None

    def step_tokens(self, num_decodes: int, cap: int, buckets: Sequence[int], batch_size: int = 0) -> int:
        """Tokens of a step that runs `num_decodes` decodes beside up to `cap` prefill tokens (`budget`),
        filled up to an extend bucket of `buckets` (ascending): a step costs its bucket, padding
        included. The bucket of num_decodes + cap, unless its cost (`mixed_seconds`) is over the bound
        (`itl_ratio` x `reference_seconds`); then the largest smaller bucket that holds a prefill
        token and is not. A bucket is judged on at least `MIN_COST_STEPS` steps, so that one unlucky
        step does not shut out a bucket near the bound for the server's lifetime (measured: the
        32-token bucket beside 8 decodes, 2.2x a decode step, once at 2.8x, after which only 16-token
        steps ran); until then it is tried when the buckets below allow a first try
        (`_first_try_fits`), from the bottom up: a first try beside 7 decodes over 3x their step is 7
        long ITLs, and first tries of the 64-token bucket straight from the budget's estimate gave 11
        of a 650-ITL run's 17, from the line through the two buckets
        below 7 of 22 in a served copy-heavy run (D-25). Measured at 8 concurrent requests: the linear
        per-token estimate and the 32-token minimum put 7 decodes + 57 prefill tokens into the
        64-token bucket, 3.5x a decode step."""
        up = next((t for t in buckets if t >= num_decodes + cap), num_decodes + cap)
        if not self.enabled or self.decode_seconds(num_decodes) is None:
            return up
        reference = self.reference_seconds(num_decodes, batch_size)
        limit = self.itl_ratio * reference
        candidates = [t for t in buckets if num_decodes < t <= up] or [up]
        for i in reversed(range(len(candidates))):
            t, cost = candidates[i], self.mixed_seconds(num_decodes, candidates[i])
            if cost is not None and cost <= limit:
                return t
            num_steps = len(self._mixed_steps.get((pow2_at_least(num_decodes), t), ()))
            if num_steps < MIN_COST_STEPS and self._first_try_fits(num_decodes, candidates[:i], t, limit):
                return t
        return candidates[0]  # every bucket is over the bound: the smallest, so that prompts progress


    def _first_try_fits(self, num_decodes: int, below: Sequence[int], bucket: int, limit: float) -> bool:
        """Whether an unmeasured `bucket` may be tried: the smallest always; the next one when the one
        below keeps the bound; a larger one when the prefill part of the largest bucket below (its cost
        less the decode step of `num_decodes`), scaled in proportion to the tokens, keeps the bound at
        `bucket` too. Proportion over-estimates a larger bucket (seconds per prompt token fall with the
        bucket: 3.2 ms at 32 and 64 tokens, 2.5 at 128, 1.7-2.1 at 512, D-25), so a first
        try that is over the bound is rare. The line through the two buckets below, the rule before, was
        under: beside 7 decodes the 16- and 32-token buckets took 107 and 141 ms, the line said 208 ms
        at 64 tokens, it measured 240 (served, 7 long ITLs per such try, D-25); proportion
        says 60 + 2 x 81 = 222 ms."""
        if not below:
            return True
        cost = self.mixed_seconds(num_decodes, below[-1])
        if cost is None or cost > limit:
            return False
        if len(below) < 2:
            return True
        decode = self.decode_seconds(num_decodes) or 0.0
        return decode + max(cost - decode, 0.0) * bucket / below[-1] <= limit


def _record(steps: dict, key, seconds: float) -> None:
    steps.setdefault(key, collections.deque(maxlen=COST_WINDOW)).append(seconds)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new
