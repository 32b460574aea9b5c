"""Architecture registry: HF `architectures` name -> the forward function that implements it.

The names are `jaxserve.model.architecture.ARCHITECTURES` (a jax-free table the launch path checks
before anything loads); this maps each to its code.
"""

from __future__ import annotations

from typing import Callable

from jaxserve.model import llama
from jaxserve.model.architecture import unsupported_message

ARCHITECTURES: dict[str, Callable] = {
    "LlamaForCausalLM": llama.forward,
    "MistralForCausalLM": llama.forward,
    "Qwen2ForCausalLM": llama.forward,
    "Qwen3ForCausalLM": llama.forward,
}


def get_forward(architecture: str) -> Callable:
    """The forward function of an architecture.

    Raises:
        ValueError: the architecture is not supported (the message lists the supported ones).
    """
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(unsupported_message(architecture)) from None
