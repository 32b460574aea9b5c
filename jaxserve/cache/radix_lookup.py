"""Read-only lookups in the radix tree: what the tree holds after a key, for speculative drafts.

Kept beside jaxserve/cache/radix_tree.py because it changes nothing in the tree (no split, no lock, no
access-time or hit update): it only walks the edges that `match_prefix` would, then follows the most
recently used children.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Sequence

if TYPE_CHECKING:
    from jaxserve.cache.radix_tree import RadixCache


def continuation(tree: RadixCache, key: Sequence[int], max_tokens: int, namespace: Hashable = None) -> list[int]:
    """Up to `max_tokens` tokens that the tree holds right after `key` (read-only: no split, no
    lock, no access-time or hit update). Where several cached sequences continue `key`, the most
    recently used one. Speculative decoding drafts from it: other requests' continuations of the
    same prefix (issue 20). `RadixCache.continuation` calls this.

    Returns:
        The token ids after `key` on a cached path (empty when no cached path extends `key`).
    """
    if tree.disable or max_tokens <= 0 or not key:
        return []
    key = tuple(int(t) for t in key)
    aligned = len(key) - len(key) % tree.page_size
    node, pos, rest = tree._root, 0, None
    while pos < aligned:
        child = node.children.get(tree._child_key(node, key, pos, namespace))
        if child is None:
            return []
        m = tree._match_len(child.key, key[:aligned], pos)
        if m < len(child.key):
            if pos + m < aligned:
                return []  # diverges inside the node
            rest = child.key[m:]
            node = child
            break
        pos += m
        node = child
    tail = key[aligned:]
    if rest is None:  # at a node boundary: the child whose first tokens are the tail
        candidates = [
            c for k, c in node.children.items()
            if (k[1] if node is tree._root else k)[: len(tail)] == tail
            and (node is not tree._root or k[0] == namespace)
        ]
        if not candidates:
            return []
        node = max(candidates, key=lambda c: c.last_access_time)
        rest = node.key
    if rest[: len(tail)] != tail:
        return []
    out = list(rest[len(tail) : len(tail) + max_tokens])
    while len(out) < max_tokens and node.children:
        node = max(node.children.values(), key=lambda c: c.last_access_time)
        out += node.key[: max_tokens - len(out)]
    return out
