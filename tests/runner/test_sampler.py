"""Tests of the batched sampler against independent numpy references (sort-based filters, loop-based
penalties, numpy log-softmax), under jax.jit with the flags static."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.runner.sampler import (
    SamplerFlags,
    SamplingBatch,
    apply_penalties,
    bitmask_width,
    build_sampling_batch,
    first_argmax,
    sample,
)

V = 100  # deliberately not a multiple of 32

sample_jit = jax.jit(sample, static_argnums=2)


def build(params, *, seeds=None, steps=None, histories=None, bitmask=None, num_seqs=None, vocab_size=V, **kw):
    n = len(params)
    batch, flags = build_sampling_batch(
        params,
        seeds if seeds is not None else list(range(n)),
        steps if steps is not None else [0] * n,
        histories,
        bitmask,
        num_seqs if num_seqs is not None else n,
        vocab_size,
        **kw,
    )
    return jax.device_put(batch), flags


def run(logits, params, **kw):
    batch, flags = build(params, **kw)
    out = sample_jit(np.asarray(logits, np.float32), batch, flags)
    return jax.tree.map(np.asarray, out), flags


# ---- numpy references -------------------------------------------------------------------------


def np_penalties(logits, history, num_prompt, p: SamplingParams):
    out = np.array(logits, np.float64)
    for t in set(history):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(history[num_prompt:]):
        count = list(history[num_prompt:]).count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty
    return out


def np_filtered_probs(logits, p: SamplingParams):
    """Sampling distribution by the textbook recipe: sort, top-k, renormalise, top-p, min-p."""
    x = np.asarray(logits, np.float64) / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), bool)
    k = len(probs) if p.top_k == -1 else p.top_k
    keep[order[:k]] = True
    q = np.where(keep, probs, 0)
    q /= q.sum()
    sorted_q = q[order]
    exclusive = np.cumsum(sorted_q) - sorted_q
    if p.top_p < 1:
        keep[order[exclusive >= p.top_p]] = False
    keep &= probs >= p.min_p * probs.max()
    out = np.where(keep, probs, 0)
    return out / out.sum()


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# ---- tests ------------------------------------------------------------------------------------


def test_greedy_rows_take_argmax_and_padding_rows_are_greedy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, V)) * 3
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(temperature=0.8, top_k=1)]
    out, flags = run(logits, params, num_seqs=8)
    assert flags.all_greedy
    np.testing.assert_array_equal(out.next_tokens, logits.argmax(-1))
    assert out.top_ids.shape == (8, 0)


def test_penalties_match_numpy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 4
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.7),
        SamplingParams(temperature=0, frequency_penalty=1.5, presence_penalty=-0.5),
        SamplingParams(temperature=0, frequency_penalty=-0.3, presence_penalty=2.0, repetition_penalty=0.6),
        SamplingParams(temperature=0),
    ]
    histories = []
    for i in range(4):
        ids = list(rng.integers(0, 20, size=int(rng.integers(1, 40))))
        histories.append((ids, int(rng.integers(0, len(ids) + 1))))
    batch, flags = build(params, histories=histories, num_seqs=4)
    assert flags.use_penalties and batch.token_history.shape == (4, 64)
    got = np.asarray(jax.jit(apply_penalties)(logits, batch))
    want = np.stack([np_penalties(logits[i], h, n, params[i]) for i, (h, n) in enumerate(histories)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    out = sample_jit(logits, batch, flags)
    np.testing.assert_array_equal(np.asarray(out.next_tokens), want.argmax(-1))


def test_bitmask_is_respected_for_every_seed_and_filter():
    num_rows = 512
    rng = np.random.default_rng(2)
    allowed = rng.random((num_rows, V)) < 0.1
    allowed[np.arange(num_rows), rng.integers(0, V, num_rows)] = True
    # Disallowed tokens are the likely ones, so any leak would show.
    logits = np.where(allowed, 0.0, 8.0) + rng.normal(size=(num_rows, V))
    bits = np.zeros((num_rows, bitmask_width(V) * 32), np.uint64)
    bits[:, :V] = allowed
    words = (bits.reshape(num_rows, -1, 32) << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)
    kinds = [
        SamplingParams(),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.3, temperature=2.0),
        SamplingParams(temperature=0),
    ]
    params = [kinds[i % len(kinds)] for i in range(num_rows)]
    out, flags = run(logits, params, bitmask=words.view(np.int32))
    assert flags.use_bitmask and flags.use_top_k and flags.use_top_p
    assert allowed[np.arange(num_rows), out.next_tokens].all()


def test_min_new_tokens_bans_stop_tokens_through_the_bitmask():
    logits = np.zeros((3, V), np.float32)
    logits[:, 7] = 50.0  # EOS
    logits[:, 9] = 40.0  # a stop token id
    params = [SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=(9,))] * 2 + [
        SamplingParams(temperature=0, min_new_tokens=5, ignore_eos=True)
    ]
    out, flags = run(logits, params, steps=[1, 2, 0], eos_token_ids=[7])
    assert flags.use_bitmask
    # Row 0 is still under min_new_tokens: neither EOS nor the stop id; row 1 is past it; row 2
    # ignores EOS, so EOS stays allowed.
    assert out.next_tokens[0] not in (7, 9)
    np.testing.assert_array_equal(out.next_tokens[1:], [7, 7])


def test_filtered_distributions_match_numpy():
    num_draws = 2000
    vocab = 12
    probs = np.array([0.25, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05, 0.03, 0.01, 0.005, 0.003, 0.002])
    row_logits = np.log(probs[np.random.default_rng(3).permutation(vocab)])
    configs = [
        SamplingParams(top_k=4),
        SamplingParams(top_p=0.65),
        SamplingParams(min_p=0.3),
        # top-p over the top-k renormalised mass keeps 3 tokens here; over the raw mass it would keep 5.
        SamplingParams(temperature=1.3, top_k=5, top_p=0.7, min_p=0.05),
        SamplingParams(temperature=0.8),
    ]
    params = [c for c in configs for _ in range(num_draws)]
    logits = np.tile(row_logits, (len(params), 1))
    out, flags = run(logits, params, seeds=list(range(len(params))), vocab_size=vocab)
    assert flags.use_top_k and flags.use_top_p and not flags.all_greedy
    for i, config in enumerate(configs):
        tokens = out.next_tokens[i * num_draws : (i + 1) * num_draws]
        want = np_filtered_probs(row_logits, config)
        got = np.bincount(tokens, minlength=vocab) / num_draws
        assert set(np.flatnonzero(got)) <= set(np.flatnonzero(want)), (config, got, want)
        assert (got[want > 0.02] > 0).all(), (config, got, want)
        total_variation = 0.5 * np.abs(got - want).sum()
        assert total_variation < 0.06, (config, total_variation, got, want)


def test_unfiltered_distribution_matches_softmax():
    num_draws = 2000
    rng = np.random.default_rng(4)
    vocab = 40
    row_logits = rng.normal(size=vocab)
    params = [SamplingParams(temperature=0.9)] * num_draws
    out, flags = run(np.tile(row_logits, (num_draws, 1)), params, seeds=list(range(1000, 1000 + num_draws)), vocab_size=vocab)
    assert not (flags.use_top_k or flags.use_top_p or flags.all_greedy)
    want = np.exp(np_log_softmax(row_logits / 0.9))
    got = np.bincount(out.next_tokens, minlength=vocab) / num_draws
    assert 0.5 * np.abs(got - want).sum() < 0.06


def test_seeded_request_draws_the_same_tokens_in_any_batch():
    vocab = 1000
    rng = np.random.default_rng(5)
    logits = rng.normal(size=vocab).astype(np.float32)
    target = SamplingParams(temperature=1.3, seed=1234)
    others = [SamplingParams(temperature=0.5, top_k=20), SamplingParams(top_p=0.7), SamplingParams(temperature=0)]

    def tokens_at(row: int, num_seqs: int, num_real: int) -> list[int]:
        result = []
        for step in range(8):
            params = [others[i % 3] for i in range(num_real)]
            params[row] = target
            seeds = [int(s) for s in rng.integers(0, 2**31, num_real)]
            seeds[row] = 1234
            batch_logits = rng.normal(size=(num_seqs, vocab)).astype(np.float32)
            batch_logits[row] = logits
            out, _ = run(batch_logits, params, seeds=seeds, steps=[step] * num_real, num_seqs=num_seqs, vocab_size=vocab)
            result.append(int(out.next_tokens[row]))
        return result

    alone = tokens_at(0, 1, 1)
    assert len(set(alone)) > 1  # the step changes the draw
    assert tokens_at(5, 8, 8) == alone
    assert tokens_at(3, 16, 6) == alone
    # A different seed gives a different sequence.
    batch, flags = build([dataclasses.replace(target, seed=99)], seeds=[99], vocab_size=vocab)
    other = [int(sample_jit(logits[None], dataclasses.replace(batch, step=batch.step + s), flags).next_tokens[0]) for s in range(8)]
    assert other != alone


def test_logprobs_and_top_logprobs_use_the_raw_logits():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 2
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=1.5),
        SamplingParams(temperature=0),
        SamplingParams(top_k=4),
        SamplingParams(temperature=2.0),
    ]
    histories = [([1, 2, 3], 1)] * 4
    out, flags = run(logits, params, histories=histories, num_top_logprobs=5)
    assert flags.return_logprob and flags.num_top_logprobs == 5
    want = np_log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, want[np.arange(4), out.next_tokens], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-want, axis=-1, kind="stable")[:, :5])
    np.testing.assert_allclose(out.top_logprobs, np.sort(want, axis=-1)[:, ::-1][:, :5], atol=1e-5)


def test_builder_pads_and_sets_flags():
    params = [SamplingParams(top_k=-1, top_p=0.9, seed=2**40 + 3), SamplingParams(frequency_penalty=0.5)]
    batch, flags = build_sampling_batch(
        params, [2**40 + 3, 7], [0, 3], [([5] * 20, 10), ([1, 2], 1)], None, 4, V
    )
    assert isinstance(batch, SamplingBatch)
    assert flags == SamplerFlags(all_greedy=False, use_top_k=False, use_top_p=True, use_penalties=True)
    np.testing.assert_array_equal(batch.temperature, [1, 1, 0, 0])
    np.testing.assert_array_equal(batch.top_k, [V] * 4)
    np.testing.assert_array_equal(batch.seed, [3, 7, 0, 0])
    assert batch.seed.dtype == np.uint32
    assert batch.token_history.shape == (4, 32) and batch.bitmask.shape == (4, 1)
    np.testing.assert_array_equal(batch.history_is_output[0, 8:12], [False, False, True, True])
    assert (batch.token_history[2:] == -1).all()


def test_builder_rejects_bad_input():
    with pytest.raises(ValueError, match="num_seqs"):
        build_sampling_batch([SamplingParams()], [0], [0], None, None, 0, V)
    with pytest.raises(ValueError, match="histor"):
        build_sampling_batch([SamplingParams(presence_penalty=1.0)], [0], [0], None, None, 1, V)
    with pytest.raises(ValueError, match="bitmask"):
        build_sampling_batch([SamplingParams()], [0], [0], None, np.zeros((1, 2), np.int32), 1, V)
    with pytest.raises(ValueError):
        SamplerFlags(num_top_logprobs=2)


def test_first_argmax_is_numpys_argmax_with_ties_infinities_and_nans():
    """The greedy pick's max-then-min-index form against numpy's argmax (its first maximum; NumPy, like
    jnp.argmax, returns the first NaN of a row that has one), on rows with ties, -inf rows, +inf and
    NaN, at the widths of a batch-1 decode and a 16-row verification over a 49,152-token vocabulary."""
    rng = np.random.default_rng(0)
    for num_rows, vocab_size in ((1, 49152), (16, 49152), (7, 100)):
        x = rng.standard_normal((num_rows, vocab_size)).astype(np.float32)
        x[0, [5, 9, vocab_size - 1]] = 50.0  # a three-way tie: the first wins
        if num_rows > 1:
            x[1] = -np.inf  # a row the bitmask closed entirely: token 0
        if num_rows > 2:
            x[2, [3, 17]] = [np.inf, np.nan]  # NaN beats +inf, as in numpy
            x[3, [40, 41]] = np.inf
            x[4] = np.round(x[4])  # many ties
        got = np.asarray(jax.jit(first_argmax)(x))
        np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def test_a_temperature_past_float32_samples_only_allowed_tokens_without_a_warning():
    """1e308 is valid JSON: cast to float32 it was inf (a numpy overflow warning), and a masked logit
    (-inf) / inf is NaN. It samples as the largest float32 does: only the bitmask's tokens."""
    import warnings

    allowed = np.zeros((4, V), bool)
    allowed[:, [3, 50, 97]] = True
    bits = np.zeros((4, bitmask_width(V) * 32), np.uint64)
    bits[:, :V] = allowed
    words = (bits.reshape(4, -1, 32) << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = run(np.random.default_rng(0).normal(size=(4, V)), [SamplingParams(temperature=1e308)] * 4,
                     bitmask=words.view(np.int32), seeds=[1, 2, 3, 4])
    assert allowed[np.arange(4), out.next_tokens].all()
