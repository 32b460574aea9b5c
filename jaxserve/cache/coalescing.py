"""Release policy stage 3: cross-request coalescing (`--enable-auto-merge`).

Three pieces, each a pure function of the tree (the cache manager and the policy apply them):

- Partial-page reuse. The tree matches whole pages, so SGLang drops up to page_size - 1 matched tokens
  at the end of a match. `find_partial_page` finds the device child whose first page shares the most
  leading tokens with the rest of the key; the caller copies that page into a fresh private page
  (copy-on-write) and starts the request past the shared tokens. With it, a page_size > 1 caches as
  many tokens as page_size 1.
- Short private tails. On release, a request's last partly filled page (kv_len % page_size tokens) is
  normally freed. `should_keep_tail` keeps it in the tree (`RadixCache.insert_tail`) when it is short
  (<= `--merge-max-suffix-tokens`) and hangs below a path that is mostly shared
  (>= `--merge-min-shared-ratio` of the path's tokens are in nodes matched by another request).
- Path compression. `merge_chains` folds chains of unlocked single-child nodes of the same tier into
  one node (splits leave such chains when a branch is evicted), so matches walk fewer nodes.
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence

from jaxserve.cache.freezing import path_len
from jaxserve.cache.radix_tree import RadixCache, TreeNode


class PartialPage(NamedTuple):
    """A page whose first `num_tokens` slots hold the key's next tokens (0 < num_tokens < page_size,
    or fewer than the key has left)."""

    node: TreeNode
    page: int
    num_tokens: int


def find_partial_page(
    tree: RadixCache, node: TreeNode, key: Sequence[int], pos: int, namespace: Hashable = None
) -> PartialPage | None:
    """The device child of `node` sharing the most leading tokens with `key[pos:pos + page_size]`.

    Args:
        tree: the radix cache.
        node: the device node the page-aligned match ended at (the root when nothing matched).
        key: the lookup key (tokens; need not be page-aligned).
        pos: tokens of `key` matched up to `node` (a multiple of page_size).
        namespace: only children of this namespace count (matters below the root).

    Returns:
        the best PartialPage, or None when no child shares a first token. Cost: O(children x page_size).
    """
    ps = tree.page_size
    want = tuple(key[pos : pos + ps])
    if not want:
        return None
    best = None
    best_len = 0
    for child in node.children.values():
        if not child.is_on_device or (node is tree.root and child.namespace != namespace):
            continue
        first = child.key[:ps]
        if first[0] != want[0]:
            continue
        n = 1
        limit = min(len(first), len(want))
        while n < limit and first[n] == want[n]:
            n += 1
        if n > best_len:
            best, best_len = child, n
    if best is None:
        return None
    return PartialPage(best, int(best.pages[0]), best_len)


def shared_prefix_len(node: TreeNode) -> int:
    """Tokens from the root to the deepest node on `node`'s path that another request matched
    (`hit_count >= 1`: the node was used by its inserter and at least one more request)."""
    while node.parent is not None and node.hit_count < 1:
        node = node.parent
    return path_len(node)


def should_keep_tail(
    tree: RadixCache,
    parent: TreeNode,
    tail_key: Sequence[int],
    max_suffix_tokens: int,
    min_shared_ratio: float,
    namespace: Hashable = None,
) -> bool:
    """Whether a released request's partial last page (`tail_key`, below `parent`) stays in the tree.

    True when the tail is at most `max_suffix_tokens` long, the shared part of the path is at least
    `min_shared_ratio` of path + tail, and no device child of `parent` already starts with the tail.
    """
    if not 0 < len(tail_key) <= max_suffix_tokens or len(tail_key) >= tree.page_size:
        return False
    total = path_len(parent) + len(tail_key)
    if shared_prefix_len(parent) < min_shared_ratio * total:
        return False
    covered = find_partial_page(tree, parent, tail_key, 0, namespace)
    return covered is None or covered.num_tokens < len(tail_key)


def merge_chains(tree: RadixCache) -> int:
    """Merge every chain of unlocked single-child nodes of the same tier. Returns the merges done."""
    num_merges = 0
    for node in list(tree.iter_nodes()):
        while node.parent is not None and tree.can_merge_child(node):
            tree.merge_child(node)
            num_merges += 1
    return num_merges
