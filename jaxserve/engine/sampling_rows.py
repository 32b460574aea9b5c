"""The sampler's inputs for a batch of requests: one row per token to sample, and the warm-up variants.

A plain step samples one row per request; a verification step (`Engine._launch_verify`) one row per
(request, draft prefix). Both build their `SamplingBatch` here, so a request is sampled the same
way whichever step runs it.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from jaxserve.constrained.bitmask import allocate_bitmask
from jaxserve.constrained.reasoner import ReasonerMatcher
from jaxserve.core.request import Req
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.runner import sampler as sampler_lib


def top_logprobs_bucket(n: int) -> int:
    """Round the batch's top-logprobs count up to 0, 5 or 20 so each value does not compile a sampler."""
    return 0 if n == 0 else (5 if n <= 5 else 20)


def grammar_bitmask(reqs: Sequence[Req], grammar_backend: Any, vocab_size: int) -> np.ndarray | None:
    """The allowed-token bitmask of a batch (`bitmask.allocate_bitmask`'s [S, ceil(V / 32)] int32), one
    row per request, or None when no request is under a grammar."""
    if not any(r.grammar is not None for r in reqs):
        return None
    bitmask = allocate_bitmask(len(reqs), vocab_size)
    # a grammar waiting for the reasoning's end allows every token: its row stays as allocated, and
    # the backend sees its own matchers only
    matchers = [(r.grammar.constraining if isinstance(r.grammar, ReasonerMatcher) else r.grammar, i)
                for i, r in enumerate(reqs) if r.grammar is not None]
    # one call for the batch: the llguidance backend fills the rows in parallel outside the GIL
    grammar_backend.fill_bitmask_batch([(m, i) for m, i in matchers if m is not None], bitmask)
    return bitmask


def sampling_rows(rows: Sequence[tuple[Req, Sequence[int]]], bitmask: np.ndarray | None, num_seqs: int,
                  vocab_size: int, eos_token_ids: Sequence[int]):
    """Sampler inputs with one row per (request, draft tokens before the row): a row samples the
    request's output token number len(output_ids) + len(draft) (plain decoding: no draft).

    Returns `sampler.build_sampling_batch`'s (SamplingBatch, flags), padded to `num_seqs` rows.
    """
    reqs = [r for r, _ in rows]
    with_logprob = [r for r in reqs if r.return_logprob]
    any_penalty = any(
        r.sampling_params.frequency_penalty or r.sampling_params.presence_penalty
        or r.sampling_params.repetition_penalty != 1 for r in reqs
    )
    return sampler_lib.build_sampling_batch(
        [r.sampling_params for r in reqs],
        [r.seed for r in reqs],
        [len(r.output_ids) + len(d) for r, d in rows],
        [(r.fill_ids + list(d), len(r.input_ids)) for r, d in rows] if any_penalty else None,
        bitmask,
        num_seqs,
        vocab_size,
        eos_token_ids=eos_token_ids,
        return_logprob=bool(with_logprob),
        num_top_logprobs=top_logprobs_bucket(max((r.top_logprobs_num for r in with_logprob), default=0)),
        logprob_token_ids=[r.token_ids_logprob if r.return_logprob else () for r in reqs],
    )


def sampler_warmup_variants(num_seqs_buckets: Iterable[int], vocab_size: int):
    """The (SamplingBatch, flags) pairs `ModelRunner.precompile` warms the sampler with, at every
    compiled batch size (numpy, as `Engine.step` passes them): greedy, temperature, and temperature
    with top_k, top_p and both (each filter is its own program; min_p needs none). The filters are
    what OpenAI clients send most; on CPU each compiles in 0.5-0.9 s alone
    (D-19) and took 2.6-4.1 s per batch size on first use beside
    serving steps. Logprobs, grammar bitmasks, penalties and logit_bias still compile on first use
    (README.md, "first-use variants")."""
    filters = ({}, {"top_k": 20}, {"top_p": 0.9}, {"top_k": 20, "top_p": 0.9})
    variants = []
    for s in sorted(set(num_seqs_buckets)):
        for params in [SamplingParams(temperature=0.0)] + [SamplingParams(temperature=1.0, **f) for f in filters]:
            variants.append(sampler_lib.build_sampling_batch([params], [0], [0], None, None, s, vocab_size))
    return variants
