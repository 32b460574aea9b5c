"""Requests on the host: `Req` (one sequence's state), `FinishReason`, `CachedTokensDetails`; the sampling
params are `core/sampling_params.py`."""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import Any, Literal

import numpy as np

from jaxserve.core.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class CachedTokensDetails:
    """Cached prompt tokens of one prefix match by the tier they came from (SGLang's
    `cached_tokens_details`; they sum to the match's tokens): already in the device pool (a partly
    matched page copied on write included), recalled from the host tier, read from the storage tier
    (None without a storage tier)."""

    device: int = 0
    host: int = 0
    storage: int | None = None


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)  # identity: `req in running` must not compare every field (nor equate two requests)
class Req:
    """One sequence being served (host side).

    KV bookkeeping: `page_table` covers positions [0, kv_len); `kv_len` tokens of `fill_ids` have their
    K/V in the pool. `cached_tokens` is how many prompt tokens were reused from the prefix cache, and
    `cached_tokens_details` by tier (both of the first admission); `match_tiers` is the tier split of
    the current match (reset on release).
    """

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    token_ids_logprob: tuple[int, ...] = ()
    namespace: Any = None
    arrival_time: float = 0.0
    think_end_ids: tuple[int, ...] = ()  # non-empty: the grammar applies after these tokens (constrained/reasoner.py)

    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    page_table: list[int] = dataclasses.field(default_factory=list)
    kv_len: int = 0
    cached_tokens: int = 0
    cached_tokens_details: CachedTokensDetails | None = None
    match_tiers: CachedTokensDetails = CachedTokensDetails()
    last_node: Any = None
    num_retractions: int = 0
    seed: int = 0
    grammar: Any = None
    num_forced_tokens: int = 0
    draft_state: Any = None  # speculative decoding's acceptance history (speculative.policy.DraftState)
    lora_id: str | None = None  # the LoRA adapter it runs under (scheduler/lora_slots.py); None: the base model
    lora_slot: int = 0  # its adapter's device slot while admitted (0: the base model, or not admitted)

    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    output_token_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    output_token_ids_logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    input_token_logprobs: list[float | None] | None = None
    # per prompt position (None where not computed): its top-k (logprob, token_id) pairs, the
    # logprobs of token_ids_logprob (prompt_logprobs.py)
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_token_ids_logprobs: list[list[float] | None] | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Prompt + generated tokens: what must be in the KV cache before the next decode."""
        return self.input_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without concatenating prompt and output (start, end >= 0)."""
        n = len(self.input_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.input_ids[start:end] + (self.output_ids[: end - n] if end > n else [])

    @property
    def fill_len(self) -> int:
        """len(fill_ids) without building the list (the scheduler asks for it every step)."""
        return len(self.input_ids) + len(self.output_ids)

    @property
    def wants_input_logprobs(self) -> bool:
        """Prompt logprobs were asked for (`return_logprob` with `logprob_start_len >= 0`)."""
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def is_finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling_params.max_new_tokens - len(self.output_ids))


_rid_counter = itertools.count()


def new_rid() -> str:
    return f"{next(_rid_counter):x}-{np.random.randint(1 << 30):08x}"


@dataclasses.dataclass(frozen=True)
class FinishReason:
    """Why a request finished (SGLang's FINISH_MATCHED_TOKEN / _STR, FINISH_LENGTH, FINISH_ABORT).

    `kind`: "stop" (EOS, a stop token id, a stop string or regex), "length" (max_new_tokens or the
    room the context and the pool leave) or "abort". `matched`: with "stop", the token id or the
    string that matched (None: the grammar ended). `length`: with "length", the output tokens.
    `message`: with "abort", why. `status_code`: with an abort the engine (not the client) caused,
    the HTTP status of a non-streamed answer (500: an engine error, 503: shut down or queue timeout).
    The server writes it in SGLang's or OpenAI's words; the engine never builds their dicts.
    """

    kind: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None


def finish_stop(matched: int | str | None) -> FinishReason:
    """EOS, a stop token id or a stop string (`matched`; None when a grammar ended the output)."""
    return FinishReason("stop", matched=matched)


def finish_length(length: int) -> FinishReason:
    """The output reached `length` tokens, its bound."""
    return FinishReason("length", length=length)


def finish_abort(message: str, status_code: int | None = None) -> FinishReason:
    """Aborted, with why; `status_code` when the engine failed the request (see `FinishReason`)."""
    return FinishReason("abort", message=message, status_code=status_code)
