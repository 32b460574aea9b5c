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
from jaxserve.speculative import DraftPolicy, DraftState
from jaxserve.speculative.policy import COST_WINDOW, MAX_PROBE_STEPS, MIN_PROBE_STEPS, match_class

DECODE_S, PER_DRAFT_TOKEN_S = 0.030, 0.003  # a batch-1 decode step and a verified draft token


def measured_policy(decode=DECODE_S, per_token=PER_DRAFT_TOKEN_S, num_reqs=1) -> DraftPolicy:
    policy = DraftPolicy()
    policy.costs.observe_decode(num_reqs, decode)
    policy.costs.observe_verify(num_reqs, 10, decode + 10 * per_token)
    return policy


def test_unmeasured_costs_decode_first_then_try_drafts():
    policy = DraftPolicy()
    assert not policy.can_speculate(1)  # no decode step of this batch measured yet
    policy.costs.observe_decode(1, DECODE_S)
    assert policy.can_speculate(1) and not policy.can_speculate(3)
    assert policy.wants_draft(DraftState(), 1, 12)  # no acceptance known: try
    state = DraftState(accept_ema=0.0)
    assert policy.wants_draft(state, 1, 12)  # no verification cost known yet: try
    assert policy.costs.seconds_per_draft_token is None
    assert DraftPolicy(adaptive=False).can_speculate(1)


def test_marginal_cost_rule():
    policy = measured_policy()
    assert policy.costs.seconds_per_draft_token == pytest.approx(PER_DRAFT_TOKEN_S)
    # a_i x decode / B >= k x c  <=>  a_i >= 12 x 0.003 / 0.030 = 1.2 at batch 1
    assert policy.wants_draft(DraftState(accept_ema=1.3), 1, 12)
    assert not policy.wants_draft(DraftState(accept_ema=1.1), 1, 12)
    assert policy.wants_draft(DraftState(accept_ema=1.1), 1, 10)  # a shorter draft costs less
    # at batch 8 a token is worth decode(8) / 8: the same acceptance no longer pays
    policy.costs.observe_decode(8, 0.080)
    assert not policy.wants_draft(DraftState(accept_ema=1.3), 8, 12)
    assert policy.wants_draft(DraftState(accept_ema=4.6), 8, 12)
    assert DraftPolicy(adaptive=False).wants_draft(DraftState(accept_ema=0.0), 1, 12)


def test_one_slow_step_does_not_move_the_costs():
    """A step that compiled on first use (here 10x the others) is one of the last COST_WINDOW steps, not
    their cost: the rule's decision is the same before and after it, and the costs follow a slower
    spell that lasts (median of the window)."""
    policy = measured_policy()
    for _ in range(4):
        policy.costs.observe_decode(1, DECODE_S)
        policy.costs.observe_verify(1, 10, DECODE_S + 10 * PER_DRAFT_TOKEN_S)
    policy.costs.observe_decode(1, 10 * DECODE_S)
    policy.costs.observe_verify(1, 10, 10 * DECODE_S)  # a first-use compile: 27 ms per draft token
    assert policy.costs.decode_seconds(1) == pytest.approx(DECODE_S)
    assert policy.costs.seconds_per_draft_token == pytest.approx(PER_DRAFT_TOKEN_S)
    assert policy.wants_draft(DraftState(accept_ema=1.3), 1, 12)  # as in test_marginal_cost_rule
    for _ in range(COST_WINDOW):  # the machine got 2x slower for good
        policy.costs.observe_decode(1, 2 * DECODE_S)
        policy.costs.observe_verify(1, 10, 2 * DECODE_S + 10 * 2 * PER_DRAFT_TOKEN_S)
    assert policy.costs.decode_seconds(1) == pytest.approx(2 * DECODE_S)
    assert policy.costs.seconds_per_draft_token == pytest.approx(2 * PER_DRAFT_TOKEN_S)


def test_switches_off_probes_with_backoff_and_switches_back_on():
    policy = measured_policy()
    state = DraftState()
    assert policy.wants_draft(state, 1, 12)
    policy.record(state, 12, 0)
    refused = 0
    while not policy.wants_draft(state, 1, 12):
        refused += 1
    assert refused == MIN_PROBE_STEPS  # the probe
    policy.record(state, 12, 0)  # a failed probe: the back-off doubles
    assert state.probe_steps == 2 * MIN_PROBE_STEPS
    for _ in range(2 * MIN_PROBE_STEPS):
        assert not policy.wants_draft(state, 1, 12)
    assert policy.wants_draft(state, 1, 12)
    policy.record(state, 12, 12)  # an accepted probe: on again, back-off reset
    assert state.probe_steps == MIN_PROBE_STEPS
    assert policy.wants_draft(state, 1, 12) and policy.wants_draft(state, 1, 12)
    for _ in range(20):  # failed probes never back off past the cap
        state = DraftState(accept_ema=0.0, num_skipped=state.probe_steps, probe_steps=state.probe_steps)
        policy.record(state, 12, 0)
    assert state.probe_steps == MAX_PROBE_STEPS


def test_acceptance_is_learned_per_match_length_class():
    """A request that copies (long n-gram matches, long accepts) and writes new text (short matches
    that fail) in turn: its short-match drafts stop, its long-match ones go on."""
    assert [match_class(n) for n in (1, 2, 3, 4, 7, 8, 18)] == [1, 2, 2, 3, 3, 4, 4]
    policy = measured_policy()
    state = DraftState()
    state.match_len = 12
    assert policy.wants_draft(state, 1, 12)
    policy.record(state, 12, 12)
    state.match_len = 1
    assert policy.wants_draft(state, 1, 12)  # a class not seen yet is tried
    policy.record(state, 12, 0)
    policy.record(state, 12, 0)
    assert not policy.wants_draft(state, 1, 12)  # short matches fail: no draft ...
    state.match_len = 9
    assert policy.wants_draft(state, 1, 12)  # ... long ones keep being verified
    assert state.accept_by_class == {4: 12.0, 1: 0.0}
    state.match_len = None  # a draft of unknown match length: the request's overall average
    assert state.expected_accept() == state.accept_ema == 3.0


GREEDY = {"max_new_tokens": 90, "temperature": 0, "ignore_eos": True}
WRONG_UNTIL = 40  # output tokens before the oracle's drafts turn right


def make_engine(model_dir, **kwargs) -> Engine:
    return Engine(model_path=model_dir, max_total_tokens=4096, max_running_requests=8, chunked_prefill_size=64,
                  context_length=512, page_size=16, disable_precompile=True, enable_debug_checks=True, **kwargs)


@pytest.fixture(scope="module")
def prompt_and_reference(tiny_model_dir):
    prompt = list(map(int, np.random.default_rng(4).integers(3, 40000, size=30)))
    return prompt, make_engine(tiny_model_dir).generate(prompt, GREEDY)["output_ids"]


def test_engine_turns_drafts_off_and_back_on(tiny_model_dir, prompt_and_reference):
    prompt, ref = prompt_and_reference
    eng = make_engine(tiny_model_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    spec, costs = eng.speculator, eng.speculator.policy.costs
    spec.observe_decode = lambda n, seconds: costs.observe_decode(n, DECODE_S)
    spec.observe_verify = lambda drafts, seconds: costs.observe_verify(
        len(drafts), sum(map(len, drafts)), DECODE_S + PER_DRAFT_TOKEN_S * sum(map(len, drafts)))

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
