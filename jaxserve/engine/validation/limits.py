"""`ModelLimits`: how large a request may be for this model and pool, in one value.

The KV pool's half is SGLang's `max_req_len` rule. SGLang 0.5.23 (`managers/tp_worker.py`) sets
`max_req_len = min(context_len - 1, kv_capacity - 1)` and `max_req_input_len = max_req_len - 5`; its
scheduler refuses a prompt of `max_req_input_len` tokens or more and cuts `max_new_tokens` to
`max_req_len - prompt_len - 1`. A request within these bounds fits the pool on its own, so the scheduler
can always retract the others to run it: without them, a request that fit the context but not the pool
decoded until the pool was full and the scheduler raised "KV pool cannot hold a single decoding request",
ending the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol

from jaxserve.core.errors import ContextLengthError
from jaxserve.core.sampling_params import SamplingParams

INPUT_MARGIN = 5  # SGLang's max_req_input_len = max_req_len - 5


class AdapterTable(Protocol):
    """The loaded LoRA adapters, as the checks read them (`scheduler.lora_slots.LoraSlots`; thread-safe)."""

    def has(self, name: str) -> bool: ...

    def loaded(self) -> Mapping[str, str]: ...


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """The bounds a request is checked against (check.py).

    Attributes:
        vocab_size: token ids are in [0, vocab_size).
        context_length: prompt + at least one new token must fit (tokens).
        pool_tokens: tokens the KV pool holds (its page space, the dummy page left out).
        max_prefill_tokens: with chunked prefill off, a prompt must fit one prefill of this many tokens;
            None: chunked prefill is on.
        adapters: the loaded LoRA adapters (None: LoRA is off).
    """

    vocab_size: int
    context_length: int
    pool_tokens: int
    max_prefill_tokens: int | None = None
    adapters: AdapterTable | None = None

    @property
    def max_req_len(self) -> int:
        """The most tokens (prompt + output) one request may hold in the pool: its tokens - 1."""
        return self.pool_tokens - 1

    @property
    def max_req_input_len(self) -> int:
        """A prompt must have fewer tokens than this for the pool (SGLang's `max_req_input_len`)."""
        return self.max_req_len - INPUT_MARGIN

    @property
    def max_prompt_tokens(self) -> int:
        """A prompt must have fewer tokens than this: the context's bound and the pool's, the smaller."""
        return max(0, min(self.context_length, self.max_req_input_len))

    def check_prompt_fits_pool(self, prompt_len: int) -> None:
        """Raise ContextLengthError("prompt") for a prompt of `prompt_len` tokens that the pool cannot hold."""
        if prompt_len >= self.max_req_input_len:
            raise ContextLengthError(
                "prompt",
                f"the prompt has {prompt_len} tokens, the KV pool holds {self.pool_tokens}: a prompt must have "
                f"fewer than {self.max_req_input_len} (raise --max-total-tokens)",
            )

    def fit_pool(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """`params` with max_new_tokens cut to `max_req_len - prompt_len - 1` (the request then ends with
        finish reason length there), min_new_tokens with it. After `check_prompt_fits_pool`, at least 4 remain."""
        room = max(0, self.max_req_len - prompt_len - 1)
        if params.max_new_tokens <= room:
            return params
        return dataclasses.replace(params, max_new_tokens=room, min_new_tokens=min(params.min_new_tokens, room))
