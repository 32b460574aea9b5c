"""The adaptive draft policy of speculative decoding: drafts stop where they do not pay and come back.

The policy is tested in pure Python with given step costs, and in the engine with drafts from an
oracle (the plain-decoding output, so every draft is accepted) or deliberately wrong ones, with fixed
step costs in place of the measured ones so that nothing depends on the machine's speed. The
reference for the outputs is plain decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine.engine import Engine
from jaxserve.engine.speculative import AcceptCounts, DraftPolicy, DraftState
from jaxserve.engine.speculative.policy import ACCEPT_DECAY, MAX_PROBE_STEPS, MIN_PROBE_STEPS, StepPlan, match_class

DECODE_S = 0.030  # a batch-1 decode step
# verification step seconds by token bucket at batch 1, as factors of DECODE_S (the shape measured
# by bench_verify: the jump to any verification is most of the cost)
VERIFY_FACTORS = {2: 1.7, 4: 1.75, 8: 1.9, 16: 2.2}


def measured_policy(decode=DECODE_S, factors=VERIFY_FACTORS, num_reqs=1) -> DraftPolicy:
    policy = DraftPolicy()
    policy.costs.observe_decode(num_reqs, decode)
    for tokens, f in factors.items():
        policy.costs.observe_verify(num_reqs, tokens, f * decode)
    return policy


def state_with(history, match_len=12) -> DraftState:
    """A request whose drafts of `match_len`'s class had (num_draft, num_accepted) `history`."""
    state = DraftState(match_len=match_len)
    counts = AcceptCounts()
    for num_draft, num_accepted in history:
        counts.record(num_draft, num_accepted)
    state.accept_by_class[match_class(match_len)] = counts
    return state


def brute_force_best_len(survival, draft_len, step_seconds, num_reqs=1, num_draft_tokens=0, expected=None):
    """argmax over k = 0..draft_len of (N + sum_{j<=k} P(A >= j)) / cost, the smallest k on a tie;
    cost = step_seconds[token bucket of the step] with the bucket found by search, decode when no
    draft token is in the step."""
    n = num_reqs if expected is None else expected
    best_k, best_rate = None, None
    for k in range(draft_len + 1):
        total = num_draft_tokens + k
        bucket = 0 if total == 0 else next(b for b in (2, 4, 8, 16, 32, 64) if b >= num_reqs + total)
        rate = (n + sum(survival[:k])) / step_seconds[bucket]
        if best_rate is None or rate > best_rate + 1e-12:
            best_k, best_rate = k, rate
    return best_k


def brute_force_survival(history, num_draft):
    """P(A >= j), j = 1..num_draft, from uncensored drafts (none accepted whole): the decayed share
    of the verifications that accepted at least j."""
    weights = [ACCEPT_DECAY ** (len(history) - 1 - i) for i in range(len(history))]
    return [sum(w for w, (_, a) in zip(weights, history) if a >= j) / sum(weights) for j in range(1, num_draft + 1)]


def test_survival_counts_against_the_decayed_empirical_distribution():
    rng = np.random.default_rng(0)
    for _ in range(50):
        # at most 10: the oldest keeps weight ACCEPT_DECAY^9 > MIN_AT_RISK, so none is extrapolated
        history = [(15, int(rng.integers(0, 15))) for _ in range(int(rng.integers(1, 11)))]
        counts = AcceptCounts()
        for d, a in history:
            counts.record(d, a)
        np.testing.assert_allclose(counts.survival(15), brute_force_survival(history, 15), rtol=1e-9, atol=1e-12)
        assert counts.mean(15) == pytest.approx(sum(brute_force_survival(history, 15)))
    # censoring: 3-token drafts accepted whole say A >= 3 only; the 15-token ones decide beyond
    counts = AcceptCounts()
    for d, a in [(15, 5), (3, 3), (3, 3), (15, 5)]:
        counts.record(d, a)
    s = counts.survival(8)
    assert s[:5] == pytest.approx([1.0] * 5) and s[5] == 0.0
    counts = AcceptCounts()
    counts.record(2, 2)  # positions past the longest draft take the last tested pass rate
    assert list(counts.survival(4)) == [1.0, 1.0, 1.0, 1.0]
    counts.record(4, 0)
    assert counts.survival(3)[0] == pytest.approx(ACCEPT_DECAY / (ACCEPT_DECAY + 1))


def test_choice_maximises_tokens_per_second_against_brute_force():
    """The chosen length against the objective evaluated at every k, over random acceptance
    histories, draft lengths and bucket costs (batch 1)."""
    rng = np.random.default_rng(1)
    num_truncated = num_declined = num_whole = 0
    for _ in range(300):
        factors = {b: float(rng.uniform(1.05, 2.6)) for b in (2, 4, 8, 16)}
        policy = measured_policy(factors=factors)
        history = [(int(d), int(rng.integers(0, d + 1))) for d in rng.integers(1, 16, size=int(rng.integers(1, 12)))]
        state = state_with(history)
        draft_len = int(rng.integers(1, 16))
        survival = state.accept_counts().survival(draft_len)
        seconds = {0: DECODE_S, **{b: f * DECODE_S for b, f in factors.items()}}
        expected = brute_force_best_len(survival, draft_len, seconds)
        state.num_skipped, state.probe_steps = 0, MAX_PROBE_STEPS  # no probe in the way
        choice = policy.choose(state, StepPlan(1), draft_len)
        assert choice.num_tokens == expected, (history, draft_len, factors)
        assert choice.expected_accepted == pytest.approx(sum(survival[:expected]))
        num_truncated += 0 < expected < draft_len
        num_declined += expected == 0
        num_whole += expected == draft_len
    assert min(num_truncated, num_declined, num_whole) >= 10  # every kind of answer was checked


def test_batched_choice_is_the_marginal_one():
    """In a step whose earlier requests kept drafts, a request's draft is priced by the bucket the
    whole step lands in (brute force over k with the step's tokens and expected tokens so far)."""
    rng = np.random.default_rng(2)
    for _ in range(200):
        factors = {b: float(rng.uniform(1.0, 2.5)) for b in (8, 16, 32)}
        policy = measured_policy(decode=0.08, factors=factors, num_reqs=4)
        plan = StepPlan(4, num_draft_tokens=int(rng.integers(0, 12)), expected_accepted=float(rng.uniform(0, 6)))
        history = [(15, int(rng.integers(0, 16))) for _ in range(5)]
        state = state_with(history)
        state.probe_steps = MAX_PROBE_STEPS
        draft_len = int(rng.integers(1, 16))
        seconds = {0: 0.08, **{b: f * 0.08 for b, f in factors.items()}}
        expected = brute_force_best_len(state.accept_counts().survival(draft_len), draft_len, seconds,
                                        num_reqs=4, num_draft_tokens=plan.num_draft_tokens,
                                        expected=plan.expected_tokens)
        assert policy.choose(state, plan, draft_len).num_tokens == expected


def test_unmeasured_costs_are_tried():
    policy = DraftPolicy()
    assert not policy.can_speculate(1)  # no decode step of this batch measured yet
    policy.costs.observe_decode(1, DECODE_S)
    assert policy.can_speculate(1) and not policy.can_speculate(3)
    assert policy.choose(DraftState(), StepPlan(1), 12).num_tokens == 12  # no acceptance known: whole
    # 4 tokens always accepted, the 5th never; no verification measured: every bucket is costed at a
    # decode step, so the 8-token bucket is tried (with 4 drafts: the shortest with the most expected)
    state = state_with([(12, 4), (12, 4)])
    assert policy.choose(state, StepPlan(1), 12).num_tokens == 4
    policy.costs.observe_verify(1, 5, 2.15 * DECODE_S)  # dear: the 16-token bucket, unmeasured, next
    assert policy.choose(state, StepPlan(1), 12).num_tokens == 8
    policy.costs.observe_verify(1, 9, 2.2 * DECODE_S)  # dear too: the 4-token bucket
    assert policy.choose(state, StepPlan(1), 12).num_tokens == 3
    # 4 tokens at 1.75x < 5 at 2.15x; the 2-token bucket, even at a decode's cost (2 tokens), is not
    # worth trying
    policy.costs.observe_verify(1, 4, 1.75 * DECODE_S)
    assert policy.choose(state, StepPlan(1), 12).num_tokens == 4
    assert DraftPolicy(adaptive=False).choose(state_with([(12, 0)]), StepPlan(1), 12).num_tokens == 12


def test_declines_probes_with_backoff_and_switches_back_on():
    policy = measured_policy()
    state = DraftState()
    assert policy.choose(state, StepPlan(1), 12).num_tokens == 12
    policy.record(state, 12, 0)
    refused = 0
    while policy.choose(state, StepPlan(1), 12).num_tokens == 0:
        refused += 1
    assert refused == MIN_PROBE_STEPS  # then the probe: the whole draft
    policy.record(state, 12, 0)  # a failed probe: the back-off doubles
    assert state.probe_steps == 2 * MIN_PROBE_STEPS
    for _ in range(2 * MIN_PROBE_STEPS):
        assert policy.choose(state, StepPlan(1), 12).num_tokens == 0
    assert policy.choose(state, StepPlan(1), 12).num_tokens == 12
    policy.record(state, 12, 12)  # an accepted probe: on again, back-off reset
    assert state.probe_steps == MIN_PROBE_STEPS
    assert policy.choose(state, StepPlan(1), 12).num_tokens > 0
    for _ in range(20):  # failed probes never back off past the cap
        state = DraftState(num_skipped=state.probe_steps, probe_steps=state.probe_steps)
        policy.record(state, 12, 0)
    assert state.probe_steps == MAX_PROBE_STEPS


def test_acceptance_is_learned_per_match_length_class():
    """A request that copies (long n-gram matches, long accepts) and writes new text (short matches
    that fail) in turn: its short-match drafts stop, its long-match ones go on."""
    assert [match_class(n) for n in (1, 2, 3, 4, 7, 8, 18)] == [1, 2, 2, 3, 3, 4, 4]
    policy = measured_policy()
    state = DraftState()
    state.match_len = 12
    assert policy.choose(state, StepPlan(1), 12).num_tokens == 12
    policy.record(state, 12, 12)
    state.match_len = 1
    assert policy.choose(state, StepPlan(1), 12).num_tokens == 12  # a class not seen yet is tried
    policy.record(state, 12, 0)
    policy.record(state, 12, 0)
    assert policy.choose(state, StepPlan(1), 12).num_tokens == 0  # short matches fail: no draft ...
    state.match_len = 9
    assert policy.choose(state, StepPlan(1), 12).num_tokens == 12  # ... long ones keep being verified
    assert set(state.accept_by_class) == {4, 1}
    assert state.accept_by_class[4].mean(12) == 12.0 and state.accept_by_class[1].mean(12) == 0.0
    state.match_len = None  # a draft of unknown match length: the request's overall counts
    assert state.accept_counts() is state.accept
    assert state.accept.mean(12) == pytest.approx(12 * ACCEPT_DECAY ** 2 / (1 + ACCEPT_DECAY + ACCEPT_DECAY ** 2))


GREEDY = {"max_new_tokens": 90, "temperature": 0, "ignore_eos": True}
WRONG_UNTIL = 40  # output tokens before the oracle's drafts turn right


def make_engine(model_dir, **kwargs) -> Engine:
    return Engine(model_path=model_dir, max_total_tokens=4096, max_running_requests=8, chunked_prefill_size=64,
                  context_length=512, page_size=16, disable_precompile=True, enable_debug_checks=True, **kwargs)


@pytest.fixture(scope="module")
def prompt_and_reference(tiny_model_dir):
    prompt = list(map(int, np.random.default_rng(4).integers(3, 40000, size=30)))
    return prompt, make_engine(tiny_model_dir).generate(prompt, GREEDY)["output_ids"]


def fixed_costs(spec, factors=VERIFY_FACTORS):
    """The speculator sees DECODE_S per decode step and factors[token bucket] x DECODE_S per
    verification, whatever the machine's speed."""
    costs = spec.policy.costs
    spec.observe_decode = lambda n, seconds: costs.observe_decode(n, DECODE_S)

    def observe_verify(drafts, seconds):
        tokens = len(drafts) + sum(map(len, drafts))
        costs.observe_verify(len(drafts), tokens, factors[1 << (tokens - 1).bit_length()] * DECODE_S)

    spec.observe_verify = observe_verify


def test_engine_turns_drafts_off_and_back_on(tiny_model_dir, prompt_and_reference):
    prompt, ref = prompt_and_reference
    eng = make_engine(tiny_model_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    spec = eng.speculator
    fixed_costs(spec)

    def oracle(req, k):
        at = len(req.output_ids)
        right = ref[at : at + min(k, 4)]
        return right if at >= WRONG_UNTIL else [(t + 1) % 1000 for t in right]

    spec.propose = oracle
    eng.add_request(prompt, GREEDY)
    verified_at, out = [], None
    while eng.has_unfinished():
        before = eng.stats.num_spec_verifications
        for o in eng.step():
            out = o
        if eng.stats.num_spec_verifications > before:
            verified_at.append(len(out.output_ids))
    assert out.finished and out.output_ids == ref
    wrong = [n for n in verified_at if n <= WRONG_UNTIL]
    # one verification to learn, then one probe per back-off (8, then 16 steps): not one per token
    assert 1 <= len(wrong) <= 4, verified_at
    right = [n for n in verified_at if n > WRONG_UNTIL]
    # back on at the next probe (the back-off doubled after each failed probe after the first
    # verification), then every step verifies: the remaining tokens come up to 5 per verification
    next_probe = wrong[-1] + MIN_PROBE_STEPS * 2 ** (len(wrong) - 1) + 5
    assert right and right[0] <= next_probe, verified_at
    assert len(right) >= (GREEDY["max_new_tokens"] - right[0]) // 5, verified_at
    assert eng.stats.num_spec_accepted_tokens >= 0.7 * (GREEDY["max_new_tokens"] - right[0]), verified_at
    eng.cache.check_integrity([])


def test_engine_verifies_the_chosen_prefix_of_a_draft(tiny_model_dir, prompt_and_reference):
    """Drafts whose first 2 tokens are right and the rest wrong: with the 4-token bucket cheaper
    than the 8-token one, the policy verifies 2 of each 4-token draft after learning, and the output
    is plain decoding's."""
    prompt, ref = prompt_and_reference
    eng = make_engine(tiny_model_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    spec = eng.speculator
    fixed_costs(spec)

    def oracle(req, k):
        at = len(req.output_ids)
        right = ref[at: at + min(k, 4)]
        return right[:2] + [(t + 1) % 1000 for t in right[2:]]

    spec.propose = oracle
    eng.add_request(prompt, GREEDY)
    lens = []
    while eng.has_unfinished():
        before = (eng.stats.num_spec_verifications, eng.stats.num_spec_draft_tokens)
        for o in eng.step():
            out = o
        if eng.stats.num_spec_verifications > before[0]:
            lens.append(eng.stats.num_spec_draft_tokens - before[1])
    assert out.finished and out.output_ids == ref
    # the whole draft once, then its useful part; 1 once to measure the 2-token bucket (unmeasured,
    # costed at a decode step) and where max_new_tokens leaves room for 1; the whole draft again once
    # its evidence on positions 3-4 has decayed (MIN_AT_RISK: after ~58 verifications of 2)
    assert lens[0] == 4 and set(lens[1:]) <= {1, 2, 4} and lens.count(2) >= 0.8 * len(lens), lens
    assert lens.count(4) <= 1 + len(lens) // 12, lens
    eng.flush_cache()
    eng.cache.check_integrity([])
    assert eng.allocator.num_free == eng.allocator.num_usable
