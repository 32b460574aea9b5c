"""The Llama family: LlamaForCausalLM (Llama 2/3.x, SmolLM2), MistralForCausalLM (its sliding window),
Qwen2ForCausalLM (q/k/v bias) and Qwen3ForCausalLM (q/k norm) are the shared decoder as it is
(decoder.py), its `ModelConfig` flags switching the differences."""

from __future__ import annotations

from jaxserve.model.decoder import Decoder


class Llama(Decoder):
    """The Llama-family decoder: `Decoder` with its own layer (`DecoderLayer`)."""
