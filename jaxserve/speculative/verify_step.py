"""The engine step of a verification batch: every request's last token + its draft in one forward.

Position j of a request is sampled exactly as plain decoding samples its output token number
len(output) + j (`acceptance`), the longest agreeing draft prefix plus the next sample is emitted one
token at a time (so EOS, stop strings, max_new_tokens and the grammar end a run where plain decoding
would), and the KV written for rejected drafts is rolled back: `kv_len`, and the pages past it
(`CacheManager.truncate`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from jaxserve.runner.model_runner import BatchEntry
from jaxserve.engine.outputs import StepOutput
from jaxserve.scheduler.scheduler import ScheduleBatch
from jaxserve.speculative.acceptance import num_accepted
from jaxserve.speculative.decoder import constrain_drafts

if TYPE_CHECKING:
    from jaxserve.engine.engine import Engine


def verify_step(engine: "Engine", batch: ScheduleBatch, drafts: list[list[int]], t0: float) -> list[StepOutput]:
    """Run `batch` (decode-only) with `drafts` (one per request, some empty) as one verification step
    of `engine` and return each request's progress. `t0`: the step's start (perf_counter seconds), for
    the measured step costs. Uses the engine's own sampling and postprocess (`Engine._sampling_rows`,
    `_emit_sampled`, `_jump_forward`, `_output`)."""
    reqs = batch.reqs
    bitmask = None
    if any(r.grammar is not None for r in reqs):
        drafts, bitmask = constrain_drafts(reqs, drafts, engine.model_config.vocab_size)
    entries = [
        BatchEntry([r.fill_ids[r.kv_len]] + d, r.kv_len, r.page_table, num_logits=1 + len(d))
        for r, d in zip(reqs, drafts)
    ]
    logits = engine.runner.forward(entries)
    rows = [(r, d[:j]) for r, d in zip(reqs, drafts) for j in range(len(d) + 1)]
    sampling, flags = engine._sampling_rows(rows, bitmask, logits.shape[0])
    sampled = engine.runner.sample(logits, sampling, flags)
    seconds = time.perf_counter() - t0
    engine.scheduler.observe_step(batch, seconds)
    engine.speculator.observe_verify(drafts, seconds)
    engine._count_step(True)
    now, outputs, row = time.perf_counter(), [], 0
    for req, draft in zip(reqs, drafts):
        target = [int(t) for t in sampled.next_tokens[row : row + len(draft) + 1]]
        accepted = num_accepted(draft, target)
        engine.stats.num_spec_verifications += 1
        engine.stats.num_spec_draft_tokens += len(draft)
        engine.stats.num_spec_accepted_tokens += accepted
        engine.speculator.record(req, len(draft), accepted)
        base, new_ids, delta = req.kv_len, [], ""
        for i, token in enumerate(target[: accepted + 1]):
            req.kv_len = base + 1 + i  # the KV of every token before this one is in the pool
            ids, text = engine._emit_sampled(req, token, sampled, row + i, now)
            new_ids, delta = new_ids + ids, delta + text
            if req.is_finished:
                break
        if not req.is_finished:
            engine.cache.truncate(req)  # pages that held only rejected drafts
            more_ids, more_text = engine._jump_forward(req)
            new_ids, delta = new_ids + more_ids, delta + more_text
        outputs.append(engine._output(req, new_ids, delta))
        row += len(draft) + 1
    return outputs
