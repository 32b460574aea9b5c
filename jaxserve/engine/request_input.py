"""GenerateInput: one prompt of a generation request, as it goes from the HTTP handler (or research code)
through `EngineLoop.submit` to `Engine.add_request` (SGLang's `GenerateReqInput`, one prompt of it).

Handlers build it once, from their parsed request; every hop passes it on unchanged. It is checked once, by
`RequestChecker.check` (engine/validation/check.py), which turns it into a `CheckedInput`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Mapping, Sequence

from jaxserve.core.sampling_params import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default, the /generate route's and research code's


@dataclasses.dataclass(frozen=True)
class GenerateInput:
    """One prompt and how to serve it.

    `prompt`: a text or token ids; `add_special_tokens`: tokenize a text with the tokenizer's own special
    tokens (False for a chat template's output, which holds them). `sampling_params`: a `SamplingParams`;
    SGLang's JSON-like dict of them (or None: the defaults) is built here with `SamplingParams.from_dict`,
    the one check of its JSON types. `default_max_new_tokens`: the route's `max_new_tokens` when the request
    gives none (SGLang's 128; OpenAI's 16 on /v1/completions; None: all the context leaves, as SGLang's
    chat). `rid`: the request id (None or "": a fresh one); with `n` > 1 the sequences are `<rid>-<i>`.
    `return_logprob`, `top_logprobs_num` (0..20), `logprob_start_len` (-1: no prompt positions) and
    `token_ids_logprob` are SGLang's logprob fields. `namespace`: the prefix cache shares KV only between
    requests of one namespace (SGLang's `cache_salt`). `think_end_ids` (with a grammar): the reply reasons
    first and the grammar applies only after these tokens (constrained/reasoner.py). `lora_path`: the name
    of a loaded LoRA adapter to run under (SGLang's field; None: the base model).

    Raises:
        SamplingParamsError: a dict `sampling_params` with an unknown field or a value of the wrong type.
    """

    prompt: str | Sequence[int]
    sampling_params: SamplingParams = SamplingParams()
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    token_ids_logprob: Sequence[int] = ()
    namespace: Hashable = None
    think_end_ids: tuple[int, ...] = ()
    lora_path: str | None = None
    add_special_tokens: bool = True
    default_max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.sampling_params, SamplingParams):
            object.__setattr__(self, "sampling_params", SamplingParams.from_dict(self.sampling_params))

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
