"""Structured generation: grammar (regex / JSON schema / EBNF / choices) -> token bitmask.

The engine uses `get_grammar_backend` once, a `GrammarCompiler` + `GrammarQueue` to compile off its thread,
one `GrammarMatcher` per request, and `allocate_bitmask` / `apply_bitmask_jax` in the sampler.
llguidance is imported only when the "llguidance" backend is built.
"""

from jaxserve.constrained.backend import (
    GRAMMAR_KINDS,
    CompiledGrammar,
    GrammarBackend,
    GrammarDisabledError,
    GrammarMatcher,
    GrammarSpec,
    InvalidGrammarError,
)
from jaxserve.constrained.grammar_queue import GrammarCompiler, GrammarQueue, GrammarReady
from jaxserve.constrained.registry import GRAMMAR_BACKENDS, get_grammar_backend

__all__ = [
    "GRAMMAR_BACKENDS",
    "GRAMMAR_KINDS",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarDisabledError",
    "GrammarMatcher",
    "GrammarQueue",
    "GrammarReady",
    "GrammarSpec",
    "InvalidGrammarError",
    "get_grammar_backend",
]
