"""Architecture registry: HF `architectures` name -> the forward function that implements it."""

from __future__ import annotations

from typing import Callable

from jaxserve.model import llama

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
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
