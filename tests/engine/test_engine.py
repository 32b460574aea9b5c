"""Engine behaviour on a tiny random Llama: batch invariance, retraction, leaks, compiles, sampling API."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.core.errors import RequestError, SamplingParamsError
from jaxserve.engine.engine import Engine

GREEDY = {"max_new_tokens": 10, "temperature": 0}


def make_engine(model_dir, **kwargs) -> Engine:
    base = dict(
        model_path=model_dir, max_total_tokens=4096, max_running_requests=16, chunked_prefill_size=64,
        context_length=256, page_size=16, disable_precompile=True,
        prefill_decode_itl_ratio=0,  # no time-based prefill budget: the schedule (and so retractions, recalls) must not depend on load
    )
    base.update(kwargs)
    return Engine(**base)


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, 40000, size=int(rng.integers(3, 150))))) for _ in range(n)]


def assert_no_leak(engine: Engine) -> None:
    freed = engine.cache.tree.reset()
    engine.cache.allocator.free(freed)
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_usable


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def solo_outputs(engine):
    return [engine.generate(p, GREEDY)["output_ids"] for p in mixed_prompts(16)]


@pytest.mark.parametrize(
    "chunk,mixed", [(32, False), (64, True), (-1, False), (32, True)], ids=["chunk32", "chunk64-mixed", "nochunk", "chunk32-mixed"]
)
def test_batch_invariance(tiny_model_dir, solo_outputs, chunk, mixed):
    eng = make_engine(tiny_model_dir, chunked_prefill_size=chunk, enable_mixed_chunk=mixed,
                      max_prefill_tokens=256)
    outs = eng.generate(mixed_prompts(16), GREEDY)
    assert [o["output_ids"] for o in outs] == solo_outputs
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 10} for o in outs)
    eng.cache.check_integrity([])
    assert_no_leak(eng)


def test_tiny_pool_retracts_and_stays_exact(tiny_model_dir, solo_outputs):
    eng = make_engine(tiny_model_dir, max_total_tokens=320, disable_radix_cache=True)
    outs = eng.generate(mixed_prompts(16), GREEDY)
    assert [o["output_ids"] for o in outs] == solo_outputs
    assert eng.scheduler.num_retractions > 0
    assert eng.cache.allocator.num_free == eng.cache.allocator.num_usable


def test_no_compile_after_warmup(tiny_model_dir):
    eng = make_engine(tiny_model_dir, disable_precompile=False, max_running_requests=8, chunked_prefill_size=32)
    assert eng.runner.warmed_up
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(3, 40000, size=int(rng.integers(1, 200))))) for _ in range(50)]
    params = [{"max_new_tokens": int(rng.integers(1, 20)), "temperature": float(rng.choice([0.0, 0.8]))} for _ in prompts]
    # the sampling filters are warmed too (a first top_k/top_p request waited 2-6 s per batch size)
    filters = [{}, {"top_k": 20}, {"top_p": 0.9}, {"top_k": 5, "top_p": 0.5, "min_p": 0.05}, {"min_p": 0.1}]
    for i, p in enumerate(params):
        if p["temperature"] > 0:
            p.update(filters[i % len(filters)])
    eng.generate(prompts, params)
    assert eng.runner.num_compiles_after_warmup == 0


def test_scan_layer_loop_matches_host_loop(tiny_model_dir, solo_outputs):
    """--layer-loop scan (one executable per step) gives the host layer loop's tokens and prompt logprobs,
    and its precompiled buckets cover a varied workload."""
    host = make_engine(tiny_model_dir)
    scan = make_engine(tiny_model_dir, layer_loop="scan", disable_precompile=False, max_running_requests=8)
    assert host.runner.layer_loop == "host" and scan.runner.layer_loop == "scan"  # the CPU default is host
    outs = scan.generate(mixed_prompts(16), GREEDY)
    assert [o["output_ids"] for o in outs] == solo_outputs
    assert scan.runner.num_compiles_after_warmup == 0
    prompt_logprobs = []
    for eng in (host, scan):
        eng.add_request(mixed_prompts(1, seed=5)[0], {"max_new_tokens": 2, "temperature": 0},
                        return_logprob=True, logprob_start_len=1)
        final = None
        while eng.has_unfinished():
            final = next((o for o in eng.step() if o.finished), final)
        prompt_logprobs.append([lp for lp, _ in final.meta.input_token_logprobs])
    assert len(prompt_logprobs[0]) > 2
    np.testing.assert_allclose(prompt_logprobs[0], prompt_logprobs[1], atol=1e-4)


def test_seeded_sampling_is_batch_invariant(engine):
    params = {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.9, "seed": 1234}
    prompt = mixed_prompts(1, seed=7)[0]
    # both compared calls extend the cached prompt: a cold prefill and a cached extend agree only to the
    # last float bits, which can flip a temperature-1 draw over the tiny model's near-flat rows
    engine.generate(prompt, {"max_new_tokens": 1})
    alone = engine.generate(prompt, params)["output_ids"]
    others = [{"max_new_tokens": 12, "temperature": 1.0, "seed": i} for i in range(5)]
    together = engine.generate(mixed_prompts(5, seed=8) + [prompt], others + [params])
    assert together[-1]["output_ids"] == alone
    unseeded = engine.generate([prompt] * 2, {"max_new_tokens": 12, "temperature": 1.0})
    assert unseeded[0]["output_ids"] != unseeded[1]["output_ids"]


def test_stop_string_across_token_boundary(engine):
    prompt = mixed_prompts(1, seed=3)[0]
    full = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0})
    text = full["text"]
    # a stop string made of the end of one token's text and the start of the next
    ids = full["output_ids"]
    tok = engine.tokenizer
    first = tok.decode(ids[:3])
    second = tok.decode(ids[:4])
    stop = first[-2:] + second[len(first) : len(first) + 2]
    assert stop in text
    out = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "stop": [stop]})
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # SGLang's no_stop_trim keeps the text of every token up to the one that completed the stop string
    kept = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "stop": [stop], "no_stop_trim": True})
    assert kept["text"].startswith(text[: text.index(stop) + len(stop)]) and text.startswith(kept["text"])
    assert len(kept["output_ids"]) == len(out["output_ids"])


def test_max_new_tokens_zero_and_one(engine):
    prompt = mixed_prompts(1, seed=4)[0]
    zero = engine.generate(prompt, {"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    one = engine.generate(prompt, {"max_new_tokens": 1, "temperature": 0})
    assert len(one["output_ids"]) == 1 and one["meta_info"]["completion_tokens"] == 1


def test_n_greater_than_one(engine):
    outs = engine.generate("hello there", {"max_new_tokens": 5, "temperature": 1.0, "n": 3, "seed": 5})
    assert len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    assert all(o["meta_info"]["prompt_tokens"] == outs[0]["meta_info"]["prompt_tokens"] for o in outs)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_new_tokens", -1), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 2.0),
        ("min_p", -0.1), ("top_k", 0), ("top_k", -2), ("n", 0), ("n", 129), ("min_new_tokens", 129), ("stop", [""]), ("frequency_penalty", 3.0),
        ("temperature", "hot"),
    ],
)
def test_invalid_sampling_params_name_the_field(engine, field, value):
    with pytest.raises(SamplingParamsError) as e:
        engine.add_request([1, 2, 3], {field: value})
    assert e.value.field == field and field in str(e.value)


def test_none_means_default(engine):
    out = engine.generate([5, 6, 7], {"max_new_tokens": 2, "top_p": None, "temperature": 0})
    assert len(out["output_ids"]) == 2


def test_bad_prompts(engine):
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestError, match="300 tokens, the context length is 256"):
        engine.add_request([5] * 300, GREEDY)
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request([5, 10**7], GREEDY)


def test_abort_frees_pages(engine):
    rids = engine.add_request(mixed_prompts(1, seed=9)[0], {"max_new_tokens": 50, "temperature": 0})
    engine.step()
    assert engine.abort(rids[0])
    outs = engine.step()
    assert any(o.rid == rids[0] and o.meta.finish_reason.kind == "abort" for o in outs)
    while engine.has_unfinished():
        engine.step()
    engine.cache.check_integrity([])
    assert engine.cache.allocator.num_free * engine.args.page_size + engine.cache.tree.total_size() == engine.runner.pool_shape.num_tokens


def test_prompt_and_output_logprobs_match_transformers(engine, tiny_model_dir):
    torch = pytest.importorskip("torch")
    import transformers

    prompt = list(range(100, 170))
    engine.generate(prompt[:40], {"max_new_tokens": 1})  # the cache holds part of the prompt
    engine.add_request(prompt, {"max_new_tokens": 2, "temperature": 0}, return_logprob=True,
                       top_logprobs_num=3, logprob_start_len=5)
    final = None
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.finished), final)
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt + final.output_ids])
        ref = torch.log_softmax(model(ids).logits[0].double(), -1).numpy()
    meta = final.meta
    assert [t for _, t in meta.input_token_logprobs] == prompt[5:]
    ours_in = np.array([lp for lp, _ in meta.input_token_logprobs])
    np.testing.assert_allclose(ours_in, [ref[i - 1, prompt[i]] for i in range(5, len(prompt))], atol=1e-4)
    ours_out = np.array([lp for lp, _ in meta.output_token_logprobs])
    pos = [len(prompt) - 1, len(prompt)]
    np.testing.assert_allclose(ours_out, [ref[p, t] for p, t in zip(pos, final.output_ids)], atol=1e-4)
    top = meta.output_top_logprobs[0]
    assert [t for _, t in top] == list(np.argsort(-ref[pos[0]])[:3])


def test_pallas_backend_matches_xla_end_to_end(tiny_model_dir):
    """The engine with --attention-backend pallas (interpret mode on CPU) gives the XLA path's tokens."""
    prompts = mixed_prompts(3, seed=11)
    kw = dict(max_total_tokens=512, max_running_requests=4, chunked_prefill_size=32, context_length=128)
    params = {"max_new_tokens": 4, "temperature": 0}
    xla = make_engine(tiny_model_dir, attention_backend="xla", **kw).generate([p[:100] for p in prompts], params)
    pallas = make_engine(tiny_model_dir, attention_backend="pallas", **kw).generate([p[:100] for p in prompts], params)
    assert [o["output_ids"] for o in pallas] == [o["output_ids"] for o in xla]
