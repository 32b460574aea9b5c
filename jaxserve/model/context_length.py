"""The context length a server runs with: `--context-length`, checked against the model's trained one.

SGLang 0.5.23's rule (`ModelConfig._derive_context_length`): a requested length above the model's
`max_position_embeddings` is refused unless the environment variable
SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is true, in which case it is a warning. Positions past the
trained length give wrong outputs, so the default is to refuse. Without the flag jaxserve keeps its own
default: the model's length capped at MAX_DEFAULT_CONTEXT (a CPU memory reason, docs/api.md).

`trained_context_length` reads that length from the checkpoint's metadata alone (no weights), so that
serve.py refuses a too long `--context-length` before its port binds; the Engine API only warns.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

logger = logging.getLogger(__name__)

ALLOW_LONGER_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"  # SGLang's name, so one setting serves both
_TRUE = frozenset({"1", "true", "yes", "y"})  # the values SGLang's EnvBool reads as true


def resolve_context_length(requested: int | None, max_position_embeddings: int, default_cap: int,
                           environ: Mapping[str, str] = os.environ, refuse_longer: bool = True) -> int:
    """The context length in tokens.

    Args:
        requested: `--context-length`, or None for the default.
        max_position_embeddings: the model's trained length (tokens).
        default_cap: the most tokens the default takes (jaxserve's MAX_DEFAULT_CONTEXT).
        environ: where SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is read.
        refuse_longer: False makes a longer `requested` a warning whatever the variable says (the
            Engine API, whose callers, tests with tiny checkpoints among them, choose lengths on purpose;
            serve.py refuses before it builds an Engine).

    Raises:
        ValueError: `requested` is above `max_position_embeddings`, the variable is not true and
            `refuse_longer` is set.
    """
    if requested is None:
        return min(max_position_embeddings, default_cap)
    if requested > max_position_embeddings:
        msg = (f"--context-length {requested} is greater than the model's context length {max_position_embeddings} "
               "(max_position_embeddings); positions past it may give wrong outputs.")
        if not refuse_longer or environ.get(ALLOW_LONGER_ENV, "").strip().lower() in _TRUE:
            logger.warning("%s Used anyway.", msg)
        else:
            raise ValueError(f"{msg} To allow it, set the environment variable {ALLOW_LONGER_ENV}=1")
    return requested


def trained_context_length(model_path: str) -> int | None:
    """The model's `max_position_embeddings` (tokens), from the loader's metadata-only
    `read_model_config` (an HF config.json, or a GGUF's `{arch}.context_length`, 2048 when absent);
    None when the checkpoint's config cannot be read (the Engine's own load then reports why).
    """
    from jaxserve.model.loader import read_model_config

    try:
        return read_model_config(model_path).max_position_embeddings
    except (OSError, ValueError, KeyError):
        return None
