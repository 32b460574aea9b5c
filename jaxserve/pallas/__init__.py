"""Attention over the paged KV pool: the pure-XLA path, the Pallas kernel, the metadata they share, and
the fixed-order float sums (numerics.py) that the model shares with them.

Backends are chosen by name through `get_attention_backend` (`--attention-backend`). Importing this
package does not import Pallas: the kernel module loads `jax.experimental.pallas` on first call.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax

from jaxserve.pallas.ragged_paged_attention import ragged_paged_attention
from jaxserve.pallas.reference import ragged_paged_attention_xla

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS: dict[str, Callable] = {
    "xla": ragged_paged_attention_xla,
    "pallas": ragged_paged_attention,
}


@functools.cache
def _log_interpret_mode_once() -> None:
    logger.warning("pallas attention runs in interpret mode on CPU: slow, meant for tests only")


def get_attention_backend(name: str) -> Callable:
    """Return the ragged paged attention function registered under `name`.

    Every backend has the signature of `ragged_paged_attention_xla`
    `(q [T, H, D], k_pool, v_pool [L, N, KVH, page_size, D], layer, meta, sm_scale) -> [T, H, D]`.

    Raises:
        ValueError: `name` is not a registered backend (the message lists the supported ones).
    """
    try:
        backend = ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; supported: {', '.join(sorted(ATTENTION_BACKENDS))}"
        ) from None
    if name == "pallas" and jax.default_backend() == "cpu":
        _log_interpret_mode_once()
    return backend


__all__ = ["ATTENTION_BACKENDS", "get_attention_backend", "ragged_paged_attention", "ragged_paged_attention_xla"]
