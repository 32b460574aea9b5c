"""ForwardBatch: the device-side description of one step (a pytree of int32 arrays).

One step runs a ragged batch: every sequence contributes its new tokens (an extend chunk, or one token
for a decode), packed along the token axis T. Shapes are padded to a bucket (T tokens, S sequences, P
pages per sequence) by the model runner; the structure never changes, so a compiled step is reused by
every batch of its bucket.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int32

from jaxserve.pallas.metadata import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowTables:
    """The window layers' view of a step over the hybrid pool (`jaxserve.cache.window_pool`).

    Fields (L layers):
        page_base: [L] flat page where each layer's page space starts in the pool `[1, F, KVH, ps, D]`.
        uses_window: [L] 1 for a window layer, 0 for a full-attention layer.
        page_table: [S, P] the window page of each entry of `attn.page_table` (0: none, out of window).
        slot_mapping: [T] the window slot `window_page * page_size + slot` of each token.
    """

    page_base: Int32[Array, " L"]
    uses_window: Int32[Array, " L"]
    page_table: Int32[Array, "S P"]
    slot_mapping: Int32[Array, " T"]


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
        window: the window layers' page tables over the hybrid pool (`[1, F, KVH, ps, D]`), or None
            when every layer keeps all its pages (the pool is `[L, N, KVH, ps, D]`, layer l at row l).
    """

    input_ids: Int32[Array, " T"]
    positions: Int32[Array, " T"]
    slot_mapping: Int32[Array, " T"]
    attn: AttentionMetadata
    logits_idx: Int32[Array, " S"]
    target_ids: Int32[Array, " T"]
    lora_ids: Int32[Array, " T"] | None = None
    window: WindowTables | None = None

    def layer_kv(self, layer: Int32[Array, ""], page_size: int):
        """Where layer `layer` reads and writes its K/V: (pool row, slot_mapping [T], attention metadata).

        Without `window`: row `layer` of the pool, this batch's slots and page tables. With it, the pool
        is one row of flat pages and the layer's page ids are offset to its page space: the window page
        table for a window layer, the full one otherwise."""
        if self.window is None:
            return layer, self.slot_mapping, self.attn
        w = self.window
        windowed, base = w.uses_window[layer] > 0, w.page_base[layer]
        pages = jnp.where(windowed, w.page_table, self.attn.page_table) + base
        slots = jnp.where(windowed, w.slot_mapping, self.slot_mapping) + base * page_size
        return jnp.int32(0), slots, dataclasses.replace(self.attn, page_table=pages)

