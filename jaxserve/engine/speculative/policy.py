"""How many draft tokens to verify: per request and step, the length that gives the most tokens per second.

A verification step does not cost decode(B) plus a price per draft token: the model runner pads the
step's tokens to a power-of-two bucket, and the jump from a decode step to any verification is most
of the cost (default model, batch 1, 512 cached tokens, 2 CPU cores, `scripts/bench_verify.py`: decode
31.7 ms, 4-token bucket 55.3, 8-token 61.0, 16-token 67.9-72.6 ms; docs/benchmarks.md, issue 20's
third pass). So the policy keeps,
from the steps the engine runs (exponential moving averages, `StepCosts`):

    cost(B, 0)  seconds of a decode-only step of B requests (per power-of-two bucket of B),
    cost(B, T)  seconds of a verification step of B requests and T tokens in all (per power-of-two
                bucket of B and of T: the runner's extend buckets up to 128 tokens; above, its 1.5x
                midpoints share the key of the power of two above them),

and per class of draft the distribution of A, the tokens a verification accepts of a draft long
enough (`AcceptCounts`: decayed survival counts P(A >= j), Kaplan-Meier with forgetting, since a
draft of k tokens that is accepted whole says only A >= k). A request's draft of d tokens is cut to
the k in 0..d (0: no draft, the step stays a plain decode for it) that maximises the step's
expected tokens per second,

    (N + E[min(A, k)]) / cost(B, D + k),        E[min(A, k)] = sum_{j <= k} P(A >= j),

where N is the step's expected tokens so far (one per request, plus the expected accepts of the
drafts decided before this one) and D its draft tokens so far (`StepPlan`): at batch 1,
(1 + E[min(A, k)]) / cost(1, k). In a step of several requests the drafts are decided in the
batch's order, each against the step as the requests before it left it (its marginal cost: a
draft that pushes the step into a larger bucket pays that bucket's whole step), and never revisited:
exact at batch 1, greedy above.

Unmeasured things are tried: a class of draft never verified gets its whole draft; a step bucket
never measured is costed at cost(B, 0), the least any step of B requests costs, so it is chosen
(and measured) whenever it could be the best; before any decode-only step of B requests, no draft
(that step measures cost(B, 0)). A request whose chosen length is 0 is probed again (its whole
draft verified anyway) after `probe_steps` such steps, doubling after each failed probe up to
`MAX_PROBE_STEPS` and reset by an accepted one, so that a request whose text turns repetitive gets
its drafts back. Outputs are exact whatever is chosen: this changes only which tokens are verified.

Classes: a draft's n-gram match length (`match_class`: 1, 2-3, 4-7, 8+ tokens; the radix tree's
continuations of the exact prefix count as the longest class), since one request's text mixes
passages it copies (long matches, long accepts) with new text (short matches that fail), and a
single average learned on one phase refused the other's drafts (docs/benchmarks.md, issue 20's third
pass). Drafts from other requests' text (the cross-request `NgramStore`) are classes of their own,
learned over all requests together (a dict the speculator shares between requests): at the same
match length they accepted far less than a request's own matches (copy-heavy prompts, 4-7 tokens:
1.7 against 10-15 per verification), and a request meets too few of them to learn their worth alone
(docs/benchmarks.md, issue 20's fourth pass).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

# weight of the newest step in the moving averages of step costs
COST_EMA_WEIGHT = 0.2
# weight an older verification keeps in `AcceptCounts` at each newer one (memory ~20 verifications:
# with 0.8, ~5, copy-heavy TPOT at one request was 10.1-12.1 ms against 9.2-10.0 with 0.95 and
# main's 9.6-9.8; docs/benchmarks.md, issue 20's fifth pass)
ACCEPT_DECAY = 0.95
# below this decayed weight a draft position counts as untested (its pass rate is extrapolated)
MIN_AT_RISK = 0.05
MIN_PROBE_STEPS = 8
MAX_PROBE_STEPS = 128


class AcceptCounts:
    """Decayed survival counts of one class's accepted draft lengths.

    For draft position j (1-based), `at_risk[j-1]` is the decayed number of verifications that tested
    it (draft length >= j and the j - 1 before it accepted) and `passed[j-1]` those that accepted it.
    P(A >= j) is the product of the pass rates up to j (the Kaplan-Meier estimator; Kaplan & Meier
    1958), each older verification weighted down by ACCEPT_DECAY per newer one. A position no
    verification tested lately (weight < MIN_AT_RISK: none in the last ~58) takes the pass rate of
    the last one tested, so the lengths a request's drafts are cut short of are retried now and then.
    """

    def __init__(self) -> None:
        self.at_risk = np.zeros(0)
        self.passed = np.zeros(0)

    def record(self, num_draft: int, num_accepted: int) -> None:
        """A verification of a `num_draft`-token draft accepted `num_accepted` of them."""
        if num_draft <= 0:
            return
        if num_draft > len(self.at_risk):
            grow = num_draft - len(self.at_risk)
            self.at_risk, self.passed = np.pad(self.at_risk, (0, grow)), np.pad(self.passed, (0, grow))
        self.at_risk *= ACCEPT_DECAY
        self.passed *= ACCEPT_DECAY
        self.at_risk[: min(num_accepted + 1, num_draft)] += 1.0
        self.passed[:num_accepted] += 1.0

    def survival(self, num_draft: int) -> np.ndarray:
        """P(A >= j) for j = 1..num_draft, [num_draft] floats (all 0 before any verification)."""
        rate, last = np.zeros(num_draft), 0.0
        for j in range(num_draft):
            if j < len(self.at_risk) and self.at_risk[j] >= MIN_AT_RISK:
                last = self.passed[j] / self.at_risk[j]
            rate[j] = last  # an untested position: the last tested one's rate
        return np.cumprod(rate)

    def mean(self, num_draft: int) -> float:
        """E[min(A, num_draft)]: the accepted tokens expected of a `num_draft`-token draft."""
        return float(self.survival(num_draft).sum())


@dataclasses.dataclass
class DraftState:
    """One request's acceptance history: `accept` over all its drafts (for drafts of unknown match
    length), `accept_by_class` per `match_class` of its own matches; `match_len` the match length of
    its latest draft (None: unknown, e.g. a draft from elsewhere); `is_from_store` whether that draft
    came from other requests' text, whose classes are `store_accept_by_class` (shared by all requests:
    the speculator passes one dict); `num_skipped` steps since its last verification whose chosen
    length was 0; `probe_steps` the current back-off; `store_fed_len` how many of its tokens the
    cross-request store holds and `store_owner` its id there (`NgramSpeculator`)."""

    accept: AcceptCounts = dataclasses.field(default_factory=AcceptCounts)
    num_skipped: int = 0
    probe_steps: int = MIN_PROBE_STEPS
    match_len: int | None = None
    accept_by_class: dict[int, AcceptCounts] = dataclasses.field(default_factory=dict)
    is_from_store: bool = False
    store_accept_by_class: dict[int, AcceptCounts] = dataclasses.field(default_factory=dict)
    store_fed_len: int = 0
    store_owner: int = 0

    def accept_counts(self) -> AcceptCounts | None:
        """The counts that predict the latest draft (None: its class was never verified)."""
        if self.match_len is None:
            return self.accept if len(self.accept.at_risk) else None
        return self._classes().get(match_class(self.match_len))

    def _classes(self) -> dict[int, AcceptCounts]:
        return self.store_accept_by_class if self.is_from_store else self.accept_by_class


def match_class(match_len: int) -> int:
    """Class of an n-gram match length: 1 -> 1, 2-3 -> 2, 4-7 -> 3, 8 and more -> 4."""
    return min(max(match_len, 1).bit_length(), 4)


class StepCosts:
    """Moving averages of step seconds: decode-only steps per batch bucket, verification steps per
    (batch bucket, token bucket) (see the module docstring)."""

    def __init__(self) -> None:
        self._decode: dict[int, float] = {}
        self._verify: dict[tuple[int, int], float] = {}

    def observe_decode(self, num_reqs: int, seconds: float) -> None:
        key = _bucket(num_reqs)
        self._decode[key] = _ema(self._decode.get(key), seconds, COST_EMA_WEIGHT)

    def observe_verify(self, num_reqs: int, num_tokens: int, seconds: float) -> None:
        """A verification step of `num_reqs` requests and `num_tokens` tokens (last tokens + drafts)."""
        key = (_bucket(num_reqs), _bucket(num_tokens))
        self._verify[key] = _ema(self._verify.get(key), seconds, COST_EMA_WEIGHT)

    def decode_seconds(self, num_reqs: int) -> float | None:
        return self._decode.get(_bucket(num_reqs))

    def step_seconds(self, num_reqs: int, num_draft_tokens: int) -> float | None:
        """Seconds of a step of `num_reqs` requests with `num_draft_tokens` drafts in all: a decode
        step when 0, else a verification of num_reqs + num_draft_tokens tokens (None: unmeasured)."""
        if num_draft_tokens == 0:
            return self.decode_seconds(num_reqs)
        return self._verify.get((_bucket(num_reqs), _bucket(num_reqs + num_draft_tokens)))


@dataclasses.dataclass
class StepPlan:
    """The drafts of one step decided so far: `num_reqs` requests, `num_draft_tokens` draft tokens
    kept and `expected_accepted` the accepted tokens expected of them."""

    num_reqs: int
    num_draft_tokens: int = 0
    expected_accepted: float = 0.0

    @property
    def expected_tokens(self) -> float:
        """Tokens the step is expected to emit: one per request + the expected accepts."""
        return self.num_reqs + self.expected_accepted

    def add(self, choice: "DraftChoice") -> None:
        self.num_draft_tokens += choice.num_tokens
        self.expected_accepted += choice.expected_accepted


class DraftChoice(NamedTuple):
    """A request's draft length for a step (tokens, 0 = none) and its expected accepted tokens."""

    num_tokens: int
    expected_accepted: float


class DraftPolicy:
    """Chooses per request and step how many draft tokens it verifies (see the module docstring).

    Args:
        adaptive: False verifies every draft whole (`--disable-speculative-adaptive`).
    """

    def __init__(self, adaptive: bool = True):
        self.adaptive = adaptive
        self.costs = StepCosts()

    def can_speculate(self, num_reqs: int) -> bool:
        """False while no decode-only step of this batch bucket was measured (run one first)."""
        return not self.adaptive or self.costs.decode_seconds(num_reqs) is not None

    def plan(self, num_reqs: int) -> StepPlan:
        """An empty plan for a step of `num_reqs` decoding requests."""
        return StepPlan(num_reqs)

    def choose(self, state: DraftState, plan: StepPlan, draft_len: int) -> DraftChoice:
        """How many of a `draft_len`-token draft a request with `state` verifies in the step `plan`
        describes (the caller adds the choice to the plan once the draft's pages are in place).
        A choice of 0 with a draft counts the step toward the request's next probe."""
        counts = state.accept_counts()
        if not self.adaptive or draft_len <= 0 or counts is None:
            return DraftChoice(max(draft_len, 0), 0.0)
        floor = self.costs.decode_seconds(plan.num_reqs)
        if floor is None:
            return DraftChoice(draft_len, counts.mean(draft_len))
        survival = counts.survival(draft_len)
        gains = np.concatenate(([0.0], np.cumsum(survival)))  # E[min(A, k)], k = 0..d
        num_useful = int(np.count_nonzero(survival > 0))  # past it a longer draft adds nothing
        best = DraftChoice(0, 0.0)
        best_rate = plan.expected_tokens / (self.costs.step_seconds(plan.num_reqs, plan.num_draft_tokens) or floor)
        for lo, hi in _bucket_ranges(plan.num_reqs + plan.num_draft_tokens, draft_len):
            k = max(lo, min(hi, num_useful))  # the shortest of the bucket's best lengths
            cost = self.costs.step_seconds(plan.num_reqs, plan.num_draft_tokens + k) or floor
            rate = (plan.expected_tokens + gains[k]) / cost
            if rate > best_rate:
                best, best_rate = DraftChoice(k, float(gains[k])), rate
        if best.num_tokens:
            return best
        if state.num_skipped >= state.probe_steps:
            return DraftChoice(draft_len, float(gains[-1]))
        state.num_skipped += 1
        return best

    def record(self, state: DraftState, num_draft: int, num_accepted: int) -> None:
        """A verification of a `num_draft`-token draft accepted `num_accepted`."""
        if num_draft == 0:
            return
        was_probe = state.num_skipped >= state.probe_steps
        state.accept.record(num_draft, num_accepted)
        if state.match_len is not None:
            state._classes().setdefault(match_class(state.match_len), AcceptCounts()).record(num_draft, num_accepted)
        state.num_skipped = 0
        if was_probe:  # back off further after a failed probe; start over after an accepted one
            state.probe_steps = MIN_PROBE_STEPS if num_accepted else min(2 * state.probe_steps, MAX_PROBE_STEPS)


def _bucket_ranges(num_tokens: int, draft_len: int) -> list[tuple[int, int]]:
    """The draft lengths 1..draft_len grouped by the power-of-two bucket that a step of `num_tokens`
    tokens + the draft lands in, as (shortest, longest) pairs: within one bucket every length costs
    the same, so only the bucket's longest useful one can be the best."""
    out, lo, t = [], 1, _bucket(num_tokens + 1)
    while lo <= draft_len:
        hi = min(t - num_tokens, draft_len)
        out.append((lo, hi))
        lo, t = hi + 1, 2 * t
    return out


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new
