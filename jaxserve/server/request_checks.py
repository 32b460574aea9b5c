"""Checks the API makes before a request reaches the engine: the sampling seed's range and
`logit_bias` keys that name one token twice, on every route that has them. (`logprob_start_len` is the engine's check, `engine/validation/logprob_start.py`, which
the native API calls before submitting.)

Seeds. OpenAI's published API schema and vLLM's request models bound `seed` to a signed 64-bit
integer; SGLang does not bound it. jaxserve accepts that range, on `/v1/completions`,
`/v1/chat/completions` and `/generate` (`sampling_params.seed` and SGLang's `sampling_seed`), so
no client that follows OpenAI's schema is refused. The sampler keys its random stream with a uint32
(`runner/sampler.py`: `fold_in(fold_in(key(0), seed mod 2**32), step)`), so a seed is honoured mod
2**32: -1 draws as 4294967295, and two seeds that differ by a multiple of 2**32 draw the same
tokens. Sequence i of `n` uses seed + i (mod 2**32 as well). -1 is an ordinary seed, not "random"
(llama.cpp's meaning): leave the field out for a random one.
"""

from __future__ import annotations

import re
from typing import Any

from jaxserve.server.errors import APIError

SEED_MIN = -(2**63)  # OpenAI's schema and vLLM: a signed 64-bit integer
SEED_MAX = 2**63 - 1
SAMPLER_SEED_MODULUS = 2**32  # runner/sampler.py reduces each seed to a uint32


def check_seed(value: Any, field: str = "seed") -> None:
    """Refuse an integer seed outside [SEED_MIN, SEED_MAX]; None and non-integers pass (the engine
    names a wrong type).

    Raises:
        APIError: 400 naming `field` (`seed` or `sampling_seed`), code invalid_value.
    """
    if isinstance(value, int) and not isinstance(value, bool) and not SEED_MIN <= value <= SEED_MAX:
        raise APIError(f"{field}: must be a 64-bit signed integer, in [-2**63, 2**63 - 1], got {value}", 400,
                       param=field, code="invalid_value")


def check_logit_bias_keys(value: Any) -> None:
    """Refuse a `logit_bias` object whose keys spell one token id twice ("028" and "28"): JSON keeps
    both, and one bias would silently replace the other. Other mistakes pass (the engine names them).

    Raises:
        APIError: 400 naming logit_bias, code invalid_value.
    """
    if not isinstance(value, dict):
        return
    seen: dict[int, str] = {}
    for key in value:
        if isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,10}", key):  # the keys the engine reads as ids
            token = int(key)
            if token in seen:
                raise APIError(f"logit_bias: the keys {seen[token]!r} and {key!r} are the same token id {token}; "
                               "give each token once", 400, param="logit_bias", code="invalid_value")
            seen[token] = key
