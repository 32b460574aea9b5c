"""A request larger than the KV pool: SGLang's max_req_len rule (refuse the prompt, cut max_new_tokens).

Before the rule, a request that fit the context but not the pool decoded until the pool was full and the
scheduler raised "KV pool cannot hold a single decoding request", killing the engine.
"""

from __future__ import annotations

import pytest

from jaxserve.core.errors import RequestError
from jaxserve.engine.engine import Engine

POOL = 128  # tokens: 8 pages of 16


def make_engine(model_dir, **kwargs) -> Engine:
    base = dict(model_path=model_dir, max_total_tokens=POOL, max_running_requests=4, chunked_prefill_size=64,
                context_length=512, page_size=16, disable_precompile=True)
    base.update(kwargs)
    return Engine(**base)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def _prompt(n: int) -> list[int]:
    return [(7 * i) % 500 + 3 for i in range(n)]


def test_max_new_tokens_is_cut_to_the_pool(engine):
    # 60 + 300 fits the context (512) but not the pool (128): SGLang cuts to max_req_len - 60 - 1
    out = engine.generate(_prompt(60), {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True})
    room = POOL - 1 - 60 - 1
    assert len(out["output_ids"]) == room
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": room}
    assert not engine.has_unfinished()


def test_two_pool_sized_requests_run_one_after_the_other(engine):
    # within the context (512; over it, a max_new_tokens given is refused, as the server refuses it), not the pool
    outs = engine.generate([_prompt(50), _prompt(40)], {"max_new_tokens": 450, "temperature": 0, "ignore_eos": True})
    assert [len(o["output_ids"]) for o in outs] == [POOL - 2 - 50, POOL - 2 - 40]
    engine.cache.check_integrity([])


def test_prompt_that_cannot_fit_the_pool_is_refused(engine):
    with pytest.raises(RequestError) as e:
        engine.add_request(_prompt(POOL - 6), {"max_new_tokens": 1})
    assert e.value.field == "prompt" and "KV pool" in str(e.value)
    rid = engine.add_request(_prompt(POOL - 7), {"max_new_tokens": 50, "ignore_eos": True})[0]
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.rid == rid and o.finished]
    assert len(outs[0].output_ids) == 5  # max_req_len - prompt - 1


def test_min_new_tokens_is_cut_with_it(engine):
    out = engine.generate(_prompt(100), {"max_new_tokens": 200, "min_new_tokens": 150, "temperature": 0})
    assert len(out["output_ids"]) == POOL - 2 - 100


def test_speculative_request_at_the_pool_limit_finishes(tiny_model_dir):
    # a repetitive prompt gives n-gram drafts; verifying them near the pool's end must not overflow it
    eng = make_engine(tiny_model_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=8,
                      disable_speculative_adaptive=True)
    out = eng.generate([5, 6, 7, 8] * 15, {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True})
    assert len(out["output_ids"]) == POOL - 2 - 60
    assert eng.stats.num_spec_verifications > 0




def test_n2_near_the_pool_retracts_the_chunked_prompt(tiny_model_dir):
    """n = 2 with a prompt near the pool's size (a new-user trial's request that ended the engine): the
    first sequence decodes while the second's prompt is still being prefilled in budget-sized chunks
    beside it, and that prompt's private pages are what the decode needs. The scheduler retracted only
    decodes, so the lone decode's failed grow raised "KV pool cannot hold a single decoding request";
    now the part-way prompt is retracted first (its computed prefix stays cached)."""
    eng = Engine(model_path=tiny_model_dir, max_total_tokens=2048, context_length=4096, page_size=16,
                 max_running_requests=8, disable_precompile=True)
    prompt = [(7 * i) % 39000 + 100 for i in range(2000)]
    outs = eng.generate(prompt, {"max_new_tokens": 100, "n": 2, "temperature": 0, "ignore_eos": True})
    room = 2048 - 2 - 2000
    assert [len(o["output_ids"]) for o in outs] == [room, room]
    assert outs[0]["output_ids"] == outs[1]["output_ids"]  # greedy: both sequences agree
    eng.cache.check_integrity([])
    assert eng.cache.allocator.num_free + eng.cache.tree.evictable_size() // 16 == eng.cache.allocator.num_usable
