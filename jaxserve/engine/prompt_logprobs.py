"""Prompt-position logprobs: which step variant a batch needs, and storing what it returned on each request.

SGLang 0.5.23 (`LogprobResultProcessor.add_input_logprob_return_values`) returns, for the prompt
positions from `logprob_start_len` on, the logprob of each prompt token (`input_token_logprobs`),
with `top_logprobs_num` > 0 the most likely tokens there (`input_top_logprobs`), and with
`token_ids_logprob` the logprobs of those ids there (`input_token_ids_logprobs`). Position p's values
come from the distribution that predicts input[p], the logits at p - 1; position 0 has none (null).

Three variants of the compiled step (`ModelRunner.forward(input_logprobs=...)`):
- False: no prompt positions in the batch ask (every step of a request that does not ask);
- True: the packed tokens' own logprobs [T] only (`input_token_logprobs`);
- "full": the log-softmax [T, V] of every packed token, when a request of the batch also asks for the
  top-k or chosen ids at prompt positions. Top-k and the id gathers then run here in numpy over the
  rows of the requests that ask, so every `top_logprobs_num` (1..20) and every id list share one
  compiled program per bucket (the output side's sampler compiles a variant per top-k bucket).

Cached prompt positions are recomputed, as in SGLang (its `Req.init_next_round_input` caps the prefix
match at `logprob_start_len`): `CacheManager.match` matches at most `logprob_start_len - 1` tokens of
a request that asks, so every position whose logprobs are returned runs in a step of this request.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxserve.core.request import Req


def wants_prompt_rows(req: Req) -> bool:
    """The request still has prompt positions to run and asked for their logprobs."""
    return req.wants_input_logprobs and req.kv_len < len(req.input_ids)


def needs_full_rows(req: Req) -> bool:
    """Besides the prompt tokens' own logprobs, the top-k or chosen ids at prompt positions."""
    return req.top_logprobs_num > 0 or bool(req.token_ids_logprob)


def step_variant(reqs: Sequence[Req]) -> bool | str:
    """The `input_logprobs` argument of `ModelRunner.forward` for a batch of `reqs` (module docstring)."""
    asking = [r for r in reqs if wants_prompt_rows(r)]
    if not asking:
        return False
    return "full" if any(needs_full_rows(r) for r in asking) else True


def record(reqs: Sequence[Req], extend_lens: Sequence[int], rows: np.ndarray) -> None:
    """Store the prompt logprobs of this step's positions on each request that asked for them.

    Args:
        reqs, extend_lens: the step's requests and their new tokens, packed in this order.
        rows: the step's prompt logprobs: [T] log p(next token | prefix) of each packed token (variant
            True), or [T, V] log-softmax of each packed token's next-token distribution ("full").

    Position `kv_len + j + 1` of a request (the token after its j-th new token) gets row `t + j`; the
    lists are as long as the prompt and start as None, so position 0 stays None.
    """
    full = rows.ndim == 2
    t = 0
    for req, n in zip(reqs, extend_lens):
        if req.wants_input_logprobs:
            _record_req(req, n, rows[t : t + n], full)
        t += n


def _record_req(req: Req, n: int, rows: np.ndarray, full: bool) -> None:
    num_prompt = len(req.input_ids)
    if req.input_token_logprobs is None:
        req.input_token_logprobs = [None] * num_prompt
    positions = [req.kv_len + j + 1 for j in range(n) if req.kv_len + j + 1 < num_prompt]
    if not positions:
        return
    if not full:
        for p in positions:
            req.input_token_logprobs[p] = float(rows[p - req.kv_len - 1])
        return
    picked = rows[: len(positions)]  # rows j = p - kv_len - 1 for p in positions: the first len(positions)
    targets = np.asarray([req.input_ids[p] for p in positions])
    own = picked[np.arange(len(positions)), targets]
    for p, lp in zip(positions, own):
        req.input_token_logprobs[p] = float(lp)
    if req.top_logprobs_num > 0:
        if req.input_top_logprobs is None:
            req.input_top_logprobs = [None] * num_prompt
        ids, vals = top_k(picked, req.top_logprobs_num)
        for i, p in enumerate(positions):
            req.input_top_logprobs[p] = [(float(v), int(k)) for v, k in zip(vals[i], ids[i])]
    if req.token_ids_logprob:
        if req.input_token_ids_logprobs is None:
            req.input_token_ids_logprobs = [None] * num_prompt
        chosen = picked[:, list(req.token_ids_logprob)]
        for i, p in enumerate(positions):
            req.input_token_ids_logprobs[p] = [float(x) for x in chosen[i]]


def top_k(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The `k` largest entries of each row of `logprobs` [N, V]: (ids [N, k], values [N, k]), most
    likely first. O(N V) (a partition, then a sort of the k)."""
    k = min(k, logprobs.shape[1])
    part = np.argpartition(-logprobs, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(logprobs, part, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1), np.take_along_axis(vals, order, axis=1)
