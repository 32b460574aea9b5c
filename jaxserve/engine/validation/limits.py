"""How large one request may be in the KV pool: SGLang's `max_req_len` rule.

SGLang 0.5.23 (`managers/tp_worker.py`) sets `max_req_len = min(context_len - 1, kv_capacity - 1)` and
`max_req_input_len = max_req_len - 5`; its scheduler refuses a prompt of `max_req_input_len` tokens or
more and cuts `max_new_tokens` to `max_req_len - prompt_len - 1`. A request within these bounds fits
the pool on its own, so the scheduler can always retract the others to run it: without them, a request
that fit the context but not the pool decoded until the pool was full and the scheduler raised "KV pool
cannot hold a single decoding request", ending the engine. The context half of the rule is the
engine's own (`Engine.validate_input_ids`, the server's max_new_tokens check); this module holds the
pool half.
"""

from __future__ import annotations

import dataclasses

from jaxserve.engine.outputs import ContextLengthError
from jaxserve.engine.request import SamplingParams

INPUT_MARGIN = 5  # SGLang's max_req_input_len = max_req_len - 5


@dataclasses.dataclass(frozen=True)
class PoolLimits:
    """The bounds of one request in a pool of `pool_tokens` tokens (see the module docstring)."""

    pool_tokens: int

    @property
    def max_req_len(self) -> int:
        """The most tokens (prompt + output) one request may hold: the pool's tokens - 1."""
        return self.pool_tokens - 1

    @property
    def max_req_input_len(self) -> int:
        """A prompt must have fewer tokens than this."""
        return self.max_req_len - INPUT_MARGIN

    def check_prompt(self, prompt_len: int) -> None:
        """Raise ContextLengthError("prompt") for a prompt of `prompt_len` tokens that the pool cannot hold."""
        if prompt_len >= self.max_req_input_len:
            raise ContextLengthError(
                "prompt",
                f"the prompt has {prompt_len} tokens, the KV pool holds {self.pool_tokens}: a prompt must have "
                f"fewer than {self.max_req_input_len} (raise --max-total-tokens)",
            )

    def fit(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """`params` with max_new_tokens cut to `max_req_len - prompt_len - 1` (the request then ends with
        finish reason length there), min_new_tokens with it. After `check_prompt`, at least 4 remain."""
        room = max(0, self.max_req_len - prompt_len - 1)
        if params.max_new_tokens <= room:
            return params
        return dataclasses.replace(params, max_new_tokens=room, min_new_tokens=min(params.min_new_tokens, room))
