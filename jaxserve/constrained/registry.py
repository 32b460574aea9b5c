"""The grammar backends by name (`--grammar-backend`): the one table the engine builds its backend from.

llguidance is imported only when its backend is built: structured generation costs nothing until used.
"""

from __future__ import annotations

from typing import Any, Callable

from jaxserve.constrained.backend import GrammarBackend, NoGrammarBackend


def _make_llguidance(tokenizer: Any, **kwargs: Any) -> GrammarBackend:
    # Imported lazily: llguidance is only loaded when structured generation is enabled.
    from jaxserve.constrained.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, **kwargs)


def _make_none(tokenizer: Any, **kwargs: Any) -> GrammarBackend:
    return NoGrammarBackend(tokenizer, **kwargs)


GRAMMAR_BACKENDS: dict[str, Callable[..., GrammarBackend]] = {
    "llguidance": _make_llguidance,
    "none": _make_none,
}


def get_grammar_backend(
    name: str,
    tokenizer: Any,
    *,
    whitespace_pattern: str | None = None,
    vocab_size: int | None = None,
    **options: Any,
) -> GrammarBackend:
    """Build the grammar backend `name` for a transformers fast tokenizer.

    Args:
        name: a key of GRAMMAR_BACKENDS ("llguidance", "none").
        tokenizer: the model's transformers fast tokenizer.
        whitespace_pattern: regex for the whitespace allowed between JSON tokens (SGLang's
            `--constrained-json-whitespace-pattern`); None = the backend's bounded default.
        vocab_size: width of the model's logits if larger than the tokenizer's (padded embeddings).
        options: backend-specific keyword arguments (e.g. `cache_size` for llguidance).

    Raises:
        ValueError: unknown backend name, or an invalid whitespace pattern.
    """
    try:
        factory = GRAMMAR_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown grammar backend {name!r}; expected one of {sorted(GRAMMAR_BACKENDS)}") from None
    return factory(tokenizer, whitespace_pattern=whitespace_pattern, vocab_size=vocab_size, **options)
