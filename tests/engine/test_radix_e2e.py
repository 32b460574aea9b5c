"""RadixAttention end to end on the default model: exact outputs with the cache on, and reported reuse."""

from __future__ import annotations

import pytest

from jaxserve.engine.engine import Engine

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a meticulous assistant for a hardware store. Answer in one short sentence, mention the aisle "
    "number when you know it, never invent prices, and be polite. Aisles: 1 paint, 2 tools, 3 garden, "
    "4 plumbing, 5 electrical, 6 lumber, 7 fasteners, 8 seasonal."
)
QUESTIONS = [f"Where do I find item number {i} ({w})?" for i, w in enumerate(
    ["hammers", "nails", "seeds", "pipes", "bulbs", "paint", "screws", "wood", "gloves", "hoses"] * 5)]
GREEDY = {"max_new_tokens": 6, "temperature": 0}


def make(**kw) -> Engine:
    args = dict(model_path="default", max_total_tokens=16384, max_running_requests=64, chunked_prefill_size=512,
                context_length=1024, disable_precompile=True,
                prefill_decode_itl_ratio=0)  # no time-based prefill budget: the schedule (and so retractions, recalls) must not depend on load
    args.update(kw)
    return Engine(**args)


@pytest.fixture(scope="module")
def engine():
    return make()


def chat(tok, messages) -> list[int]:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_shared_system_prompt_exact_with_cache_on_and_off(engine):
    tok = engine.tokenizer
    prompts = [chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in QUESTIONS]
    with_cache = engine.generate(prompts, GREEDY)
    without = make(disable_radix_cache=True).generate(prompts, GREEDY)
    assert [o["output_ids"] for o in with_cache] == [o["output_ids"] for o in without]
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in without)
    # staggering: the shared system prompt is prefilled once, so later requests hit it
    assert sum(o["meta_info"]["cached_tokens"] > 0 for o in with_cache) >= len(prompts) - 1
    repeat = engine.generate(prompts[:5], GREEDY)
    for r, first in zip(repeat, with_cache[:5]):
        assert r["output_ids"] == first["output_ids"]
        assert r["meta_info"]["cached_tokens"] >= r["meta_info"]["prompt_tokens"] - 16


def test_second_chat_turn_reuses_first(engine):
    tok = engine.tokenizer
    turn1 = [{"role": "user", "content": "Name a large animal that lives in the ocean."}]
    p1 = chat(tok, turn1)
    out1 = engine.generate(p1, {"max_new_tokens": 16, "temperature": 0})
    turn2 = turn1 + [{"role": "assistant", "content": out1["text"]}, {"role": "user", "content": "How big is it?"}]
    out2 = engine.generate(chat(tok, turn2), {"max_new_tokens": 4, "temperature": 0})
    first_len = out1["meta_info"]["prompt_tokens"] + out1["meta_info"]["completion_tokens"]
    assert out2["meta_info"]["cached_tokens"] >= first_len - engine.args.page_size - 2


def test_eviction_under_a_tiny_pool_keeps_outputs_exact(engine):
    tok = engine.tokenizer
    prefix = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)
    assert len(tok.encode(prefix)) >= 200
    prompts = [prefix + f" Question {i}: what did the fox do?" for i in range(4)]
    params = {"max_new_tokens": 24, "temperature": 0}
    reference = [engine.generate(p, params)["output_ids"] for p in prompts]
    small = make(max_total_tokens=320, max_running_requests=4)
    outs = small.generate(prompts, params)
    assert [o["output_ids"] for o in outs] == reference
    assert small.cache.num_evicted_tokens > 0 or small.scheduler.num_retractions > 0
    small.cache.check_integrity([])


def test_reuse_stops_at_first_differing_token(engine):
    tok = engine.tokenizer
    a = "The weather in Copenhagen is"
    b = "The weather in Copenhagenish towns is"  # the texts share "Copenhagen" but not its token ids
    ids_a, ids_b = tok.encode(a), tok.encode(b)
    common = 0
    while common < min(len(ids_a), len(ids_b)) and ids_a[common] == ids_b[common]:
        common += 1
    eng = make(page_size=1)
    eng.generate(a, {"max_new_tokens": 1})
    out = eng.generate(b, {"max_new_tokens": 1})
    assert out["meta_info"]["cached_tokens"] == common
    assert common < len(tok.encode(a))
