"""The one output path: what a launched batch's sampled tokens do to its requests.

Every step kind ends here (mini-sglang's `_process_last_data`, shared by its normal and overlap
loops): a plain prefill or decode step, a decode step launched under the overlap schedule before the
previous one was read, and a speculative verification. Each row of a batch carries k accepted tokens
(1 without a draft; a verified draft's agreeing prefix plus the next sample otherwise), and each token
goes through the same append: logprobs, detokenize (stop strings), grammar, finish. Forced grammar
tokens are appended after them (jump-forward). The step's counts come back as `StepCounts`, which the
engine adds to its own stats: this module writes no engine state.

Speculative verification (`speculative/acceptance.py`): position j of a request is sampled exactly as
plain decoding samples its output token number len(output) + j, so the tokens are emitted one at a
time and EOS, stop strings, max_new_tokens and the grammar end a run where plain decoding would; the
KV written for rejected drafts is rolled back (`kv_len`, and the pages past it: `CacheManager.truncate`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from jaxserve.core.request import Req, finish_abort, finish_length, finish_stop
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.outputs import StepOutput, request_meta
from jaxserve.runner.sampler import SampleOutput
from jaxserve.scheduler.cache_manager import CacheManager
from jaxserve.scheduler.scheduler import ScheduleBatch, Scheduler
from jaxserve.speculative import NgramSpeculator
from jaxserve.speculative.acceptance import num_accepted


@dataclasses.dataclass
class LaunchedBatch:
    """A batch whose forward and sampling were dispatched, and what reading it needs.

    `drafts`: per request, the draft tokens verified with it ([] each in a plain step; `is_verify`
    says the step verified drafts, even where one request had none). `rows`: per request, its first
    row of `sampled` (a request verifying d drafts has d + 1 rows). `sampled` may still be on the
    device (the overlap schedule reads it after launching the next step). `launched`: perf_counter
    seconds when the batch was built. `produced`: per request, whether its sampled token is real (set
    by `OutputProcessor.advance`; a request mid-way through a chunked prompt discards it).
    """

    batch: ScheduleBatch
    drafts: list[list[int]]
    rows: list[int]
    sampled: SampleOutput
    launched: float
    is_verify: bool = False
    produced: list[bool] | None = None

    @classmethod
    def plain(cls, batch: ScheduleBatch, sampled: SampleOutput, launched: float) -> LaunchedBatch:
        """A step without drafts: one sampled row per request, in batch order."""
        return cls(batch, [[] for _ in batch.reqs], list(range(len(batch.reqs))), sampled, launched)

    @property
    def reqs(self) -> list[Req]:
        """The batch's requests, in row order."""
        return self.batch.reqs

    @property
    def has_every_row(self) -> bool:
        """No request left the batch since its launch (`OutputProcessor.advance` drops finished ones):
        `sampled` holds exactly the batch's rows, in order, as the overlap's followup step needs."""
        return self.rows == list(range(len(self.batch.reqs))) and not self.is_verify


@dataclasses.dataclass
class StepCounts:
    """What one step (or one event outside a step: an abort, a grammar error) adds to `EngineStats`."""

    generation_tokens: int = 0
    cached_tokens: int = 0
    num_finished_requests: int = 0
    num_aborted_requests: int = 0
    num_spec_verifications: int = 0  # sequences verified with drafts, one per sequence per forward
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0


class OutputProcessor:
    """Appends each step's tokens to its requests and finishes them; owns the unfinished requests.

    Args:
        scheduler: advanced by each batch's KV (`advance`), told of each finish.
        cache: rolls back the pages of rejected drafts.
        speculator: told of verified drafts and of finished requests (None without speculation).
        disable_jump_forward: sample every token of a constrained output (`--disable-jump-forward`).
    """

    def __init__(self, scheduler: Scheduler, cache: CacheManager, speculator: NgramSpeculator | None,
                 disable_jump_forward: bool):
        self.scheduler = scheduler
        self.cache = cache
        self.speculator = speculator
        self.disable_jump_forward = disable_jump_forward
        self.reqs: dict[str, Req] = {}  # unfinished requests by rid
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def track(self, req: Req, detokenizer: IncrementalDetokenizer) -> None:
        """Follow `req` from now until its finished output is built."""
        self.reqs[req.rid] = req
        self.detokenizers[req.rid] = detokenizer

    def advance(self, launched: LaunchedBatch) -> LaunchedBatch | None:
        """Account the KV `launched` wrote in the scheduler (`Scheduler.advance`), before its tokens are
        read. Requests that finished while it ran (aborted, or ended by the token before it under the
        overlap schedule) are dropped with their rows; None when none is left."""
        keep = [i for i, r in enumerate(launched.reqs) if not r.is_finished]
        if not keep:
            return None
        if len(keep) < len(launched.reqs):
            launched = dataclasses.replace(
                launched,
                batch=launched.batch.subset(keep),
                drafts=[launched.drafts[i] for i in keep],
                rows=[launched.rows[i] for i in keep],
            )
        launched.produced = self.scheduler.advance(launched.batch)
        return launched

    def process(self, launched: LaunchedBatch, sampled: SampleOutput) -> tuple[list[StepOutput], StepCounts]:
        """Append each request's accepted tokens (host `sampled`, read from `launched.sampled`) and
        build every request's progress. Call after `advance`."""
        counts, outputs, now = StepCounts(), [], time.perf_counter()
        for req, draft, row, produced in zip(launched.reqs, launched.drafts, launched.rows, launched.produced):
            if not produced or req.is_finished:
                continue
            if req.sampling_params.max_new_tokens == 0:  # its prompt logprobs are complete
                self.finish(req, finish_length(0), counts)
                outputs.append(self.output(req, [], ""))
                continue
            target = [int(t) for t in sampled.next_tokens[row : row + len(draft) + 1]]
            accepted = num_accepted(draft, target) if draft else 0
            if launched.is_verify:
                counts.num_spec_verifications += 1
                counts.num_spec_draft_tokens += len(draft)
                counts.num_spec_accepted_tokens += accepted
                self.speculator.record(req, len(draft), accepted)
            new_ids, delta = [], ""
            for i, token in enumerate(target[: accepted + 1]):
                req.kv_len += i > 0  # every token before this one is in the pool (verified drafts)
                ids, text = self._append_sampled(req, token, sampled, row + i, now, counts)
                new_ids, delta = new_ids + ids, delta + text
                if req.is_finished:
                    break
            if not req.is_finished:
                if launched.is_verify:
                    self.cache.truncate(req)  # pages that held only rejected drafts
                more_ids, more_text = self._jump_forward(req, counts)
                new_ids, delta = new_ids + more_ids, delta + more_text
            outputs.append(self.output(req, new_ids, delta))
        return outputs, counts

    def finish(self, req: Req, reason: dict, counts: StepCounts) -> None:
        """End `req` with `reason` (SGLang's finish reasons, `request.finish_*`): the scheduler frees or
        caches its pages."""
        req.finish_reason = reason
        req.finished_time = time.perf_counter()
        self.scheduler.finish(req)
        counts.num_finished_requests += 1
        if self.speculator is not None:
            self.speculator.observe_finished(req)

    def output(self, req: Req, new_ids: list[int], delta: str) -> StepOutput:
        """`req`'s progress: `new_ids` and the text `delta` they added; a finished request is forgotten."""
        detok = self.detokenizers[req.rid]
        finished = req.is_finished
        if finished:
            del self.reqs[req.rid], self.detokenizers[req.rid]
        return StepOutput(req.rid, new_ids, list(req.output_ids), detok.text, delta, finished, request_meta(req))

    def _append_sampled(self, req: Req, token: int, sampled: SampleOutput, row: int, now: float,
                        counts: StepCounts) -> tuple[list[int], str]:
        """Append a sampled token (row `row` of `sampled`) with its logprobs; returns (ids, text delta)."""
        if req.first_token_time is None:
            req.first_token_time = now
            counts.cached_tokens += req.cached_tokens
        req.last_token_time = now
        if req.return_logprob:
            req.output_token_logprobs.append(float(sampled.logprobs[row]))
            k = req.top_logprobs_num
            req.output_top_logprobs.append(
                [(float(sampled.top_logprobs[row, j]), int(sampled.top_ids[row, j])) for j in range(k)]
            )
            if req.token_ids_logprob:
                req.output_token_ids_logprobs.append(
                    [float(x) for x in sampled.token_ids_logprobs[row, : len(req.token_ids_logprob)]]
                )
        return self._append_tokens(req, [token], counts)

    def _jump_forward(self, req: Req, counts: StepCounts) -> tuple[list[int], str]:
        # Forced tokens are never sampled, so they have no logprobs: requests that return logprobs
        # sample every token to keep output_token_logprobs aligned with output_ids.
        if req.grammar is None or self.disable_jump_forward or req.return_logprob:
            return [], ""
        forced = req.grammar.jump_forward_tokens()[: req.remaining_new_tokens()]
        if not forced:
            return [], ""
        req.num_forced_tokens += len(forced)
        return self._append_tokens(req, forced, counts)

    def _append_tokens(self, req: Req, tokens: Sequence[int], counts: StepCounts) -> tuple[list[int], str]:
        """Append sampled or grammar-forced tokens: detokenize, advance the grammar, detect the finish."""
        detok = self.detokenizers[req.rid]
        appended, delta = [], ""
        for token in tokens:
            req.output_ids.append(token)
            appended.append(token)
            counts.generation_tokens += 1
            res = detok.append(token)
            delta += res.text_delta
            if res.finished:
                self.finish(req, res.finish_reason, counts)
                break
            if req.grammar is not None:
                reason = None
                if not req.grammar.accept_token(token):
                    reason = finish_abort(f"grammar rejected token {token}")
                elif req.grammar.is_terminated():  # SGLang reports the last token as matched
                    reason = finish_stop(token)
                if reason is not None:
                    # text held back as a possible stop string's start is the request's text now
                    delta += detok.finish(reason).text_delta
                    self.finish(req, reason, counts)
                    break
        return appended, delta
