"""The llguidance grammar backend (https://github.com/guidance-ai/llguidance, version 1.9.1).

llguidance compiles a grammar into a lexer + Earley parser when an `LLMatcher` is constructed (the GIL
is released meanwhile); `LLMatcher.deep_copy()` of a fresh matcher shares the compiled grammar and costs
about 1 ms. So a `LLGuidanceCompiledGrammar` holds one pristine template matcher and each request gets a
deep copy of it. Compiled grammars are kept in an LRU keyed by `GrammarSpec` (kind, source).

llguidance never raises on grammar errors: it puts the matcher in an error state (`is_error`,
`get_error`). `compile` checks that state right after construction, so invalid grammars raise
`InvalidGrammarError` at request time, never mid-generation. Tokens are accepted with
`try_consume_tokens`, which leaves the matcher untouched on a rejected token (`consume_token` would put it
in a permanent error state).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from jaxserve.constrained.backend import GrammarMatcher, GrammarSpec, InvalidGrammarError
from jaxserve.constrained.json_schema_strict import close_unnamed

if TYPE_CHECKING:
    from jaxtyping import Int32

logger = logging.getLogger(__name__)

# Whitespace allowed between JSON tokens by default: one optional line break plus up to 16 spaces or tabs
# of indentation. Pretty-printed JSON stays possible, but a model cannot run on in blank space until
# max_tokens, the failure that SGLang's --constrained-json-whitespace-pattern and outlines' `[ ]?`
# default exist for. llguidance's own default (whitespace_flexible) is the unbounded `[\x20\x0A\x0D\x09]+`.
# llguidance matches one whitespace lexeme per gap, never two in a row, and none before or after the
# top-level value (checked on 1.9.1), so a structural whitespace run is at most 18 characters.
DEFAULT_JSON_WHITESPACE_PATTERN = r"(?:\r?\n)?[ \t]{0,16}"

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (LRU); each holds a matcher of ~KB to a few MB

_MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class LLGuidanceCompiledGrammar:
    """A validated llguidance grammar: the serialized grammar and a pristine matcher to copy from."""

    spec: GrammarSpec
    grammar: str  # llguidance's serialized grammar (JSON text), as passed to LLMatcher
    template: LLMatcher
    warnings: tuple[str, ...] = ()


class LLGuidanceMatcher:
    """One request's grammar state over an `LLMatcher` (see `GrammarMatcher` for the contract)."""

    def __init__(self, matcher: LLMatcher, num_words: int, eos_token_ids: tuple[int, ...]) -> None:
        self._matcher = matcher
        self._num_words = num_words  # int32 words per bitmask row
        self._eos_token_ids = frozenset(eos_token_ids)
        # EOS accepted after the grammar stopped: llguidance does not record those tokens, so they are
        # counted here to keep rollback(n) in step with the caller's token list.
        self._num_eos_after_stop = 0
        self._num_ll_tokens = 0  # tokens llguidance holds (what it can roll back)

    @property
    def ll_matcher(self) -> LLMatcher:
        return self._matcher

    def fill_bitmask(self, bitmask_row: Int32[np.ndarray, " W"]) -> None:
        _check_bitmask(bitmask_row, (self._num_words,))
        # In an error state llguidance writes a mask that allows only EOS, so the request ends.
        self._matcher.unsafe_compute_mask_ptr(bitmask_row.ctypes.data, bitmask_row.nbytes)

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        if self._matcher.is_stopped():
            # try_consume_tokens refuses everything once stopped, EOS included; EOS is what the mask allows.
            if token_id in self._eos_token_ids and not self._matcher.is_error():
                self._num_eos_after_stop += 1
                return True
            return False
        if self._matcher.try_consume_tokens([token_id]) != 1:
            return False
        self._num_ll_tokens += 1
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        num_accepted = 0
        for token_id in token_ids:  # one at a time: EOS after a stop needs accept_token's handling
            if not self.accept_token(token_id):
                break
            num_accepted += 1
        return num_accepted

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    def jump_forward_tokens(self) -> list[int]:
        if self._matcher.is_stopped():
            return []
        # llguidance returns only the tokens whose tokenization is settled: the last forced bytes may
        # merge with what the model samples next, so they are left to sampling (compute_ff_bytes has them).
        return list(self._matcher.compute_ff_tokens())

    def jump_forward_text(self) -> bytes:
        """All the bytes the grammar forces next (a superset of the decoded `jump_forward_tokens`)."""
        return self._matcher.compute_ff_bytes()

    def accept_jump_forward(self) -> list[int]:
        tokens = self.jump_forward_tokens()
        num_accepted = self.accept_tokens(tokens)
        if num_accepted != len(tokens):  # llguidance computed them from this state: never expected
            self.rollback(num_accepted)
            raise RuntimeError(f"llguidance rejected its own forced tokens {tokens} at {num_accepted}")
        return tokens

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"cannot roll back a negative number of tokens ({num_tokens})")
        num_eos = min(num_tokens, self._num_eos_after_stop)
        num_ll_tokens = num_tokens - num_eos
        if num_ll_tokens > self._num_ll_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {self.num_tokens} were accepted")
        if num_ll_tokens and not self._matcher.rollback(num_ll_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {_short_error(self._matcher.get_error())}")
        self._num_eos_after_stop -= num_eos
        self._num_ll_tokens -= num_ll_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens accepted so far (minus those rolled back)."""
        return self._num_ll_tokens + self._num_eos_after_stop

    def reset(self) -> None:
        """Back to the start of the grammar (rolls back every token)."""
        self._matcher.reset()
        self._num_eos_after_stop = 0
        self._num_ll_tokens = 0

    def error_message(self) -> str | None:
        return _short_error(self._matcher.get_error()) if self._matcher.is_error() else None


class LLGuidanceBackend:
    """Grammar backend on llguidance for one tokenizer.

    Args:
        tokenizer: a transformers fast tokenizer (`llguidance.hf.from_tokenizer` wraps its Rust backend;
            ~1 s, done once here).
        vocab_size: tokens per logits row if larger than the tokenizer's vocabulary (padded embeddings);
            the extra ids are never allowed. Default: the tokenizer's size.
        whitespace_pattern: regex for the whitespace allowed between JSON tokens (SGLang's
            `--constrained-json-whitespace-pattern`); "" allows none. Default
            `DEFAULT_JSON_WHITESPACE_PATTERN` (bounded). A schema's own "x-guidance" options override it.
        json_lenient: ignore JSON Schema keywords llguidance does not implement (e.g. uniqueItems, not)
            instead of rejecting the schema; outputs may then break those keywords.
        cache_size: compiled grammars kept in the LRU.
        limits: llguidance parser limits (`LLParserLimits`); None = llguidance's defaults.
        eos_token_ids: override the tokenizer's EOS token(s).

    Raises:
        ValueError: an invalid whitespace pattern, or a tokenizer llguidance cannot wrap (slow tokenizers).
    """

    name = "llguidance"

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        whitespace_pattern: str | None = None,
        json_lenient: bool = False,
        cache_size: int = DEFAULT_CACHE_SIZE,
        limits: llguidance.LLParserLimits | None = None,
        eos_token_ids: int | list[int] | None = None,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self._ll_tokenizer: LLTokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids
        )
        self.vocab_size: int = self._ll_tokenizer.vocab_size
        self.eos_token_ids: tuple[int, ...] = tuple(self._ll_tokenizer.eos_tokens)
        self.num_words: int = (self.vocab_size + 31) // 32
        self.whitespace_pattern = DEFAULT_JSON_WHITESPACE_PATTERN if whitespace_pattern is None else whitespace_pattern
        self._json_options: dict[str, Any] = {"whitespace_pattern": self.whitespace_pattern}
        if json_lenient:
            self._json_options["lenient"] = True
        self._limits = limits
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, LLGuidanceCompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: LLExecutor | None = None
        try:
            self.compile(GrammarSpec.json_schema({"type": "object"}))
        except InvalidGrammarError as e:
            raise ValueError(f"invalid JSON whitespace pattern {self.whitespace_pattern!r}: {e}") from None

    @property
    def ll_tokenizer(self) -> LLTokenizer:
        return self._ll_tokenizer

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def lookup(self, spec: GrammarSpec) -> LLGuidanceCompiledGrammar | None:
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
            return compiled

    def compile(self, spec: GrammarSpec) -> LLGuidanceCompiledGrammar:
        """Compile `spec` into a validated grammar (cached). Thread-safe; drops the GIL while building.

        Raises:
            InvalidGrammarError: the regex, JSON schema, EBNF or choice list is invalid; the message names
                the kind and llguidance's reason (e.g. 'invalid regex: ... unclosed group').
        """
        compiled = self.lookup(spec)
        if compiled is not None:
            return compiled
        grammar = self.grammar_text(spec)
        template = LLMatcher(self._ll_tokenizer, grammar, log_level=0, limits=self._limits)
        error = template.get_error() if template.is_error() else self._first_token_error(template)
        if error is not None:
            raise InvalidGrammarError(f"invalid {_KIND_NAMES[spec.kind]}: {_short_error(error)}")
        warnings = tuple(template.get_grammar_warnings())
        for warning in warnings:
            logger.warning("grammar warning (%s): %s", spec.kind, warning)
        compiled = LLGuidanceCompiledGrammar(spec, grammar, template, warnings)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _first_token_error(self, template: LLMatcher) -> str | None:
        """llguidance's error after one allowed token on a copy of `template`, or None.

        Some limits are only hit when the lexer builds its states for real: `a{99999999}` constructs
        and computes its first mask fine, then fails with "too many expressions constructed" on the
        first token, which would end the request with an abort. Taking one step here turns that into
        an error when the grammar is checked. Limits hit deeper into a generation still abort it.
        """
        probe = template.deep_copy()
        mask = np.zeros(self.num_words, np.int32)
        probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        token = next((int(t) for t in allowed if int(t) not in self.eos_token_ids), None)
        if token is not None:
            probe.try_consume_tokens([token])
        return probe.get_error() if probe.is_error() else None

    def grammar_text(self, spec: GrammarSpec) -> str:
        """llguidance's serialized grammar for `spec`, not yet validated.

        Raises:
            InvalidGrammarError: the source cannot even be parsed (non-JSON schema, empty choice list).
        """
        try:
            return _GRAMMAR_BUILDERS[spec.kind](spec.source, self._json_options)
        except InvalidGrammarError:
            raise
        except (ValueError, TypeError) as e:
            raise InvalidGrammarError(f"invalid {_KIND_NAMES[spec.kind]}: {e}") from None

    def new_matcher(self, compiled: LLGuidanceCompiledGrammar) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.template.deep_copy(), self.num_words, self.eos_token_ids)

    def fill_bitmask_batch(
        self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: Int32[np.ndarray, "B W"]
    ) -> None:
        """Fill row `i` of `bitmask` [B, ceil(vocab/32)] for each (matcher, i), in parallel on llguidance's
        thread pool (`LLExecutor`, up to 32 threads) with the GIL released."""
        if not matchers:
            return
        _check_bitmask(bitmask, (bitmask.shape[0], self.num_words))
        for _, row in matchers:
            if not 0 <= row < bitmask.shape[0]:
                raise ValueError(f"bitmask row {row} out of range for a batch of {bitmask.shape[0]}")
        if not all(isinstance(m, LLGuidanceMatcher) for m, _ in matchers):
            for matcher, row in matchers:
                matcher.fill_bitmask(bitmask[row])
            return
        if self._executor is None:
            self._executor = LLExecutor()
        pairs = [(m.ll_matcher, row) for m, row in matchers]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, self.num_words * 4, bitmask.shape[0])


def _regex_grammar(source: str, json_options: dict[str, Any]) -> str:
    # `\d` as ASCII digits, as JSON Schema patterns, xgrammar and outlines read it (Rust's `\d` is Unicode).
    return LLMatcher.grammar_from_lark("start: /" + llguidance.regex_to_lark(source, "d") + "/")


def _json_schema_grammar(source: str, json_options: dict[str, Any]) -> str:
    try:
        schema = json.loads(source)
        if not isinstance(schema, dict):
            raise InvalidGrammarError(f"invalid JSON schema: expected a JSON object, got {type(schema).__name__}")
        # SGLang's default (xgrammar's strict mode): no property or item the schema does not name.
        schema = close_unnamed(schema)
    except json.JSONDecodeError as e:
        raise InvalidGrammarError(f"invalid JSON schema: not valid JSON ({e})") from None
    except RecursionError:  # Python's parser and close_unnamed recurse once per level
        raise InvalidGrammarError("invalid JSON schema: nested too deeply") from None
    # `defaults` (not `overrides`): a schema's own "x-guidance" options take precedence.
    return LLMatcher.grammar_from_json_schema(schema, defaults=json_options)  # type: ignore[arg-type]


def _ebnf_grammar(source: str, json_options: dict[str, Any]) -> str:
    if not source.strip():
        raise InvalidGrammarError("invalid EBNF grammar: empty")
    # Lark as is; GBNF (`root ::= ...`) is converted to Lark by llguidance's gbnf_to_lark.
    return llguidance.grammar_from("ebnf", source)


def _choices_grammar(source: str, json_options: dict[str, Any]) -> str:
    try:
        choices = json.loads(source)
    except json.JSONDecodeError as e:
        raise InvalidGrammarError(f"invalid choices: not a JSON list of strings ({e})") from None
    except RecursionError:
        raise InvalidGrammarError("invalid choices: not a JSON list of strings (nested too deeply)") from None
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise InvalidGrammarError("invalid choices: expected a JSON list of strings")
    if not choices:
        raise InvalidGrammarError("invalid choices: the list is empty")
    # Lark string literals take JSON escapes; this is llguidance's own grammar_from("choice", ...).
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices)))


_GRAMMAR_BUILDERS: dict[str, Callable[[str, dict[str, Any]], str]] = {
    "regex": _regex_grammar,
    "json_schema": _json_schema_grammar,
    "ebnf": _ebnf_grammar,
    "choices": _choices_grammar,
}

_KIND_NAMES = {"regex": "regex", "json_schema": "JSON schema", "ebnf": "EBNF grammar", "choices": "choices"}


# llguidance's stop reasons that reach a user as an error, said in words
_STOP_REASONS = {
    # no token, not even the end of the text, is allowed at the start (`root ::= root`, `[^\x00-\x{10FFFF}]`)
    "NoExtensionBias": "the grammar matches no string",
}


def _short_error(message: str) -> str:
    # Verbose llguidance errors append the parser state and the whole grammar; keep the reason.
    message = message.split("\n<state>", 1)[0].strip()
    message = _STOP_REASONS.get(message, message)
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + " ..."


def _check_bitmask(bitmask: np.ndarray, shape: tuple[int, ...]) -> None:
    if not isinstance(bitmask, np.ndarray) or bitmask.dtype != np.int32:
        raise ValueError(f"bitmask must be a numpy int32 array, got {getattr(bitmask, 'dtype', type(bitmask))}")
    if bitmask.shape != shape:
        raise ValueError(f"bitmask shape {bitmask.shape} != {shape} (ceil(vocab_size / 32) words per row)")
    if not bitmask.flags["C_CONTIGUOUS"]:
        raise ValueError("bitmask must be C-contiguous")
    if not bitmask.flags["WRITEABLE"]:
        raise ValueError("bitmask must be writeable")
