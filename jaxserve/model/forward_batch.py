"""ForwardBatch: the device-side description of one step (a pytree of int32 arrays).

One step runs a ragged batch: every sequence contributes its new tokens (an extend chunk, or one token
for a decode), packed along the token axis T. Shapes are padded to a bucket (T tokens, S sequences, P
pages per sequence) by the model runner; the structure never changes, so a compiled step is reused by
every batch of its bucket.
"""

from __future__ import annotations

import dataclasses

import jax
from jaxtyping import Array, Int32

from jaxserve.pallas.metadata import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    """Inputs of one jitted forward.

    Fields:
        input_ids: [T] token ids; padding tokens 0.
        positions: [T] position of each token in its sequence (drives RoPE).
        slot_mapping: [T] pool slot `page * page_size + slot` where each token's K/V is written;
            padding tokens write to the dummy page 0.
        attn: the attention layout of the batch (query blocks, page tables, kv lengths).
        logits_idx: [S] token row whose logits are sampled for each sequence (its last new token);
            padding sequences 0.
        target_ids: [T] the token that follows each token in its sequence (-1 where unknown); read
            only by steps that return prompt logprobs.
        lora_ids: [T] the LoRA slot each token runs under (0: the base model; padding 0), or None when
            the model has no LoRA slots (`jaxserve.model.lora`).
    """

    input_ids: Int32[Array, " T"]
    positions: Int32[Array, " T"]
    slot_mapping: Int32[Array, " T"]
    attn: AttentionMetadata
    logits_idx: Int32[Array, " S"]
    target_ids: Int32[Array, " T"]
    lora_ids: Int32[Array, " T"] | None = None
