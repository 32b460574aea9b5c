"""SGLang's `token_ids_logprob`: logprobs of chosen token ids at every output position, against
transformers on the tiny checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.core.errors import RequestError
from jaxserve.core.request import finish_length
from tests.engine.test_engine import make_engine

WATCHED = [0, 7, 512, 40000, 49151]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def run(engine, prompt, params, **kwargs):
    engine.add_request(prompt, params, **kwargs)
    final = None
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.finished), final)
    return final


def test_token_ids_logprobs_match_transformers(engine, tiny_model_dir):
    torch = pytest.importorskip("torch")
    import transformers

    prompt = list(range(200, 230))
    final = run(engine, prompt, {"max_new_tokens": 3, "temperature": 0}, return_logprob=True,
                token_ids_logprob=WATCHED)
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + final.output_ids])).logits[0].double(), -1).numpy()
    picked = final.meta.output_token_ids_logprobs
    assert len(picked) == len(final.output_ids) == 3
    for step, row in enumerate(picked):
        assert [t for _, t in row] == WATCHED
        np.testing.assert_allclose([lp for lp, _ in row], ref[len(prompt) - 1 + step, WATCHED], atol=1e-4)


def test_batch_mixes_requests_with_and_without_token_ids(engine):
    engine.add_request([5, 6, 7, 8], {"max_new_tokens": 2, "temperature": 0}, rid="plain")
    engine.add_request([5, 6, 7, 8], {"max_new_tokens": 2, "temperature": 0}, rid="watch",
                       return_logprob=True, token_ids_logprob=[3])
    finals = {}
    while engine.has_unfinished():
        finals.update({o.rid: o for o in engine.step() if o.finished})
    assert finals["plain"].meta.output_token_ids_logprobs is None
    assert finals["plain"].output_ids == finals["watch"].output_ids
    assert len(finals["watch"].meta.output_token_ids_logprobs) == 2


@pytest.mark.parametrize("ids", [[-1], [49152], ["3"], [True], list(range(129))])
def test_bad_token_ids_are_refused(engine, ids):
    with pytest.raises(RequestError) as info:
        engine.add_request([1, 2, 3], {"max_new_tokens": 1}, return_logprob=True, token_ids_logprob=ids)
    assert info.value.field == "token_ids_logprob"


def test_max_new_tokens_zero_still_returns_prompt_logprobs(engine):
    """SGLang's frontend scores `select` choices with max_new_tokens 0 and prompt logprobs."""
    prompt = list(range(300, 320))
    ref = run(engine, prompt, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True, logprob_start_len=3)
    zero = run(engine, prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=3)
    assert zero.output_ids == [] and zero.meta.finish_reason == finish_length(0)
    assert [t for _, t in zero.meta.input_token_logprobs] == prompt[3:]
    np.testing.assert_allclose([lp for lp, _ in zero.meta.input_token_logprobs[1:]],
                               [lp for lp, _ in ref.meta.input_token_logprobs[1:]], atol=1e-5)
    engine.cache.check_integrity([])
