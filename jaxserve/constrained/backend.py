"""The grammar backend interface: what the engine calls to constrain sampling to a grammar.

A request's grammar (`GrammarSpec`) is compiled once by a `GrammarBackend` (off the engine thread, see
`grammar_queue.py`), then every request gets its own `GrammarMatcher`. Each decode step the engine asks
the matcher for a token bitmask (`fill_bitmask`, one row of the batch bitmask of `bitmask.py`), masks the
logits inside the jitted sampler (`apply_bitmask_jax`), and feeds the sampled token back
(`accept_token`). When `is_terminated()` turns true the request finishes with finish_reason "stop".

Backends are chosen by name through `GRAMMAR_BACKENDS` / `get_grammar_backend` (`--grammar-backend`),
after SGLang's `--grammar-backend {xgrammar,outlines,llguidance,none}`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from jaxtyping import Int32

GrammarKind = Literal["regex", "json_schema", "ebnf", "choices"]
GRAMMAR_KINDS: frozenset[str] = frozenset({"regex", "json_schema", "ebnf", "choices"})


class InvalidGrammarError(ValueError):
    """A grammar that cannot be compiled; the message names the problem (bad regex, schema error, ...).

    A ValueError so that the server answers HTTP 400 without a special case.
    """


class GrammarDisabledError(InvalidGrammarError):
    """Structured generation was requested but the server runs with `--grammar-backend none`."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. Hashable: it is the compile-cache key.

    Fields:
        kind: "regex" (Rust `regex` syntax, the whole output must match; `\\d` means ASCII `[0-9]`),
            "json_schema" (a JSON Schema, as JSON text), "ebnf" (a Lark grammar, or a GBNF grammar as
            llama.cpp and xgrammar write it: `root ::= ...`), "choices" (a JSON list of strings: the
            output is exactly one of them; build it with `GrammarSpec.from_choices`).
        source: the grammar text.

    Raises:
        ValueError: unknown kind, or a source that is not a string.
    """

    kind: GrammarKind
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; expected one of {sorted(GRAMMAR_KINDS)}")
        if not isinstance(self.source, str):
            raise ValueError(f"grammar source must be a string, got {type(self.source).__name__}")

    @classmethod
    def of_sampling_params(cls, params: Any) -> GrammarSpec | None:
        """The constraint a request's `SamplingParams` asks for (its `regex`, `json_schema`, `ebnf` or
        `choices`, at most one set), or None when it is unconstrained."""
        if params.regex is not None:
            return cls.regex(params.regex)
        if params.json_schema is not None:
            return cls.json_schema(params.json_schema)
        if params.ebnf is not None:
            return cls.ebnf(params.ebnf)
        if params.choices is not None:
            return cls.from_choices(list(params.choices))
        return None

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def json_schema(cls, schema: str | Mapping[str, Any]) -> GrammarSpec:
        """From a schema as JSON text or as a dict. Keys keep their order: it is the order in which the
        output's properties are generated."""
        if isinstance(schema, str):
            return cls("json_schema", schema)
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls("ebnf", grammar)

    @classmethod
    def from_choices(cls, choices: Sequence[str]) -> GrammarSpec:
        """From a list of strings (SGLang's `select` / `choices`); the output is exactly one of them."""
        if isinstance(choices, str):
            raise ValueError("choices must be a list of strings, not one string")
        return cls("choices", json.dumps(list(choices), ensure_ascii=False))


@runtime_checkable
class CompiledGrammar(Protocol):
    """A grammar ready to start matchers from; immutable and shared by every request that uses it."""

    spec: GrammarSpec


@runtime_checkable
class GrammarMatcher(Protocol):
    """The grammar state of one request. Not thread-safe: one request, one thread at a time."""

    def fill_bitmask(self, bitmask_row: Int32[np.ndarray, " W"]) -> None:
        """Write the allowed next tokens into one bitmask row.

        Args:
            bitmask_row: int32 [ceil(vocab_size / 32)], C-contiguous (a row of `allocate_bitmask`); bit
                `t % 32` of word `t // 32` is set iff token t is allowed. EOS is allowed only where the
                grammar accepts; once terminated, only EOS is allowed.

        Raises:
            ValueError: wrong dtype, shape or layout.
        """
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False if the grammar rejects it; the state is then unchanged."""
        ...

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance by tokens in order until one is rejected; returns how many were accepted."""
        ...

    def is_terminated(self) -> bool:
        """True when the grammar admits no more text (or EOS was accepted): finish with reason "stop"."""
        ...

    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (EOS would be accepted now)."""
        ...

    def jump_forward_tokens(self) -> list[int]:
        """Tokens the grammar forces next (exactly one continuation), without advancing; may be empty.

        The caller appends them without sampling and calls `accept_token` for each, or calls
        `accept_jump_forward` which does both.
        """
        ...

    def accept_jump_forward(self) -> list[int]:
        """Compute the forced tokens and advance past them; returns them (empty if none)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding, retokenization).

        Raises:
            ValueError: more tokens than were accepted, or a matcher in an error state.
        """
        ...

    def error_message(self) -> str | None:
        """Why the matcher stopped on an internal error (e.g. a parser resource limit), else None."""
        ...


@runtime_checkable
class GrammarBackend(Protocol):
    """Compiles `GrammarSpec`s for one tokenizer and starts matchers. `compile` is thread-safe."""

    name: str
    vocab_size: int  # tokens: the width of the logits the bitmask covers

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile (or fetch from the cache). Raises InvalidGrammarError naming the problem."""
        ...

    def lookup(self, spec: GrammarSpec) -> CompiledGrammar | None:
        """The cached compiled grammar, or None; never compiles (cheap on the engine thread)."""
        ...

    def new_matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""
        ...

    def fill_bitmask_batch(
        self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: Int32[np.ndarray, "B W"]
    ) -> None:
        """`fill_bitmask` for many requests: row `i` of `bitmask` for each (matcher, i); other rows untouched."""
        ...


class NoGrammarBackend:
    """`--grammar-backend none`: structured generation is disabled; every compile raises."""

    name = "none"

    def __init__(self, tokenizer: Any = None, *, vocab_size: int | None = None, **_: Any) -> None:
        self.vocab_size = vocab_size if vocab_size is not None else (len(tokenizer) if tokenizer is not None else 0)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        raise GrammarDisabledError(
            # no kind in the message: the server's `param` names the field, and a request's grammar may come
            # from a field that is not a grammar (tool_choice "required" is an EBNF grammar)
            "structured generation is disabled (--grammar-backend none): this field needs it"
        )

    def lookup(self, spec: GrammarSpec) -> CompiledGrammar | None:
        return None

    def new_matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        raise GrammarDisabledError("structured generation is disabled (--grammar-backend none)")

    def fill_bitmask_batch(
        self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: Int32[np.ndarray, "B W"]
    ) -> None:
        for matcher, row in matchers:
            matcher.fill_bitmask(bitmask[row])
