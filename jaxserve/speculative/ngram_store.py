"""Drafts from other requests: a bounded store of recent requests' tokens with a hashed suffix index.

SGLang 0.5.23's NGRAM speculation keeps one store of recent tokens shared by all requests (a trie of
the last `--speculative-ngram-max-trie-depth` tokens of every decoding request, bounded by
`--speculative-ngram-capacity` tokens) and looks each request's suffix up in it. A request that
writes what an earlier one wrote (the same JSON keys, the same edited code line, a stock phrase)
then gets a draft where its own text has none. This store holds whole finished requests (prompt +
output) instead, in arrival order, the oldest evicted first:

- `tokens`: a ring of `capacity` token ids (int32; -1 separates one request from the next, so no
  match and no draft crosses a boundary), `namespaces` the small id of each position's namespace
  (the radix tree keeps namespaces apart; drafts do too).
- For each window length n in `LEVELS` (2, 4, 8, 16 tokens), an open-addressing table from a hash of
  (namespace, the n tokens) to the ring index of the latest position where such a window ended. A
  collision overwrites the slot (the store is a cache: a lost entry is a missed draft, never a wrong
  output), and a hit is checked against the ring, so a hash collision or an overwritten position is
  no match. The tables grow with the store (doubling; two slots per token held, at least 4096).
- `match(suffix)`: from the longest level down, the first window that matches the suffix's last n
  tokens; its exact match length is counted back from there (up to `max_match_len`), and the draft
  is the tokens after it up to the end of that request's text. So the match found is the latest
  one of the longest level that has one, not always the longest match in the store (one found at
  level n is the latest of those at least n long).

Cost: `match` is a few numpy calls on at most 16 + `max_match_len` + K tokens per level, O(1) in
the store's size; `feed` is O(len(tokens) x sum(LEVELS)) vectorized; memory is 8 bytes per token
for the ring and 4 x len(LEVELS) per table slot, up to ~40 bytes per token in all (~0.6 GB at
SGLang's default capacity of 10,000,000 tokens, once that many have been fed: the arrays grow with
use).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np
from jaxtyping import Int

from jaxserve.speculative.ngram import NgramMatch

LEVELS = (2, 4, 8, 16)
SEPARATOR = -1
MIN_TABLE_SLOTS = 1 << 12
_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio (Knuth's multiplicative hashing)
_MIX_MULT = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finalizer (Steele et al. 2014)


class NgramStore:
    """Recent requests' tokens for cross-request n-gram drafts (see the module docstring).

    Args:
        capacity: tokens kept (separators included); the oldest are evicted first. Must be >= 2.
        max_match_len: longest match counted (tokens; `--speculative-ngram-max-trie-depth`).

    Raises:
        ValueError: capacity < 2 or max_match_len < 1.
    """

    def __init__(self, capacity: int, max_match_len: int = 18):
        if capacity < 2:
            raise ValueError(f"NgramStore capacity must be >= 2 tokens, got {capacity}")
        if max_match_len < 1:
            raise ValueError(f"NgramStore max_match_len must be >= 1, got {max_match_len}")
        self.capacity = capacity
        self.max_match_len = max_match_len
        self.reset()

    def reset(self) -> None:
        """Forget every token (the engine's cache flush)."""
        size = min(self.capacity, MIN_TABLE_SLOTS)
        self.tokens = np.full(size, SEPARATOR, dtype=np.int32)
        self.namespaces = np.zeros(size, dtype=np.int32)
        self.end = 0  # absolute position after the newest token; live positions: [end - len(tokens), end)
        self._namespace_ids: dict[Hashable, int] = {}
        self._tables = {n: np.full(_table_slots(size), -1, dtype=np.int32) for n in LEVELS}

    @property
    def num_tokens(self) -> int:
        """Tokens held now (separators included; at most `capacity`)."""
        return min(self.end, len(self.tokens))

    def feed(self, tokens: Sequence[int] | Int[np.ndarray, " N"], namespace: Hashable = None) -> None:
        """Append one request's tokens (prompt + output ids) after a separator, evicting the oldest
        tokens beyond `capacity`. Of a sequence longer than the store, the last capacity - 1 tokens."""
        arr = np.asarray(tokens, dtype=np.int32).reshape(-1)[-(self.capacity - 1):]
        if len(arr) == 0:
            return
        ns = self._namespace_ids.setdefault(namespace, len(self._namespace_ids))
        self._reserve(self.end + 1 + len(arr))
        start = self.end + 1
        self._write(self.end, np.array([SEPARATOR], dtype=np.int32), 0)
        self._write(start, arr, ns)
        self.end = start + len(arr)
        self._index(arr, start, ns)

    def match(self, tokens: Sequence[int] | Int[np.ndarray, " N"], num_draft: int, namespace: Hashable = None) -> NgramMatch:
        """The draft that followed the latest stored window equal to the end of `tokens`.

        Args:
            tokens: a request's tokens so far (only the last max(LEVELS) + max_match_len are read).
            num_draft: most draft tokens (K).
            namespace: only text fed under the same namespace matches.

        Returns:
            Up to `num_draft` tokens (fewer where the stored request's text ends) and the match length
            (tokens, at most `max_match_len`); `NgramMatch([], 0)` when no level matches.
        """
        ns = self._namespace_ids.get(namespace)
        if ns is None or num_draft <= 0 or self.end == 0:
            return NgramMatch([], 0)
        tail = np.asarray(tokens[-(LEVELS[-1] + self.max_match_len):], dtype=np.int32)
        size = len(self.tokens)
        oldest = self.end - size
        for n in reversed(LEVELS):
            if n > len(tail):
                continue
            index = int(self._tables[n][_slots(_window_hashes(tail[-n:], n, ns), len(self._tables[n]))[0]])
            if index < 0:
                continue
            pos = self.end - 1 - (self.end - 1 - index) % size  # the live position at that ring index
            if pos - n + 1 < oldest or int(self.namespaces[index]) != ns:
                continue
            if not np.array_equal(self._read(pos - n + 1, n), tail[-n:]):
                continue
            draft = self._read(pos + 1, min(num_draft, self.end - pos - 1))
            cut = np.flatnonzero(draft == SEPARATOR)
            draft = draft[: cut[0]] if len(cut) else draft
            if len(draft) == 0:
                continue
            return NgramMatch(draft.tolist(), self._match_len(tail, pos, n, oldest))
        return NgramMatch([], 0)

    def _match_len(self, tail: np.ndarray, pos: int, n: int, oldest: int) -> int:
        """How far the match ending at `pos` (known to be >= n) reaches back, up to max_match_len."""
        most = min(self.max_match_len, len(tail), pos - oldest + 1)
        if most <= n:
            return min(n, self.max_match_len)
        stored = self._read(pos - most + 1, most)[::-1]
        same = stored == tail[::-1][:most]
        return int(np.argmin(same)) if not same.all() else most

    def _index(self, arr: np.ndarray, start: int, ns: int) -> None:
        # windows inside this request's text whose end is not its last token (a hit there has no draft)
        for n in LEVELS:
            if len(arr) <= n:
                break
            hashes = _window_hashes(arr[:-1], n, ns)  # one per window end arr[n-1 .. len-2]
            slots = _slots(hashes, len(self._tables[n]))
            ends = ((start + n - 1 + np.arange(len(hashes), dtype=np.int64)) % len(self.tokens)).astype(np.int32)
            # the latest window of a slot wins: unique over the reversed order keeps last occurrences
            uniq, first_rev = np.unique(slots[::-1], return_index=True)
            self._tables[n][uniq] = ends[::-1][first_rev]

    def _reserve(self, new_end: int) -> None:
        """Grow the ring (and the tables) while it is below capacity and new_end would not fit."""
        size = len(self.tokens)
        if new_end <= size or size == self.capacity:
            return
        new_size = min(self.capacity, max(2 * size, 1 << max(new_end - 1, 1).bit_length()))
        # positions are all < size before the ring first wraps, so their slot index is unchanged
        for name in ("tokens", "namespaces"):
            old = getattr(self, name)
            grown = np.full(new_size, SEPARATOR if name == "tokens" else 0, dtype=np.int32)
            grown[:size] = old
            setattr(self, name, grown)
        if _table_slots(new_size) > len(self._tables[LEVELS[0]]):
            self._rehash(new_size)

    def _rehash(self, new_size: int) -> None:
        self._tables = {n: np.full(_table_slots(new_size), -1, dtype=np.int32) for n in LEVELS}
        live = self.tokens[: self.end]
        bounds = np.flatnonzero(live == SEPARATOR)
        for lo, hi in zip(bounds + 1, np.append(bounds[1:], self.end)):
            if hi > lo:
                self._index(live[lo:hi], int(lo), int(self.namespaces[lo]))

    def _write(self, pos: int, arr: np.ndarray, ns: int) -> None:
        idx = (pos + np.arange(len(arr))) % len(self.tokens)
        self.tokens[idx] = arr
        self.namespaces[idx] = ns

    def _read(self, pos: int, n: int) -> np.ndarray:
        return self.tokens[(pos + np.arange(n)) % len(self.tokens)]


def _table_slots(num_tokens: int) -> int:
    return max(MIN_TABLE_SLOTS, 2 << max(num_tokens - 1, 1).bit_length())


def _window_hashes(arr: np.ndarray, n: int, ns: int) -> np.ndarray:
    """uint64 hash of every length-n window of `arr` (one per window end, len(arr) - n + 1) and `ns`."""
    count = len(arr) - n + 1
    vals = arr.astype(np.uint64) + np.uint64(1)
    h = np.full(count, ns + 1, dtype=np.uint64) * _MIX_MULT
    for i in range(n):
        h = (h ^ vals[i: i + count]) * _HASH_MULT
    h ^= h >> np.uint64(31)
    return h * _MIX_MULT


def _slots(hashes: np.ndarray, num_slots: int) -> np.ndarray:
    return ((hashes >> np.uint64(17)) & np.uint64(num_slots - 1)).astype(np.int64)
