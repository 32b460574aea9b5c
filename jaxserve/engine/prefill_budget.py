"""The prefill token budget of a step that also runs decodes, sized from measured step times.

A step that prefills a chunk beside running decodes delays every one of those decodes' next token
by the chunk's cost. `PrefillBudget` keeps that delay bounded: a step with a chunk may take at most
`itl_ratio` times a decode-only step of the same batch, so its prefill tokens are

    budget(n) = (itl_ratio - 1) x decode_seconds(n) / prefill_seconds_per_token

clamped to [min_tokens, max_tokens], from exponential moving averages of what the steps took:
decode_seconds per decode bucket (the power of two of the running batch, which is what the compiled
step costs), and the marginal seconds per prefill token of steps that had a chunk. The more decodes
run, the longer a decode step and the larger the chunk they can absorb. Issue 20 measured a
512-token chunk holding 8 decodes for ~2.5 s against ~120 ms decode steps (P99 / median ITL 1037 /
118 ms); the bound makes that ratio a setting (`--prefill-decode-itl-ratio`).

The goal is a bound on the P99 ITL, not on every ITL, so a few steps may exceed it: the stall
allowance (`stall_fraction`, `--prefill-decode-stall-fraction`) lets a step take a whole chunk while
the steps measured over the bound have delayed at most that fraction of all decode tokens. It is a
token bucket (the idea of a leaky-bucket rate limiter, applied to latency-SLO error budgets): every
decode token earns `stall_fraction` of a credit, every decode token of a step measured over
`LONG_ITL_RATIO` (3, the goal's own factor; `itl_ratio` if larger) x its decode step spends one, and
a step may ignore the budget when its running decodes can all be paid for. Credit is capped at
`STALL_CREDIT_WINDOW` decode tokens' worth, so a long quiet spell does not bank a burst of stalls,
and its positive part is dropped when the engine goes idle (`end_busy_period`), so a short run
cannot spend what an earlier one earned. Measured at 8 concurrent requests (docs/benchmarks.md,
idle slot): +7% output tok/s on random prompts and +2% on copy-heavy ones over the bound alone, P99 /
median ITL ~2.2; random prompts stay ~15% under no budget, because their short outputs give the run
too few ITLs to pay for a stall per admission.
"""

from __future__ import annotations

import math
from typing import Sequence

# weight of the newest step in the moving averages: about the last ten steps count
EMA_WEIGHT = 0.1
# the stall credit never exceeds stall_fraction x this many decode tokens (16 stalled tokens at 1%)
STALL_CREDIT_WINDOW = 1600
# issue 20's goal: P99 ITL at most 3x the median, so an ITL over 3x a decode step is a long one
LONG_ITL_RATIO = 3.0


class PrefillBudget:
    """Per-step prefill tokens beside running decodes (see the module docstring).

    Args:
        itl_ratio: the bound on a chunk step / a decode-only step (> 1); 0 turns the bound off.
        min_tokens: the least a step with decodes may prefill (prompts always progress).
        max_tokens: the most (the chunk size).
        stall_fraction: the share of decode tokens (0 to 1) that steps over the bound may delay; 0:
            every step keeps the bound.
    """

    def __init__(self, itl_ratio: float, min_tokens: int, max_tokens: int, stall_fraction: float = 0.0):
        if not 0.0 <= stall_fraction < 1.0:
            raise ValueError(f"stall_fraction must be in [0, 1), got {stall_fraction}")
        self.itl_ratio = itl_ratio
        self.stall_fraction = stall_fraction
        self.stall_credit = 0.0  # decode tokens that a step over the bound may still delay
        self.min_tokens = max(1, min(min_tokens, max_tokens))
        self.max_tokens = max_tokens
        self._decode_seconds: dict[int, float] = {}  # decode bucket -> EMA seconds of a decode-only step
        self._seconds_per_token: float | None = None
        # (decode bucket, extend bucket of the whole step) -> EMA of a step with a chunk over the decode
        # step's estimate at that time: a ratio, so that a slower machine (both grow) leaves it unchanged
        self._mixed_ratio: dict[tuple[int, int], float] = {}

    @property
    def enabled(self) -> bool:
        return self.itl_ratio > 0

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float, step_bucket: int | None = None) -> None:
        """Record one step: `num_decodes` decoding requests, `num_prefill_tokens` prompt tokens, wall
        seconds; `step_bucket`: the extend bucket (tokens) the step ran in, when it had a chunk."""
        self._account_stall(num_decodes, num_prefill_tokens, seconds)
        if num_prefill_tokens == 0:
            if num_decodes > 0:
                key = _bucket(num_decodes)
                self._decode_seconds[key] = _ema(self._decode_seconds.get(key), seconds)
            return
        base = self.decode_seconds(num_decodes) if num_decodes else 0.0
        if num_decodes and step_bucket is not None and base:
            key = (_bucket(num_decodes), step_bucket)
            self._mixed_ratio[key] = _ema(self._mixed_ratio.get(key), seconds / base)
        per_token = max(seconds - (base or 0.0), 0.0) / num_prefill_tokens
        self._seconds_per_token = _ema(self._seconds_per_token, per_token)

    def _account_stall(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        if not self.enabled or self.stall_fraction <= 0 or num_decodes == 0:
            return
        cap = self.stall_fraction * STALL_CREDIT_WINDOW
        self.stall_credit = min(cap, self.stall_credit + self.stall_fraction * num_decodes)
        decode = self.decode_seconds(num_decodes)
        # an unmeasured decode step counts the chunk step as long: the credit never pays less than it lost
        if num_prefill_tokens and (decode is None or seconds > self.long_ratio * decode):
            self.stall_credit -= num_decodes  # each running decode waited one long ITL

    @property
    def long_ratio(self) -> float:
        """A step over this multiple of its decode step makes its decodes' ITLs long, and is charged to
        the stall credit: the P99 goal's own factor (`LONG_ITL_RATIO`), or the bound if that is larger.
        A bounded step that overshoots `itl_ratio` a little is not a long ITL by the goal's measure."""
        return max(self.itl_ratio, LONG_ITL_RATIO)

    def end_busy_period(self) -> None:
        """The engine has nothing to run: a positive stall credit is dropped (a debt stays), so that the
        steps of one busy period delay at most `stall_fraction` of that period's own decode tokens. A
        credit banked earlier let a short run have more long ITLs than its share: measured, the cap of
        16 plus 1% of a 2,032-ITL run (docs/benchmarks.md)."""
        self.stall_credit = min(self.stall_credit, 0.0)

    def can_stall(self, num_decodes: int) -> bool:
        """Whether a step beside `num_decodes` running decodes may take a whole chunk, over the bound:
        the stall credit pays one long ITL for each of them (see the module docstring), and their
        decode step was measured (else the bound itself is unknown, and `budget` measures it first)."""
        return (self.enabled and self.stall_fraction > 0 and num_decodes > 0 and self.stall_credit >= num_decodes
                and self.decode_seconds(num_decodes) is not None)

    def decode_seconds(self, num_decodes: int) -> float | None:
        """Estimated seconds of a decode-only step of `num_decodes` requests (None before any was seen):
        the measured bucket, else the nearest smaller measured one scaled by the batch ratio."""
        key = _bucket(num_decodes)
        if key in self._decode_seconds:
            return self._decode_seconds[key]
        smaller = [k for k in self._decode_seconds if k < key]
        if smaller:
            return self._decode_seconds[max(smaller)]  # a lower bound: more decodes never take less time
        return None

    def budget(self, num_decodes: int) -> int:
        """Prefill tokens a step beside `num_decodes` running decodes may take: `max_tokens` when the
        bound is off or no decode runs; 0 while no decode-only step of this batch size (or a smaller
        one) has been measured, so the scheduler runs one and measures it (steps with a chunk never
        show the decode cost alone); `min_tokens` while no prefill has been measured."""
        if not self.enabled or num_decodes == 0:
            return self.max_tokens
        decode = self.decode_seconds(num_decodes)
        if decode is None:
            return 0
        if self._seconds_per_token is None:
            return self.min_tokens
        if self._seconds_per_token <= 0:
            return self.max_tokens
        tokens = math.floor((self.itl_ratio - 1) * decode / self._seconds_per_token)
        return max(self.min_tokens, min(self.max_tokens, tokens))


    def step_tokens(self, num_decodes: int, cap: int, buckets: Sequence[int]) -> int:
        """Tokens of a step that runs `num_decodes` decodes beside up to `cap` prefill tokens (`budget`),
        filled up to an extend bucket of `buckets` (ascending): a step costs its bucket, padding
        included. The bucket of num_decodes + cap, unless steps in it measured over the bound; then
        the largest smaller bucket that holds a prefill token and did not measure over it. Measured at
        8 concurrent requests: the linear per-token estimate and the 32-token minimum put 7 decodes +
        57 prefill tokens into the 64-token bucket, 3.5x a decode step (docs/benchmarks.md). A bucket
        is judged by its steps' moving average over the decode step's estimate at the time (a ratio),
        not by seconds against today's bound: a rise of the decode average (a slower spell of the
        machine) then does not re-admit a bucket that measured over the bound."""
        up = next((t for t in buckets if t >= num_decodes + cap), num_decodes + cap)
        if not self.enabled or self.decode_seconds(num_decodes) is None:
            return up
        key = _bucket(num_decodes)
        candidates = [t for t in buckets if num_decodes < t <= up] or [up]
        for t in reversed(candidates):
            measured = self._mixed_ratio.get((key, t))
            if measured is None or measured <= self.itl_ratio:
                return t
        return candidates[0]  # every bucket is over the bound: the smallest, so that prompts progress


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new
