"""logit_bias in the jitted sampler and in SamplingParams: against a numpy reference (add the bias,
then argmax / softmax), one compiled sampler for any bias, and the validation errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.core.errors import SamplingParamsError
from jaxserve.core.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from jaxserve.runner.sampler import build_sampling_batch, sample

V = 100


def _run(logits, params, seeds=None):
    n = len(params)
    batch, flags = build_sampling_batch(params, seeds or list(range(n)), [0] * n, None, None, n, V)
    return np.asarray(jax.jit(sample, static_argnums=2)(np.asarray(logits, np.float32), batch, flags).next_tokens), flags, batch


def test_greedy_with_bias_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, V)).astype(np.float32)
    biases = [{"5": 100, "17": -3.5}, {str(int(np.argmax(logits[1]))): -100}, {}]
    params = [SamplingParams.from_dict({"temperature": 0, "logit_bias": b}) for b in biases]
    got, flags, _ = _run(logits, params)
    assert flags.use_logit_bias
    want = []
    for row, bias in zip(logits, biases):
        ref = row.astype(np.float64).copy()
        for k, v in bias.items():
            ref[int(k)] += v
        want.append(int(np.argmax(ref)))
    assert got.tolist() == want
    assert got[0] == 5 and got[1] != int(np.argmax(logits[1]))


def test_sampled_rows_follow_the_biased_distribution():
    # a +100 bias on one token puts ~all the mass there; -100 on the others' favourite removes it
    logits = np.zeros((64, V), np.float32)
    params = [SamplingParams.from_dict({"temperature": 1.0, "seed": i, "logit_bias": {"42": 100}}) for i in range(64)]
    got, _, _ = _run(logits, params, seeds=list(range(64)))
    assert set(got.tolist()) == {42}
    params = [SamplingParams.from_dict({"temperature": 1.0, "logit_bias": {str(t): -100 for t in range(V) if t != 7}})
              for _ in range(8)]
    got, _, _ = _run(logits[:8], params, seeds=list(range(8)))
    assert set(got.tolist()) == {7}


def test_fixed_width_means_one_compile():
    small = SamplingParams.from_dict({"temperature": 0, "logit_bias": {"1": 1}})
    large = SamplingParams.from_dict({"temperature": 0, "logit_bias": {str(t): 0.5 for t in range(90)}})
    _, f1, b1 = _run(np.zeros((1, V)), [small])
    _, f2, b2 = _run(np.zeros((1, V)), [large])
    assert f1 == f2 and b1.logit_bias_ids.shape == b2.logit_bias_ids.shape == (1, MAX_LOGIT_BIAS_ENTRIES)
    _, f3, b3 = _run(np.zeros((1, V)), [SamplingParams(temperature=0)])
    assert not f3.use_logit_bias and b3.logit_bias_ids.shape == (1, 1)


@pytest.mark.parametrize("bias, message", [
    ({"abc": 1}, "keys must be integer token ids"),
    ({"1.5": 1}, "keys must be integer token ids"),
    ({"-3": 1}, "non-negative token ids"),
    ({"3": 100.5}, "in [-100, 100]"),
    ({"3": -101}, "in [-100, 100]"),
    ({"3": "x"}, "must be numbers"),
    ({"3": True}, "must be numbers"),
    ({str(t): 1 for t in range(MAX_LOGIT_BIAS_ENTRIES + 1)}, "at most 300"),
    ([1, 2], "must be an object"),
])
def test_invalid_logit_bias(bias, message):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.from_dict({"logit_bias": bias}).validate()
    assert e.value.field == "logit_bias" and message in str(e.value)


def test_bias_pairs_sorted_and_integer_keys_accepted():
    p = SamplingParams.from_dict({"logit_bias": {"9": 1, 3: -2, "100": 100}})
    assert p.logit_bias == ((3, -2.0), (9, 1.0), (100, 100.0))
