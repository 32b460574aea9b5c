"""The overlap schedule (engine/overlap.py, `Engine._launch_followup`) on the tiny random Llama: outputs, pages and compiles.

The reference is the same engine with `--disable-overlap-schedule`, which reads every step's tokens
before it builds the next batch; each test also checks that steps were overlapped (a test of the
overlap that never overlapped would pass vacuously).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine.engine import Engine

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def make_engine(model_dir, overlap: bool, **kwargs) -> Engine:
    base = dict(
        model_path=model_dir, max_total_tokens=4096, max_running_requests=16, chunked_prefill_size=64,
        context_length=512, page_size=16, disable_precompile=True, enable_debug_checks=True,
        prefill_decode_itl_ratio=0,  # the schedule must not depend on step times
        disable_overlap_schedule=not overlap,
    )
    base.update(kwargs)
    return Engine(**base)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return make_engine(tiny_model_dir, False), make_engine(tiny_model_dir, True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, 40000, size=int(rng.integers(1, 150))))) for _ in range(n)]


def outputs(eng: Engine, ps, params, **kwargs):
    res = eng.generate(ps, params, **kwargs)
    return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"]) for o in res]


def assert_no_leak(engine: Engine) -> None:
    engine.cache.check_integrity([])
    assert engine.cache.allocator.num_free + engine.cache.tree.total_size() // engine.args.page_size == engine.cache.allocator.num_usable


def overlapped(eng: Engine, fn):
    before = eng.stats.num_overlapped_steps
    out = fn()
    return out, eng.stats.num_overlapped_steps - before


def test_greedy_identical_with_stops_inside_the_run(engines):
    """A batch of mixed lengths (chunked prompts beside decodes), finishing on max_new_tokens, on a stop
    token and on a stop string part-way: a request that stops on the token read after the next step
    was launched has its extra row dropped."""
    off, on = engines
    ps = prompts(10, seed=1)
    free = outputs(off, ps, GREEDY)
    params = []
    for i, (ids, text, _) in enumerate(free):
        kind = i % 3
        if kind == 0:
            params.append({**GREEDY, "max_new_tokens": 3 + i})
        elif kind == 1:
            params.append({**GREEDY, "stop_token_ids": [ids[5 + i % 7]]})
        else:
            params.append({**GREEDY, "stop": [text[len(text) // 2 : len(text) // 2 + 3]]})
    ref = outputs(off, ps, params)
    got, n = overlapped(on, lambda: outputs(on, ps, params))
    assert got == ref
    assert n > 0 and off.stats.num_overlapped_steps == 0
    assert {f["type"] for _, _, f in ref} == {"length", "stop"}
    assert_no_leak(on)


def test_alone_identical(engines):
    off, on = engines
    for p in prompts(3, seed=2):
        got, n = overlapped(on, lambda: outputs(on, [p], GREEDY))
        assert got == outputs(off, [p], GREEDY) and n > 0


def test_seeded_sampling_and_logprobs_identical(engines):
    """The step launched before the token is read samples the next output position with the key plain
    decoding uses for it, so seeded requests are the same; logprobs come from the same rows."""
    off, on = engines
    ps = prompts(5, seed=3)
    params = [{"max_new_tokens": 16, "temperature": 0.8, "top_k": 16, "seed": 50 + i, "ignore_eos": True}
              for i in range(5)]
    ref = off.generate(ps, params, return_logprob=True, top_logprobs_num=2)
    got, n = overlapped(on, lambda: on.generate(ps, params, return_logprob=True, top_logprobs_num=2))
    assert n > 0
    for r, g in zip(ref, got):
        assert g["output_ids"] == r["output_ids"]
        np.testing.assert_allclose([lp for lp, *_ in g["meta_info"]["output_token_logprobs"]],
                                   [lp for lp, *_ in r["meta_info"]["output_token_logprobs"]], atol=1e-5)
        top_g, top_r = g["meta_info"]["output_top_logprobs"], r["meta_info"]["output_top_logprobs"]
        assert [[t for _, t, _ in row] for row in top_g] == [[t for _, t, _ in row] for row in top_r]
        np.testing.assert_allclose([[lp for lp, *_ in row] for row in top_g], [[lp for lp, *_ in row] for row in top_r], atol=1e-5)


def test_requests_the_host_must_see_are_not_overlapped_and_stay_exact(engines):
    """A grammar (the next bitmask) or a penalty (the token counts) needs each token on the host first:
    batches with one are stepped without the overlap, and are exact."""
    off, on = engines
    ps = prompts(4, seed=4)
    params = [dict(GREEDY, max_new_tokens=20), {**GREEDY, "frequency_penalty": 0.5},
              {"max_new_tokens": 20, "temperature": 0, "regex": "(foo|bar)( (foo|bar)){3,40}"},
              dict(GREEDY, max_new_tokens=12)]
    ref = outputs(off, ps, params)
    got, n = overlapped(on, lambda: outputs(on, ps, params))
    assert got == ref
    alone, n_alone = overlapped(on, lambda: outputs(on, ps[1:2], params[1:2]))
    assert alone == ref[1:2] and n_alone == 0  # a penalty alone: never overlapped
    assert_no_leak(on)


def test_abort_and_arrival_while_a_step_is_in_flight(engines):
    off, on = engines
    ps = prompts(4, seed=5)
    ref = outputs(off, ps[:3], GREEDY)
    late_ref = outputs(off, ps[3:], GREEDY)
    rids = [on.add_request(p, GREEDY)[0] for p in ps[:3]]
    before = on.stats.num_overlapped_steps
    done = {}
    steps = 0
    while not on.step_in_flight or on.stats.num_overlapped_steps == before:
        for o in on.step():
            done[o.rid] = o
        steps += 1
        assert steps < 100
    assert on.abort(rids[1])  # its row is in the step in flight
    late = on.add_request(ps[3], GREEDY)[0]
    while on.has_unfinished():
        for o in on.step():
            done[o.rid] = o
    assert done[rids[1]].meta.finish_reason.kind == "abort"
    assert [done[r].output_ids for r in (rids[0], rids[2])] == [ref[0][0], ref[2][0]]
    assert done[late].output_ids == late_ref[0][0]
    assert_no_leak(on)


def test_retraction_stays_exact(tiny_model_dir, engines):
    """A pool too small for every request: the overlap gives way to the scheduler, which retracts."""
    off, _ = engines
    ps = prompts(12, seed=6)
    ref = outputs(off, ps, GREEDY)
    eng = make_engine(tiny_model_dir, True, max_total_tokens=400, disable_radix_cache=True, max_running_requests=64)
    got, n = overlapped(eng, lambda: outputs(eng, ps, GREEDY))
    assert got == ref
    assert eng.scheduler.num_retractions > 0 and n > 0
    assert eng.cache.allocator.num_free == eng.cache.allocator.num_usable


def test_no_compile_after_warmup(tiny_model_dir):
    eng = make_engine(tiny_model_dir, True, disable_precompile=False, max_running_requests=8,
                      chunked_prefill_size=32, context_length=256)
    rng = np.random.default_rng(7)
    ps = prompts(12, seed=7)
    params = [{"max_new_tokens": int(rng.integers(1, 30)), "temperature": float(rng.choice([0.0, 0.8]))} for _ in ps]
    _, n = overlapped(eng, lambda: eng.generate(ps, params))
    assert n > 0
    assert eng.runner.num_compiles_after_warmup == 0


def test_every_request_aborted_while_a_step_is_in_flight(engines):
    """The step in flight then has no request left: it is dropped, the engine goes idle, no page leaks."""
    _, on = engines
    rids = [on.add_request(p, GREEDY)[0] for p in prompts(2, seed=8)]
    steps = 0
    while not on.step_in_flight:
        on.step()
        steps += 1
        assert steps < 100
    steps_before = on.stats.num_steps
    assert all(on.abort(r) for r in rids)
    outs = on.step()
    assert sorted(o.rid for o in outs) == sorted(rids) and all(o.meta.finish_reason.kind == "abort" for o in outs)
    assert not on.step_in_flight and not on.has_unfinished() and on.stats.num_steps == steps_before
    on.flush_cache()
    assert on.cache.allocator.num_free == on.cache.allocator.num_usable
