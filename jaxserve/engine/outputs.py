"""What the engine hands back: a step's output per request, SGLang's meta_info, counters and gauges."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from jaxserve.core.request import CachedTokensDetails, FinishReason, Req

# SGLang reports its storage backend's class name; jaxserve's file backend is SGLang's `HiCacheFile`
STORAGE_BACKEND_NAME = "HiCacheFile"


@dataclasses.dataclass
class RequestMeta:
    """SGLang's `meta_info` of one sequence. Times in seconds; logprobs as (logprob, token_id) pairs."""

    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason | None
    e2e_latency: float
    cached_tokens_details: CachedTokensDetails | None = None  # None when nothing was cached
    num_forced_tokens: int = 0
    ttft: float | None = None
    output_token_logprobs: list | None = None
    output_top_logprobs: list | None = None
    input_token_logprobs: list | None = None
    output_token_ids_logprobs: list | None = None  # per output token: (logprob, token_id) of each token_ids_logprob id
    # per prompt position from logprob_start_len on (None where input_token_logprobs has None): its top
    # top_logprobs_num (logprob, token_id) pairs / the (logprob, token_id) of each token_ids_logprob id
    input_top_logprobs: list | None = None
    input_token_ids_logprobs: list | None = None


@dataclasses.dataclass
class StepOutput:
    """What one request produced in one step: new tokens, the text they added, and its meta info."""

    rid: str
    new_token_ids: list[int]
    output_ids: list[int]
    text: str
    text_delta: str
    finished: bool
    meta: RequestMeta


@dataclasses.dataclass
class EngineStats:
    """Cumulative counters over the engine's lifetime (tokens, requests, steps)."""

    num_requests: int = 0
    num_finished_requests: int = 0
    num_aborted_requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    num_steps: int = 0
    num_decode_steps: int = 0
    num_spec_verifications: int = 0  # sequences verified with drafts, one per sequence per forward
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_overlapped_steps: int = 0  # decode steps launched before the previous step's tokens were read
    release_mode: str = "off"  # gauge: the KV release policy's adaptive mode (jaxserve/cache/adaptive.py)

    def add(self, counts) -> None:
        """Add what a step counted (`output_processor.StepCounts`, whose fields are counters of ours)."""
        for field in dataclasses.fields(counts):
            setattr(self, field.name, getattr(self, field.name) + getattr(counts, field.name))


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """Counters plus current gauges, read at one moment (for /metrics, /get_server_info and logs).

    kv_used_tokens: tokens of the KV pool in use, the evictable prefix cache left out. With the hybrid
    sliding-window pool (D-46) `kv_swa_used_tokens` / `kv_swa_total_tokens` are the window layers' pool
    (tokens that running requests' windows read, and its capacity); both None without it.
    cache_hit_rate: cached / prompt tokens over the lifetime. gen_throughput: generated tokens per
    second over the last log interval.
    """

    counters: EngineStats
    num_retracted_requests: int
    num_jit_compiles: int
    num_running_reqs: int
    num_queue_reqs: int
    num_grammar_queue_reqs: int
    kv_used_tokens: int
    kv_evictable_tokens: int
    kv_total_tokens: int
    cache_hit_rate: float
    gen_throughput: float
    spec_accept_length: float = 0.0  # mean tokens per verifying sequence-forward (SGLang's name); 0: none yet
    spec_accept_rate: float = 0.0  # accepted / proposed draft tokens
    kv_swa_used_tokens: int | None = None
    kv_swa_total_tokens: int | None = None

    @property
    def full_token_usage(self) -> float:
        """Share of the full-attention pool in use (0..1): every layer's, without the hybrid pool."""
        return self.kv_used_tokens / self.kv_total_tokens

    @property
    def swa_token_usage(self) -> float | None:
        """Share of the window layers' pool in use (0..1); None without the hybrid pool."""
        if self.kv_swa_used_tokens is None or self.kv_swa_total_tokens is None:
            return None
        return self.kv_swa_used_tokens / self.kv_swa_total_tokens

    @property
    def token_usage(self) -> float:
        """Share of the KV pool in use (0..1); with the hybrid pool the fuller of its two pools, as
        SGLang's `token_usage` (its `PoolStats.get_kv_token_stats`)."""
        return max(self.full_token_usage, self.swa_token_usage or 0.0)


def sglang_finish_reason(reason: FinishReason | None) -> dict[str, Any] | None:
    """`reason` in SGLang's wire shape (its `BaseFinishReason.to_json`): {"type": "stop", "matched": ...},
    {"type": "length", "length": n}, {"type": "abort", "message": ...} (with "status_code" when set)."""
    if reason is None:
        return None
    if reason.kind == "stop":
        return {"type": "stop", "matched": reason.matched}
    if reason.kind == "length":
        return {"type": "length", "length": reason.length}
    wire: dict[str, Any] = {"type": "abort", "message": reason.message}
    if reason.status_code is not None:
        wire["status_code"] = reason.status_code
    return wire


def sglang_cached_tokens_details(details: CachedTokensDetails | None) -> dict[str, Any] | None:
    """`details` in SGLang's meta_info shape (its `SchedulerOutputStreamer.get_cached_tokens_details`):
    {"device": n, "host": n}, plus "storage" and "storage_backend" with a storage tier; None stays None."""
    if details is None:
        return None
    wire: dict[str, Any] = {"device": details.device, "host": details.host}
    if details.storage is not None:
        wire["storage"] = details.storage
        wire["storage_backend"] = STORAGE_BACKEND_NAME
    return wire


@dataclasses.dataclass(frozen=True)
class LogprobKeys:
    """Which logprob keys a sequence's meta_info has (SGLang 0.5.23's rule,
    `TokenizerManager.add_logprob_to_meta_info`): with logprobs asked for, `input_token_logprobs`,
    `output_token_logprobs` and `output_token_logprobs_length`; `top` (top_logprobs_num > 0) adds
    `input_top_logprobs` and `output_top_logprobs`; `token_ids` (a non-empty token_ids_logprob) adds
    `input_token_ids_logprobs` and `output_token_ids_logprobs`."""

    top: bool
    token_ids: bool

    @staticmethod
    def of(return_logprob: bool, top_logprobs_num: int, token_ids_logprob=()) -> "LogprobKeys | None":
        """The keys of a request's logprob fields; None when it asks for no logprobs."""
        if not (return_logprob or top_logprobs_num > 0):
            return None
        return LogprobKeys(top_logprobs_num > 0, bool(token_ids_logprob))


def meta_info(meta: RequestMeta, logprobs: LogprobKeys | None, token_text: Callable[[int], str] | None = None) -> dict[str, Any]:
    """SGLang's `meta_info` of one sequence, as /generate and `Engine.generate` answer it: lengths in tokens,
    latency in seconds, its finish reason and cached-token details in SGLang's shapes, and the logprob keys
    of `logprobs` (None: none) as `[logprob, token_id, token text or null]` triples, the text from
    `token_text` (None: null; SGLang's `return_text_in_logprobs`). The `input_*` lists are empty without
    prompt positions (`logprob_start_len` -1 or the prompt's length); keys that do not apply are left out,
    but `finish_reason` and `cached_tokens_details`, which SGLang always sends (null or not)."""

    def triple(logprob: float, token_id: int) -> list[Any]:
        return [logprob, token_id, None if token_text is None else token_text(token_id)]

    def per_position(rows: list | None) -> list:  # null where no logprob (position 0), else triples
        return [None if row is None else [triple(lp, t) for lp, t in row] for row in rows or []]

    info: dict[str, Any] = {
        "id": meta.id,
        "prompt_tokens": meta.prompt_tokens,
        "completion_tokens": meta.completion_tokens,
        "cached_tokens": meta.cached_tokens,
        "finish_reason": sglang_finish_reason(meta.finish_reason),
        "e2e_latency": meta.e2e_latency,
        "cached_tokens_details": sglang_cached_tokens_details(meta.cached_tokens_details),
    }
    if logprobs is None:
        return info
    output = [triple(lp, t) for lp, t in meta.output_token_logprobs or []]
    info["output_token_logprobs"] = output
    if logprobs.top:
        info["output_top_logprobs"] = [[triple(lp, t) for lp, t in top] for top in meta.output_top_logprobs or []]
    info["output_token_logprobs_length"] = len(output)
    info["input_token_logprobs"] = [triple(lp, t) for lp, t in meta.input_token_logprobs or []]
    if logprobs.top:
        info["input_top_logprobs"] = per_position(meta.input_top_logprobs)
    if logprobs.token_ids:
        info["input_token_ids_logprobs"] = per_position(meta.input_token_ids_logprobs)
        info["output_token_ids_logprobs"] = [[triple(lp, t) for lp, t in picked]
                                             for picked in meta.output_token_ids_logprobs or []]
    return info


def request_meta(req: Req) -> RequestMeta:
    """SGLang's meta_info of `req` now (latency up to its finish, or up to now while it runs)."""
    end = req.finished_time or time.perf_counter()
    logprobs = req.return_logprob
    return RequestMeta(
        id=req.rid,
        prompt_tokens=len(req.input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        finish_reason=req.finish_reason,
        e2e_latency=end - req.arrival_time,
        cached_tokens_details=req.cached_tokens_details if req.cached_tokens else None,
        num_forced_tokens=req.num_forced_tokens,
        ttft=(req.first_token_time - req.arrival_time) if req.first_token_time else None,
        output_token_logprobs=[(lp, t) for lp, t in zip(req.output_token_logprobs, req.output_ids)] if logprobs else None,
        output_top_logprobs=list(req.output_top_logprobs) if logprobs else None,
        input_token_logprobs=(
            [(lp, t) for lp, t in zip(req.input_token_logprobs, req.input_ids)][req.logprob_start_len :]
            if req.wants_input_logprobs and req.input_token_logprobs is not None else None
        ),
        output_token_ids_logprobs=(
            [list(zip(lps, req.token_ids_logprob)) for lps in req.output_token_ids_logprobs]
            if logprobs and req.token_ids_logprob else None
        ),
        input_top_logprobs=_prompt_rows(req, req.input_top_logprobs) if req.top_logprobs_num > 0 else None,
        input_token_ids_logprobs=(
            [None if lps is None else list(zip(lps, req.token_ids_logprob))
             for lps in _prompt_rows(req, req.input_token_ids_logprobs)]
            if req.token_ids_logprob and req.wants_input_logprobs and req.input_token_logprobs is not None else None
        ),
    )


def _prompt_rows(req: Req, rows: list | None) -> list | None:
    """A per-prompt-position list from logprob_start_len on (None entries where not computed), or None
    while the prompt's logprobs are not computed (or not asked for)."""
    if not req.wants_input_logprobs or req.input_token_logprobs is None:
        return None
    return list(rows or [None] * len(req.input_ids))[req.logprob_start_len :]
