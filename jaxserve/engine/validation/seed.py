"""The range of a sampling seed (`seed`, and SGLang's `sampling_seed`), checked by `SamplingParams`.

OpenAI's published API schema and vLLM's request models bound `seed` to a signed 64-bit integer;
SGLang does not bound it. jaxserve accepts that range, on every route and in-process, so no client
that follows OpenAI's schema is refused. The sampler keys its random stream with a uint32
(`runner/sampler.py`: `fold_in(fold_in(key(0), seed mod 2**32), step)`), so a seed is honoured mod
2**32: -1 draws as 4294967295, and two seeds that differ by a multiple of 2**32 draw the same
tokens. Sequence i of `n` uses seed + i (mod 2**32 as well). -1 is an ordinary seed, not "random"
(llama.cpp's meaning): leave the field out for a random one.
"""

from __future__ import annotations

from typing import Any

from jaxserve.engine.validation.errors import SamplingParamsError

SEED_MIN = -(2**63)  # OpenAI's schema and vLLM: a signed 64-bit integer
SEED_MAX = 2**63 - 1
SAMPLER_SEED_MODULUS = 2**32  # runner/sampler.py reduces each seed to a uint32


def check_seed(value: Any, field: str = "seed") -> None:
    """Refuse an integer seed outside [SEED_MIN, SEED_MAX]; None and non-integers pass (the type
    check names a wrong type).

    Raises:
        SamplingParamsError: naming `field` (`seed` or `sampling_seed`), code invalid_value.
    """
    if isinstance(value, int) and not isinstance(value, bool) and not SEED_MIN <= value <= SEED_MAX:
        raise SamplingParamsError(field, f"must be a 64-bit signed integer, in [-2**63, 2**63 - 1], got {value}")
