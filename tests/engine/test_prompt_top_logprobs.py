"""Prompt positions' top logprobs and chosen-id logprobs (SGLang's `input_top_logprobs` and
`input_token_ids_logprobs`; jaxserve/engine/prompt_logprobs.py) against transformers' log-softmax of
the tiny checkpoint's full logits: alone, in a batch, over chunked prefill, with the prompt cached,
and with no compile per top-k or id list."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine.prompt_logprobs import top_k
from tests.engine.test_engine import make_engine

WATCHED = [0, 7, 512, 40000]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """log_softmax [len(prompt), V] (float64) of the prompt's logits, from transformers."""
    torch = pytest.importorskip("torch")
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()

    def logprobs(prompt: list[int]) -> np.ndarray:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1).numpy()

    return logprobs


def finish(engine, *requests) -> dict:
    """Add (rid, prompt, params, kwargs) requests together, step to the end; the final outputs by rid."""
    for rid, prompt, params, kwargs in requests:
        engine.add_request(prompt, params, rid=rid, **kwargs)
    finals = {}
    while engine.has_unfinished():
        finals.update({o.rid: o for o in engine.step() if o.finished})
    return finals


def check_prompt_rows(meta, prompt: list[int], start: int, k: int, ids: list[int], ref: np.ndarray) -> None:
    """meta's input_* lists hold, for each prompt position p >= start, the reference distribution at p - 1."""
    n = len(prompt) - start
    assert len(meta.input_token_logprobs) == len(meta.input_top_logprobs) == n
    for j, p in enumerate(range(start, len(prompt))):
        top = meta.input_top_logprobs[j]
        if p == 0:  # nothing predicts the first token, as in SGLang
            assert top is None and meta.input_token_logprobs[j][0] is None
            if ids:
                assert meta.input_token_ids_logprobs[j] is None
            continue
        expect = np.argsort(-ref[p - 1], kind="stable")[:k]
        assert [t for _, t in top] == list(expect), p
        np.testing.assert_allclose([lp for lp, _ in top], ref[p - 1, expect], atol=1e-4)
        np.testing.assert_allclose(meta.input_token_logprobs[j][0], ref[p - 1, prompt[p]], atol=1e-4)
        if ids:
            picked = meta.input_token_ids_logprobs[j]
            assert [t for _, t in picked] == ids
            np.testing.assert_allclose([lp for lp, _ in picked], ref[p - 1, ids], atol=1e-4)
    if not ids:
        assert meta.input_token_ids_logprobs is None


@pytest.mark.parametrize("start", [0, 7])
def test_prompt_top_logprobs_over_chunked_prefill_match_transformers(engine, reference, start):
    prompt = list(range(1000, 1100))  # two 64-token chunks
    final = finish(engine, ("a", prompt, {"max_new_tokens": 2, "temperature": 0},
                            dict(return_logprob=True, top_logprobs_num=5, logprob_start_len=start, token_ids_logprob=WATCHED)))["a"]
    check_prompt_rows(final.meta, prompt, start, 5, WATCHED, reference(prompt))
    assert len(final.meta.output_top_logprobs) == 2  # the output side is unchanged


def test_a_batch_mixes_top_k_ids_plain_logprobs_and_plain_requests(engine, reference):
    prompts = {"top3": list(range(300, 340)), "ids": list(range(2000, 2030)), "lp": list(range(5, 25)), "plain": [9, 8, 7, 6]}
    greedy = {"max_new_tokens": 3, "temperature": 0}
    finals = finish(
        engine,
        ("top3", prompts["top3"], greedy, dict(return_logprob=True, top_logprobs_num=3, logprob_start_len=2)),
        ("ids", prompts["ids"], greedy, dict(return_logprob=True, logprob_start_len=0, token_ids_logprob=[5, 6])),
        ("lp", prompts["lp"], greedy, dict(return_logprob=True, logprob_start_len=1)),
        ("plain", prompts["plain"], greedy, {}),
    )
    check_prompt_rows(finals["top3"].meta, prompts["top3"], 2, 3, [], reference(prompts["top3"]))
    ids_meta = finals["ids"].meta
    assert ids_meta.input_top_logprobs is None  # top_logprobs_num 0: not asked
    ref = reference(prompts["ids"])
    assert ids_meta.input_token_ids_logprobs[0] is None
    for p in range(1, len(prompts["ids"])):
        np.testing.assert_allclose([lp for lp, _ in ids_meta.input_token_ids_logprobs[p]], ref[p - 1, [5, 6]], atol=1e-4)
    lp_meta = finals["lp"].meta
    assert lp_meta.input_top_logprobs is None and lp_meta.input_token_ids_logprobs is None
    ref = reference(prompts["lp"])
    np.testing.assert_allclose([lp for lp, _ in lp_meta.input_token_logprobs],
                               [ref[p - 1, prompts["lp"][p]] for p in range(1, len(prompts["lp"]))], atol=1e-4)
    assert finals["plain"].meta.input_token_logprobs is None
    alone = finish(engine, ("plain2", prompts["plain"], greedy, {}))["plain2"]
    assert finals["plain"].output_ids == alone.output_ids


def test_cached_prompt_positions_are_recomputed(engine, reference):
    """As SGLang (the prefix match stops before logprob_start_len), a cached prompt's asked positions
    are run again: the values equal an uncached run's and the reference."""
    engine.flush_cache()
    prompt = list(range(4000, 4080))
    greedy = {"max_new_tokens": 2, "temperature": 0}
    finish(engine, ("warm", prompt, greedy, {}))  # the whole prompt is in the radix tree now
    final = finish(engine, ("again", prompt, greedy, dict(return_logprob=True, top_logprobs_num=4, logprob_start_len=40,
                                                          token_ids_logprob=WATCHED)))["again"]
    assert 0 < final.meta.cached_tokens <= 39
    check_prompt_rows(final.meta, prompt, 40, 4, WATCHED, reference(prompt))
    engine.cache.check_integrity([])


def test_no_compile_per_top_k_or_id_list(engine):
    """Every top_logprobs_num and id list shares one prompt program per bucket (and the output side's
    top-k bucket 5 covers 1..5)."""
    prompt = list(range(600, 640))
    params = {"max_new_tokens": 1, "temperature": 0}
    finish(engine, ("first", prompt, params, dict(return_logprob=True, top_logprobs_num=5, logprob_start_len=0, token_ids_logprob=[1, 2])))
    before = engine.runner.num_compiles_after_warmup
    for i, (k, ids) in enumerate([(1, [3, 4]), (4, [40000, 5]), (2, [7, 8])]):
        final = finish(engine, (f"k{i}", prompt, params, dict(return_logprob=True, top_logprobs_num=k, logprob_start_len=0,
                                                           token_ids_logprob=ids)))[f"k{i}"]
        assert all(len(top) == k for top in final.meta.input_top_logprobs[1:])
    assert engine.runner.num_compiles_after_warmup == before


def test_top_k_orders_most_likely_first():
    rows = np.log(np.array([[0.1, 0.4, 0.2, 0.3], [0.7, 0.1, 0.1, 0.1]]))
    ids, vals = top_k(rows, 3)
    assert ids[0].tolist() == [1, 3, 2] and ids[1, 0] == 0
    np.testing.assert_allclose(vals[0], np.log([0.4, 0.3, 0.2]))
