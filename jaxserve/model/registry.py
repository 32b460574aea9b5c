"""Architecture registry: HF `architectures` name -> the Module that implements it.

The names are `jaxserve.model.architecture.ARCHITECTURES` (a jax-free table the launch path checks
before anything loads); this maps each to its outer Module (`llama.Llama` or `gemma.Gemma`, whose
`layer_cls` is the decoder layer). Every family runs through the same functional boundary
(`llama.forward`, `llama.embed_tokens`, `llama.decoder_layers`, ...), which builds the Modules named here.
"""

from __future__ import annotations

from typing import Callable

from jaxserve.model import gemma, llama
from jaxserve.model.architecture import unsupported_message

ARCHITECTURES: dict[str, type[llama.Llama]] = {
    "Gemma2ForCausalLM": gemma.Gemma,
    "Gemma3ForCausalLM": gemma.Gemma,
    "LlamaForCausalLM": llama.Llama,
    "MistralForCausalLM": llama.Llama,
    "Qwen2ForCausalLM": llama.Llama,
    "Qwen3ForCausalLM": llama.Llama,
}


def get_model_class(architecture: str) -> type[llama.Llama]:
    """The outer Module class of an architecture.

    Raises:
        ValueError: the architecture is not supported (the message lists the supported ones).
    """
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(unsupported_message(architecture)) from None


def get_forward(architecture: str) -> Callable:
    """The forward function of an architecture: `llama.forward`, the functional boundary every
    registered family runs through (it builds `get_model_class(architecture)`'s Modules).

    Raises:
        ValueError: the architecture is not supported (the message lists the supported ones).
    """
    get_model_class(architecture)
    return llama.forward
