"""Order of the waiting queue (`--schedule-policy`), after SGLang's SchedulePolicy.

    fcfs        arrival order
    lpm         longest cached prefix first (more reuse, and the shared prefix stays hot); falls back
                to fcfs when more than LPM_FALLBACK_QUEUE_LEN requests wait, where matching them all
                each step would cost more than it saves
    lof         longest output (max_new_tokens) first
    random      shuffled
    dfs-weight  depth-first over the radix tree, heavier subtrees (more waiting requests) first, so
                requests that share a prefix run together

Cache-aware policies (lpm, dfs-weight) become fcfs when the radix cache is disabled.
"""

from __future__ import annotations

import random
from typing import Callable

from jaxserve.core.request import Req

LPM_FALLBACK_QUEUE_LEN = 128


def order_fcfs(reqs: list[Req], prefix_len: Callable[[Req], int], rng: random.Random) -> list[Req]:
    return sorted(reqs, key=lambda r: r.arrival_time)


def order_lpm(reqs: list[Req], prefix_len: Callable[[Req], int], rng: random.Random) -> list[Req]:
    if len(reqs) > LPM_FALLBACK_QUEUE_LEN:
        return order_fcfs(reqs, prefix_len, rng)
    return sorted(reqs, key=lambda r: (-prefix_len(r), r.arrival_time))


def order_lof(reqs: list[Req], prefix_len: Callable[[Req], int], rng: random.Random) -> list[Req]:
    return sorted(reqs, key=lambda r: (-r.sampling_params.max_new_tokens, r.arrival_time))


def order_random(reqs: list[Req], prefix_len: Callable[[Req], int], rng: random.Random) -> list[Req]:
    out = list(reqs)
    rng.shuffle(out)
    return out


def order_dfs_weight(reqs: list[Req], prefix_len: Callable[[Req], int], rng: random.Random) -> list[Req]:
    """Group requests by shared token prefixes (a trie over their prompts), heaviest branch first."""
    trie: dict = {}
    for r in sorted(reqs, key=lambda r: r.arrival_time):
        node = trie
        for tok in r.fill_ids[:64]:
            node = node.setdefault(tok, {})
            node.setdefault("__n", 0)
            node["__n"] += 1
        node.setdefault("__reqs", []).append(r)
    out: list[Req] = []

    def walk(node: dict) -> None:
        out.extend(node.get("__reqs", []))
        children = [(k, v) for k, v in node.items() if not isinstance(k, str)]
        for _, child in sorted(children, key=lambda kv: -kv[1]["__n"]):
            walk(child)

    walk(trie)
    return out


POLICIES: dict[str, Callable] = {
    "fcfs": order_fcfs,
    "lpm": order_lpm,
    "lof": order_lof,
    "random": order_random,
    "dfs-weight": order_dfs_weight,
}
CACHE_AWARE = {"lpm", "dfs-weight"}


def get_policy(name: str, radix_cache_enabled: bool) -> Callable:
    """The ordering function for `--schedule-policy`. Raises ValueError for an unknown name."""
    if name not in POLICIES:
        raise ValueError(f"unknown schedule policy {name!r}; choose one of {', '.join(POLICIES)}")
    if name in CACHE_AWARE and not radix_cache_enabled:
        return order_fcfs
    return POLICIES[name]
