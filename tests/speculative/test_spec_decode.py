"""N-gram speculative decoding on the tiny random Llama: exact outputs, rollback, counters, compiles.

References are independent of the code under test: plain decoding (speculation off) for the outputs,
brute force for the n-gram search and the tree continuation.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxserve.cache.radix_tree import RadixCache
from jaxserve.engine.engine import Engine
from jaxserve.speculative import ngram_draft, num_accepted
from jaxserve.speculative.ngram import ngram_match

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def make_engine(model_dir, **kwargs) -> Engine:
    base = dict(
        model_path=model_dir, max_total_tokens=4096, max_running_requests=16, chunked_prefill_size=64,
        context_length=512, page_size=16, disable_precompile=True, enable_debug_checks=True,
        prefill_decode_itl_ratio=0,  # no time-based prefill budget: the schedule (and so retractions, recalls) must not depend on load
    )
    base.update(kwargs)
    return Engine(**base)


def spec_engine(model_dir, **kwargs) -> Engine:
    """Every draft verified (the adaptive policy off), so each test's drafts run whatever the timing;
    tests/speculative/test_spec_policy.py covers the policy."""
    kwargs.setdefault("disable_speculative_adaptive", True)
    return make_engine(model_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                       speculative_max_batch_size=16, **kwargs)


def copy_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase, so drafts from the request's own tokens get accepted."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        phrase = list(map(int, rng.integers(3, 40000, size=int(rng.integers(3, 12)))))
        out.append(phrase * int(rng.integers(2, 8)) + list(map(int, rng.integers(3, 40000, size=int(rng.integers(0, 40))))))
    return out


def brute_force_draft(tokens, k, max_match):
    return brute_force_match(tokens, k, max_match)[0]


def brute_force_match(tokens, k, max_match):
    best_len, best_end = 0, -1
    n = len(tokens)
    for end in range(n - 1):
        w = 0
        while w < max_match and end - w >= 0 and w < n - 1 and tokens[end - w] == tokens[n - 1 - w]:
            w += 1
        if w > 0 and w >= best_len:
            best_len, best_end = w, end
    if best_end < 0:
        return [], 0
    seq = list(tokens)
    while len(seq) < best_end + 1 + k:  # past the end, the text repeats with period n - 1 - best_end
        seq.append(seq[len(seq) - (n - 1 - best_end)])
    return seq[best_end + 1 : best_end + 1 + k], best_len


def test_ngram_draft_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = list(map(int, rng.integers(0, 4, size=int(rng.integers(1, 40)))))
        k, m = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        assert ngram_draft(tokens, k, m) == brute_force_draft(tokens, k, m), (tokens, k, m)
        draft, match_len = ngram_match(tokens, k, m)
        assert (draft, match_len) == brute_force_match(tokens, k, m), (tokens, k, m)


def test_num_accepted():
    assert num_accepted([5, 6, 7], [5, 6, 9, 1]) == 2
    assert num_accepted([5, 6, 7], [1, 6, 7, 1]) == 0
    assert num_accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert num_accepted([], [4]) == 0
    with pytest.raises(ValueError):
        num_accepted([1], [1])


def test_tree_continuation():
    tree = RadixCache(page_size=4)
    seq = list(range(100, 124))  # 6 pages
    tree.insert(seq, np.arange(1, 7, dtype=np.int32))
    for cut in range(1, 23):
        assert tree.continuation(seq[:cut], 5) == seq[cut : cut + 5]
    assert tree.continuation([100, 101, 999], 5) == []
    assert tree.continuation(seq, 5) == []
    assert tree.continuation(seq[:6], 5, namespace="other") == []
    other = seq[:8] + [7, 7, 7, 7]  # a sibling continuation, used more recently
    tree.insert(other, np.arange(7, 10, dtype=np.int32))
    tree.match_prefix(other)
    assert tree.continuation(seq[:8], 3) == [7, 7, 7]
    assert RadixCache(page_size=4, disable=True).continuation(seq[:3], 2) == []


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    return [eng.generate(p, GREEDY)["output_ids"] for p in copy_prompts(12)]


def assert_no_leak(engine: Engine) -> None:
    engine.cache.check_integrity([])
    engine.cache.allocator.free(engine.cache.tree.reset())
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_usable


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_greedy_identical_with_speculation(tiny_model_dir, plain_outputs, batched):
    """Drafts from the request's own tokens (alone) and from the radix tree: batched, the first half
    of the prompts was served before, so the tree holds their continuations."""
    eng = spec_engine(tiny_model_dir, chunked_prefill_size=64, max_running_requests=64)
    prompts = copy_prompts(12)
    if batched:
        first = [eng.generate(p, GREEDY)["output_ids"] for p in prompts[:6]]
        outs = [o["output_ids"] for o in eng.generate(prompts, GREEDY)]
        assert first == outs[:6]
    else:
        outs = [eng.generate(p, GREEDY)["output_ids"] for p in prompts]
    assert outs == plain_outputs
    s = eng.stats
    assert s.num_spec_verifications > 0 and s.num_spec_accepted_tokens > 0
    snap = eng.snapshot()
    assert snap.spec_accept_length > 1 and 0 < snap.spec_accept_rate <= 1
    assert_no_leak(eng)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return make_engine(tiny_model_dir, max_running_requests=64)


@pytest.fixture(scope="module")
def spec(tiny_model_dir):
    return spec_engine(tiny_model_dir, max_running_requests=64)


def outputs(eng, prompts, params, **kwargs):
    res = eng.generate(prompts, params, **kwargs)
    return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"]) for o in res]


def test_seeded_sampling_identical_and_reproducible(plain, spec):
    """Each verified position draws with the key plain decoding uses for that output position, so a
    seeded request gives the same tokens with speculation on and off (and twice with it on).

    top_k keeps the draws away from rounding: the verify step's logits differ from a decode step's
    by float rounding, and over the tiny random model's near-uniform 49k-token rows that moves one of
    the inverse CDF's boundaries past the uniform draw in a few percent of the tokens (a CI run hit
    it). Over 16 kept tokens the chance is ~3000x lower, while a wrong key still changes most tokens."""
    prompts = copy_prompts(6, seed=3)
    params = [{"max_new_tokens": 20, "temperature": 0.7, "top_k": 16, "seed": 100 + i, "ignore_eos": True}
              for i in range(6)]
    before = spec.stats.num_spec_accepted_tokens
    ref = outputs(plain, prompts, params)
    assert outputs(spec, prompts, params) == ref
    assert outputs(spec, prompts, params) == ref
    assert spec.stats.num_spec_accepted_tokens > before
    n2 = {"max_new_tokens": 12, "temperature": 0.9, "top_k": 16, "seed": 7, "n": 2, "ignore_eos": True}
    assert outputs(spec, prompts[:2], n2) == outputs(plain, prompts[:2], n2)


def test_stop_inside_an_accepted_run(plain, spec):
    """Served once first, the prompt's continuation is in the tree, so each verification accepts whole
    drafts: the stop string, stop token and max_new_tokens fall inside accepted runs."""
    prompts = copy_prompts(4, seed=5)
    full = outputs(plain, prompts, GREEDY)
    outputs(spec, prompts, GREEDY)  # fills the tree
    for (ids, text, _), prompt in zip(full, prompts):
        stop_token = ids[9]
        cut = len(text) // 2
        cases = [
            {**GREEDY, "stop": [text[cut : cut + 3]]},
            {**GREEDY, "stop_token_ids": [stop_token]},
            {**GREEDY, "max_new_tokens": 7},
        ]
        for params in cases:
            before = spec.stats.num_spec_accepted_tokens
            got = outputs(spec, [prompt], params)
            assert got == outputs(plain, [prompt], params), params
            assert spec.stats.num_spec_accepted_tokens > before
    assert_no_leak_keeping_engine(spec)


def assert_no_leak_keeping_engine(engine: Engine) -> None:
    engine.cache.check_integrity([])
    assert engine.cache.allocator.num_free + engine.cache.tree.total_size() // engine.args.page_size == engine.cache.allocator.num_usable


def test_logprobs_of_accepted_tokens(plain, spec):
    prompts = copy_prompts(3, seed=8)
    outputs(spec, prompts, GREEDY)  # tree continuations: drafts get accepted
    ref = plain.generate(prompts, GREEDY, return_logprob=True, top_logprobs_num=2)
    got = spec.generate(prompts, GREEDY, return_logprob=True, top_logprobs_num=2)
    for r, g in zip(ref, got):
        assert g["output_ids"] == r["output_ids"]
        lp_r = [lp for lp, *_ in r["meta_info"]["output_token_logprobs"]]
        lp_g = [lp for lp, *_ in g["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(lp_g, lp_r, atol=1e-4)
        assert [[t for _, t, _ in row] for row in g["meta_info"]["output_top_logprobs"]] == \
            [[t for _, t, _ in row] for row in r["meta_info"]["output_top_logprobs"]]


def test_grammar_constrained_request(plain, spec):
    params = {"max_new_tokens": 30, "temperature": 0, "regex": "(foo|bar)( (foo|bar)){3,40}"}
    prompts = copy_prompts(3, seed=9)
    ref = outputs(plain, prompts, params)
    assert outputs(spec, prompts, params) == ref
    before = spec.stats.num_spec_accepted_tokens
    assert outputs(spec, prompts, params) == ref  # now with tree drafts
    assert spec.stats.num_spec_accepted_tokens > before
    for _, text, finish in ref:
        pattern = "(foo|bar)( (foo|bar)){3,40}" if finish["type"] == "stop" else "(foo|bar)( (foo|bar))*( (f|fo|b|ba)?)?"
        assert re.fullmatch(pattern, text), (text, finish)


def test_retraction_with_speculation_stays_exact(tiny_model_dir, plain):
    prompts = copy_prompts(16, seed=11)
    ref = outputs(plain, prompts, GREEDY)
    eng = spec_engine(tiny_model_dir, max_total_tokens=400, disable_radix_cache=True, max_running_requests=64)
    assert outputs(eng, prompts, GREEDY) == ref
    assert eng.scheduler.num_retractions > 0
    assert eng.cache.allocator.num_free == eng.cache.allocator.num_usable


def test_no_compile_after_warmup_with_speculation(tiny_model_dir):
    eng = spec_engine(tiny_model_dir, disable_precompile=False, max_running_requests=8, chunked_prefill_size=32,
                      context_length=256)
    rng = np.random.default_rng(1)
    prompts = copy_prompts(24, seed=12)
    params = [{"max_new_tokens": int(rng.integers(1, 30)), "temperature": float(rng.choice([0.0, 0.8]))} for _ in prompts]
    params[:4] = [{"max_new_tokens": 30, "temperature": 0.0}] * 4
    eng.generate(prompts, params)
    eng.generate(prompts[:4], params[:4])  # greedy again: drafts from the tree
    assert eng.stats.num_spec_accepted_tokens > 0
    assert eng.runner.num_compiles_after_warmup == 0


def test_acceptance_metrics_exported(spec):
    from jaxserve.server.metrics import ServingMetrics

    outputs(spec, copy_prompts(1, seed=21), GREEDY)
    outputs(spec, copy_prompts(1, seed=21), GREEDY)  # tree drafts: some accepted
    s = spec.stats
    assert s.num_spec_accepted_tokens > 0
    text = ServingMetrics(spec.snapshot, "tiny").render().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("jaxserve_spec")}
    length = (s.num_spec_accepted_tokens + s.num_spec_verifications) / s.num_spec_verifications
    assert values["jaxserve_spec_accept_length"] == pytest.approx(length)
    assert values["jaxserve_spec_accept_rate"] == pytest.approx(s.num_spec_accepted_tokens / s.num_spec_draft_tokens)


def test_one_token_prompts_beside_speculating_decodes(plain, spec):
    """A one-token prompt (or a last prompt chunk of one token) mixed with decodes makes a batch of
    one-token extends that is not a decode batch: it must not be verified as one (it was lost)."""
    prompts = [[5], copy_prompts(1, seed=30)[0], [7], [9, 9]] + copy_prompts(3, seed=31)
    ref = outputs(plain, prompts, GREEDY)
    outputs(spec, prompts[1:2], GREEDY)  # the tree now holds its continuation: it decodes with drafts
    rids = [spec.add_request(prompts[1], GREEDY)[0]]
    spec.step()  # its prefill
    rids += spec.add_request(prompts[0], GREEDY) + spec.add_request(prompts[2], GREEDY)
    before = spec.stats.num_spec_verifications
    spec.step()  # one-token extends of [5] and [7] beside the drafting decode
    assert spec.stats.num_spec_verifications == before  # not a decode batch: no verification
    for p in prompts[3:]:
        rids += spec.add_request(p, GREEDY)
    done = {}
    while len(done) < len(rids):
        for out in spec.step():
            if out.finished:
                done[out.rid] = out.output_ids
    order = [rids[1], rids[0]] + rids[2:]
    assert [done[r] for r in order] == [ids for ids, _, _ in ref]
    assert not spec.has_unfinished()
