"""Requests: `SamplingParams` (SGLang's fields and defaults), `Req` (one sequence's state) and `FinishReason`."""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import Any, Literal

import numpy as np

from jaxserve.constrained import GrammarSpec
from jaxserve.engine.validation.errors import SamplingParamsError
from jaxserve.engine.validation.field_types import first_type_error
from jaxserve.engine.validation.sampling_params import check_logit_bias_keys, logit_bias_pairs, validate_sampling_params
from jaxserve.engine.validation.seed import check_seed


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Names and defaults follow SGLang's `SamplingParams`.

    `None` passed to `from_dict` means "the default". temperature 0 is greedy; top_k -1 and top_p 1
    disable those filters. Lengths are in tokens. `stop_regex`: patterns (Python `regex` syntax) that
    stop the request like stop strings. `stream_interval`: a stream sends an event every N tokens
    (None: every step). `sampling_seed` (SGLang's name) is accepted by `from_dict` as `seed`.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    choices: tuple[str, ...] | None = None
    stop_regex: tuple[str, ...] = ()
    spaces_between_special_tokens: bool = True
    stream_interval: int | None = None
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias); from_dict takes
    # OpenAI's {"token id": bias} object. Token ids are checked against the vocabulary by the engine.
    logit_bias: tuple[tuple[int, float], ...] | None = None

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> "SamplingParams":
        """Build and validate from a JSON-like dict (unknown keys raise).

        Raises:
            SamplingParamsError: a value is out of range or of the wrong type (names the field).
        """
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        if (problem := first_type_error(d)) is not None:  # the JSON types, as the HTTP routes word them
            raise SamplingParamsError(*problem, code="invalid_type")
        check_seed(d.get("sampling_seed"), "sampling_seed")  # named as given: validate sees it as seed
        check_seed(d.get("seed"))
        check_logit_bias_keys(d.get("logit_bias"))
        alias = d.pop("sampling_seed", None)
        unknown = sorted(set(d) - names)
        if unknown:
            raise SamplingParamsError(unknown[0], "unknown sampling parameter", code="unknown_parameter")
        if alias is not None:
            if d.get("seed") is not None and d["seed"] != alias:
                raise SamplingParamsError("sampling_seed", f"is another name of seed; both given and different ({alias} != {d['seed']})")
            d["seed"] = alias
        kwargs = {k: v for k, v in d.items() if v is not None}
        for key in ("stop", "stop_regex"):
            if isinstance(kwargs.get(key), str):
                kwargs[key] = (kwargs[key],)
        for key in ("stop", "stop_token_ids", "choices", "stop_regex"):
            if key in kwargs:
                if not isinstance(kwargs[key], (list, tuple)):
                    raise SamplingParamsError(key, "must be a list", code="invalid_type")
                kwargs[key] = tuple(kwargs[key])
        if "logit_bias" in kwargs:
            kwargs["logit_bias"] = logit_bias_pairs(kwargs["logit_bias"])
        params = SamplingParams(**kwargs)
        params.validate()
        return params

    def validate(self) -> None:
        """Raise `SamplingParamsError` naming the first invalid field (`validation/sampling_params.py`)."""
        validate_sampling_params(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def grammar_spec(params: SamplingParams) -> GrammarSpec | None:
    """The constraint of a request as a GrammarSpec, or None when it is unconstrained."""
    if params.regex is not None:
        return GrammarSpec.regex(params.regex)
    if params.json_schema is not None:
        return GrammarSpec.json_schema(params.json_schema)
    if params.ebnf is not None:
        return GrammarSpec.ebnf(params.ebnf)
    if params.choices is not None:
        return GrammarSpec.from_choices(list(params.choices))
    return None


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
