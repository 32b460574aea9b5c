"""Architecture registry: HF `architectures` name -> the Module that implements it.

The names are `jaxserve.model.architecture.ARCHITECTURES` (a jax-free table the launch path checks
before anything loads); this maps each to its outer Module (`llama.Llama` or `gemma.Gemma`, both `decoder.Decoder`s, whose
`layer_cls` is the decoder layer). Every family runs through the same functional boundary
(`functional.forward`, `functional.embed_tokens`, ...), which builds the Modules named here. Only this
module imports the families.
"""

from __future__ import annotations

from jaxserve.model import gemma, llama
from jaxserve.model.architecture import unsupported_message
from jaxserve.model.decoder import Decoder

ARCHITECTURES: dict[str, type[Decoder]] = {
    "Gemma2ForCausalLM": gemma.Gemma,
    "Gemma3ForCausalLM": gemma.Gemma,
    "LlamaForCausalLM": llama.Llama,
    "MistralForCausalLM": llama.Llama,
    "Qwen2ForCausalLM": llama.Llama,
    "Qwen3ForCausalLM": llama.Llama,
}


def get_model_class(architecture: str) -> type[Decoder]:
    """The outer Module class of an architecture.

    Raises:
        ValueError: the architecture is not supported (the message lists the supported ones).
    """
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(unsupported_message(architecture)) from None
