"""GenerateInput: one prompt of a generation request, as it goes from the HTTP handler (or research code)
through `EngineLoop.submit` to `Engine.add_request` (SGLang's `GenerateReqInput`, one prompt of it).

Handlers build it once; every hop passes it on unchanged. Its values are checked once, by
`engine/validation/validator.py`, which turns it into a `CheckedInput` (token ids, built SamplingParams).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Mapping, Sequence

from jaxserve.engine.request import SamplingParams


@dataclasses.dataclass(frozen=True)
class GenerateInput:
    """One prompt and how to serve it.

    `prompt`: a text or token ids. `sampling_params`: a `SamplingParams`, or SGLang's JSON-like dict of
    them (None: the defaults; a dict without `max_new_tokens` has it cut to what the context leaves on
    the server's path). `rid`: the request id (None: a fresh one); with `n` > 1 the sequences are
    `<rid>-<i>`. `return_logprob`, `top_logprobs_num` (0..20), `logprob_start_len` (-1: no prompt
    positions) and `token_ids_logprob` are SGLang's logprob fields. `namespace`: the prefix cache shares
    KV only between requests of one namespace (SGLang's `cache_salt`). `think_end_ids` (with a grammar):
    the reply reasons first and the grammar applies only after these tokens (constrained/reasoner.py).
    `lora_path`: the name of a loaded LoRA adapter to run under (SGLang's field; None: the base model).
    """

    prompt: str | Sequence[int]
    sampling_params: SamplingParams | Mapping[str, Any] | None = None
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    token_ids_logprob: Sequence[int] = ()
    namespace: Hashable = None
    think_end_ids: tuple[int, ...] = ()
    lora_path: str | None = None

    @staticmethod
    def of(prompt: "GenerateInput | str | Sequence[int]", sampling_params: SamplingParams | Mapping[str, Any] | None = None,
           **fields: Any) -> "GenerateInput":
        """`prompt` itself when it is a GenerateInput already (then nothing else may be given), else one
        built from the prompt, its sampling params and the other fields by name (research code's
        `engine.add_request([1, 2, 3], {"max_new_tokens": 4}, rid="a")`)."""
        if isinstance(prompt, GenerateInput):
            if sampling_params is not None or fields:
                raise TypeError("give a GenerateInput alone, or a prompt with its fields")
            return prompt
        return GenerateInput(prompt, sampling_params, **fields)
