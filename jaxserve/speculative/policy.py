"""When speculation pays: a per-request draft decision from measured step costs and acceptance.

Verifying a draft costs the step more tokens; it pays when the tokens it is expected to add are worth
more than that. With, from the steps the engine has run (step costs: medians of the last `COST_WINDOW`;
acceptance: exponential moving averages):

    decode(B)  seconds of a decode-only step of B requests (per power-of-two bucket of B),
    c          marginal seconds per verified draft token: (verify step - decode(B)) / draft tokens,
    a_i        request i's accepted draft tokens per verification,

a decode-only step of B requests produces one token per request in decode(B) seconds, so a token is
worth decode(B) / B seconds of the batch's time, and request i's draft of k_i tokens is verified only if

    a_i x decode(B) / B  >=  k_i x c.

The rule is the break-even of a verification measured on the running hardware: on the default model at
batch 1 on 2 CPU cores (decode ~29 ms, ~3 ms per verified draft token), a 15-token draft (the NGRAM
default) is verified when it is expected to be accepted for more than about 1.5 tokens (D-30); at 8
concurrent random prompts (accept ~1.4 tokens per verification) drafts stop, on copy-heavy ones (~4.6)
they do not. A request whose drafts are off is probed again (its draft verified anyway) after
`probe_steps` decode steps, doubling after each failed probe up to `MAX_PROBE_STEPS` and reset by an
accepted one, so that a request whose text turns repetitive gets its drafts back. Unmeasured costs
favour trying: no decode-only step of the batch size yet -> plain decoding (it measures decode(B)); no
verification yet -> verify. Outputs are exact either way: this changes only which steps verify drafts.

a_i is kept per class of the draft's n-gram match length (`match_class`: 1, 2-3, 4-7, 8+ tokens; the
radix tree's continuations of the exact prefix count as the longest class), a class seen for the
first time being tried: one request's text mixes passages it copies (long matches, long accepts) with
new text (short matches that fail), and a single average learned on one phase refused the other's
drafts (D-30). Drafts from other requests' text (the
cross-request `NgramStore`) are classes of their own, learned over all requests together (a dict
the speculator shares between requests): at the same match length they accepted far less than a
request's own matches (copy-heavy prompts, 4-7 tokens: 1.7 against 10-15 per verification), and a
request meets too few of them to learn their worth alone (D-31).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

from jaxserve.core.batch import COST_WINDOW, pow2_at_least

# weight of the newest observation in the moving averages of acceptance
ACCEPT_EMA_WEIGHT = 0.5
MIN_PROBE_STEPS = 8
MAX_PROBE_STEPS = 128


@dataclasses.dataclass
class DraftState:
    """One request's acceptance history: `accept_ema` accepted tokens per verification (None before its
    first), used for drafts of unknown match length; `accept_by_class` the same per `match_class`;
    `match_len` the match length of the request's latest draft (None: unknown, e.g. a draft from
    elsewhere); `is_from_store` whether that draft came from other requests' text, whose classes are
    kept in `store_accept_by_class` (shared by all requests: the speculator passes one dict);
    `num_skipped` decode steps since its last verification; `probe_steps` the current back-off."""

    accept_ema: float | None = None
    num_skipped: int = 0
    probe_steps: int = MIN_PROBE_STEPS
    match_len: int | None = None
    accept_by_class: dict[int, float] = dataclasses.field(default_factory=dict)
    is_from_store: bool = False
    store_accept_by_class: dict[int, float] = dataclasses.field(default_factory=dict)

    def expected_accept(self) -> float | None:
        """The accepted tokens expected of the latest draft (None: nothing learned for its class)."""
        if self.match_len is None:
            return self.accept_ema
        return self._classes().get(match_class(self.match_len))

    def _classes(self) -> dict[int, float]:
        return self.store_accept_by_class if self.is_from_store else self.accept_by_class


def match_class(match_len: int) -> int:
    """Class of an n-gram match length: 1 -> 1, 2-3 -> 2, 4-7 -> 3, 8 and more -> 4."""
    return min(max(match_len, 1).bit_length(), 4)


class StepCosts:
    """Decode-only step seconds per batch bucket and the marginal seconds per verified draft token (see
    the module docstring), each the median of its last `COST_WINDOW` observations (the prefill
    budget's window): one slow step (the first verification after start-up took 1.7x the next ones;
    a GC pause; another process's burst) does not move it, where a moving average stayed high for
    several steps and the drafts it refused meanwhile made no verification to bring it down; a
    lasting change does."""

    def __init__(self) -> None:
        self._decode: dict[int, collections.deque[float]] = {}
        self._per_draft_token: collections.deque[float] = collections.deque(maxlen=COST_WINDOW)

    def observe_decode(self, num_reqs: int, seconds: float) -> None:
        self._decode.setdefault(pow2_at_least(num_reqs), collections.deque(maxlen=COST_WINDOW)).append(seconds)

    def observe_verify(self, num_reqs: int, num_draft_tokens: int, seconds: float) -> None:
        """A verification step of `num_reqs` requests with `num_draft_tokens` drafts in all."""
        decode = self.decode_seconds(num_reqs)
        if decode is None or num_draft_tokens == 0:
            return
        self._per_draft_token.append(max(seconds - decode, 0.0) / num_draft_tokens)

    @property
    def seconds_per_draft_token(self) -> float | None:
        return statistics.median(self._per_draft_token) if self._per_draft_token else None

    def decode_seconds(self, num_reqs: int) -> float | None:
        steps = self._decode.get(pow2_at_least(num_reqs))
        return statistics.median(steps) if steps else None


class DraftPolicy:
    """Decides per request and step whether its draft is verified (see the module docstring).

    Args:
        adaptive: False verifies every draft (`--disable-speculative-adaptive`).
    """

    def __init__(self, adaptive: bool = True):
        self.adaptive = adaptive
        self.costs = StepCosts()

    def can_speculate(self, num_reqs: int) -> bool:
        """False while no decode-only step of this batch bucket was measured (run one first)."""
        return not self.adaptive or self.costs.decode_seconds(num_reqs) is not None

    def wants_draft(self, state: DraftState, num_reqs: int, draft_len: int) -> bool:
        """Whether a request with `state` verifies a `draft_len`-token draft in a step of `num_reqs`
        decodes. A refused request counts the step toward its next probe."""
        expected = state.expected_accept()
        if not self.adaptive or expected is None or draft_len == 0:
            return True
        decode, per_token = self.costs.decode_seconds(num_reqs), self.costs.seconds_per_draft_token
        if decode is None or per_token is None:
            return True
        if expected * decode / num_reqs >= draft_len * per_token:
            return True
        if state.num_skipped >= state.probe_steps:
            return True
        state.num_skipped += 1
        return False

    def record(self, state: DraftState, num_draft: int, num_accepted: int) -> None:
        """A verification of a `num_draft`-token draft accepted `num_accepted`."""
        if num_draft == 0:
            return
        was_probe = state.num_skipped >= state.probe_steps
        state.accept_ema = _ema(state.accept_ema, float(num_accepted), ACCEPT_EMA_WEIGHT)
        if state.match_len is not None:
            cls, classes = match_class(state.match_len), state._classes()
            classes[cls] = _ema(classes.get(cls), float(num_accepted), ACCEPT_EMA_WEIGHT)
        state.num_skipped = 0
        if was_probe:  # back off further after a failed probe; start over after an accepted one
            state.probe_steps = MIN_PROBE_STEPS if num_accepted else min(2 * state.probe_steps, MAX_PROBE_STEPS)


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new
