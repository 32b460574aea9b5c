"""Attention metadata for a ragged batch over the paged KV pool, and its host-side builder.

A step's new tokens are packed into `T` rows (the model's token axis). Attention regroups them into
query blocks of `Bq` rows; every block belongs to exactly one sequence and holds consecutive positions
of it, so a kernel can process a block against that sequence's pages alone (the layout of SGLang's and
vLLM's ragged paged attention). Decode-only batches use `Bq = 1`; batches with extends use a larger
`Bq` so prefill cost is `T x kv` rather than `T x (sum of kv)`.

Everything here is int32 and fixed in shape per bucket, so one compiled step serves every batch that
fits its bucket.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jaxtyping import Array, Int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Device-side description of one ragged batch.

    Fields (NB query blocks of Bq rows, S sequences, P pages per sequence, T packed tokens). The real
    blocks come first (`build_attention_metadata` packs them from block 0): the XLA path visits only
    the blocks before the first with `block_num_q == 0`.
        block_token_idx: [NB, Bq] row of the packed token axis that each query row reads; padding rows 0.
        block_seq_id: [NB] sequence of each block (padding blocks 0).
        block_q_start: [NB] position (in its sequence) of the block's first query row.
        block_num_q: [NB] valid rows in the block (0 for padding blocks).
        page_table: [S, P] page ids of each sequence; unused entries 0 (the dummy page).
        seq_kv_len: [S] tokens of KV of each sequence after this step's write (prefix + new).
        token_out_idx: [T] flat row (block * Bq + row) holding each packed token's output.
    """

    block_token_idx: Int32[Array, "NB Bq"]
    block_seq_id: Int32[Array, " NB"]
    block_q_start: Int32[Array, " NB"]
    block_num_q: Int32[Array, " NB"]
    page_table: Int32[Array, "S P"]
    seq_kv_len: Int32[Array, " S"]
    token_out_idx: Int32[Array, " T"]


@dataclasses.dataclass(frozen=True)
class HostAttentionMetadata:
    """The numpy twin of `AttentionMetadata`, built on the host and moved with `to_device()`."""

    block_token_idx: np.ndarray
    block_seq_id: np.ndarray
    block_q_start: np.ndarray
    block_num_q: np.ndarray
    page_table: np.ndarray
    seq_kv_len: np.ndarray
    token_out_idx: np.ndarray

    def tree(self) -> AttentionMetadata:
        """The same numpy arrays as an `AttentionMetadata` pytree: the `attn` field of a host-side
        `ForwardBatch`, which compiled steps take as numpy arguments."""
        return AttentionMetadata(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def to_device(self) -> AttentionMetadata:
        return jax.device_put(self.tree())


def num_blocks_for(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Upper bound on query blocks for a bucket: every sequence adds at most one partial block."""
    if block_q == 1:
        return num_tokens
    return num_tokens // block_q + num_seqs


def build_attention_metadata(
    extend_lens: Sequence[int],
    prefix_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    *,
    num_tokens: int,
    num_seqs: int,
    pages_per_seq: int,
    block_q: int,
) -> HostAttentionMetadata:
    """Lay out a ragged batch as query blocks.

    Args:
        extend_lens: new tokens of each sequence this step (1 for a decode); packed in this order.
        prefix_lens: tokens already in the pool for each sequence (the new tokens follow them).
        page_tables: page ids of each sequence, covering prefix + new tokens.
        num_tokens, num_seqs, pages_per_seq: the bucket (T, S, P), each >= the real size.
        block_q: rows per query block (Bq).

    Raises:
        ValueError: the batch does not fit the bucket.
    """
    n = len(extend_lens)
    if n > num_seqs or sum(extend_lens) > num_tokens:
        raise ValueError(f"batch of {n} seqs / {sum(extend_lens)} tokens exceeds bucket S={num_seqs} T={num_tokens}")
    nb = num_blocks_for(num_tokens, num_seqs, block_q)
    block_token_idx = np.zeros((nb, block_q), np.int32)
    block_seq_id = np.zeros(nb, np.int32)
    block_q_start = np.zeros(nb, np.int32)
    block_num_q = np.zeros(nb, np.int32)
    page_table = np.zeros((num_seqs, pages_per_seq), np.int32)
    seq_kv_len = np.zeros(num_seqs, np.int32)
    token_out_idx = np.zeros(num_tokens, np.int32)
    b = 0
    t = 0
    for s, (ext, pre, pages) in enumerate(zip(extend_lens, prefix_lens, page_tables)):
        if len(pages) > pages_per_seq:
            raise ValueError(f"sequence {s} needs {len(pages)} pages, bucket has {pages_per_seq}")
        page_table[s, : len(pages)] = pages
        seq_kv_len[s] = pre + ext
        for start in range(0, ext, block_q):
            rows = min(block_q, ext - start)
            block_token_idx[b, :rows] = np.arange(t + start, t + start + rows)
            block_seq_id[b] = s
            block_q_start[b] = pre + start
            block_num_q[b] = rows
            token_out_idx[t + start : t + start + rows] = b * block_q + np.arange(rows)
            b += 1
        t += ext
    assert b <= nb
    return HostAttentionMetadata(
        block_token_idx, block_seq_id, block_q_start, block_num_q, page_table, seq_kv_len, token_out_idx
    )
