"""Simulated constrained generation without a model: sample random allowed tokens from the mask."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.constrained.backend import GrammarBackend, GrammarMatcher
from jaxserve.constrained.bitmask import allocate_bitmask, unpack_bitmask

# Texts that close JSON structures quickly; single tokens in the SmolLM2 vocabulary are used.
_CLOSER_TEXTS = ['"', "}", "]", "0", '"}', '"]', "}]", "]}", "}}", "]]", "\"},", "0}", "0]"]


@dataclass
class WalkResult:
    tokens: list[int]  # every accepted token, EOS included
    text: str  # decoded output without EOS
    is_terminated: bool
    num_steps: int
    num_forced_tokens: int


def token_ids_of(tokenizer, texts: list[str]) -> list[int]:
    """Ids of the texts that are one token each."""
    ids = []
    for text in texts:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == 1:
            ids.append(encoded[0])
    return ids


def whitespace_token_ids(tokenizer) -> np.ndarray:
    """Ids of tokens made only of spaces, tabs and line breaks, longest first."""
    ids = []
    for i, text in enumerate(tokenizer.batch_decode([[i] for i in range(len(tokenizer))])):
        if text and not text.strip(" \t\r\n"):
            ids.append((len(text), i))
    return np.array([i for _, i in sorted(ids, reverse=True)], dtype=np.int32)


def random_walk(
    backend: GrammarBackend,
    matcher: GrammarMatcher,
    tokenizer,
    seed: int,
    *,
    max_steps: int = 200,
    close_after: int | None = 120,
    policy: str = "mixed",
    whitespace_ids: np.ndarray | None = None,
    use_jump_forward: bool = True,
) -> WalkResult:
    """Generate until the grammar terminates or `max_steps` steps.

    Each step: accept the forced tokens (if `use_jump_forward`), else fill the mask and pick an allowed
    token: uniformly at random, or the lowest or highest allowed id; with policy "whitespace", the
    longest allowed whitespace-only token whenever there is one (a model stuck on blank space).
    After `close_after` steps, pick EOS or a closing token ('"', '}', ']', '0') when allowed, so that
    walks through open-ended structures finish. Checks on the way: the mask is never empty, EOS is
    allowed exactly when the matcher accepts, and every picked token is accepted.
    """
    rng = np.random.default_rng(seed)
    eos = set(getattr(backend, "eos_token_ids", (tokenizer.eos_token_id,)))
    eos_ids = np.array(sorted(eos), dtype=np.int64)
    closers = np.array(sorted(eos) + token_ids_of(tokenizer, _CLOSER_TEXTS), dtype=np.int64)
    row = allocate_bitmask(1, backend.vocab_size)[0]
    tokens: list[int] = []
    num_forced = 0
    step = 0
    for step in range(max_steps):
        if matcher.is_terminated():
            break
        if use_jump_forward:
            forced = matcher.accept_jump_forward()
            if forced:
                tokens += forced
                num_forced += len(forced)
                continue
        matcher.fill_bitmask(row)
        is_allowed = unpack_bitmask(row[None], backend.vocab_size)[0]
        allowed = np.flatnonzero(is_allowed)
        assert len(allowed) > 0, "empty mask before termination"
        assert bool(is_allowed[eos_ids].any()) == matcher.is_accepting(), "EOS allowed iff the grammar accepts"
        is_closing = close_after is not None and step >= close_after
        token = _pick(rng, allowed, is_allowed, closers if is_closing else None, policy, whitespace_ids)
        assert matcher.accept_token(token), f"allowed token {token} rejected"
        tokens.append(token)
    else:
        step = max_steps
    text = tokenizer.decode([t for t in tokens if t not in eos], clean_up_tokenization_spaces=False)
    return WalkResult(tokens, text, matcher.is_terminated(), step, num_forced)


def _pick(rng, allowed, is_allowed, closers, policy, whitespace_ids) -> int:
    if closers is not None:
        allowed_closers = closers[is_allowed[closers]]
        return int(allowed_closers[0]) if len(allowed_closers) else int(allowed[0])
    if policy == "whitespace" and whitespace_ids is not None:
        allowed_ws = whitespace_ids[is_allowed[whitespace_ids]]
        if len(allowed_ws) and rng.random() < 0.9:
            return int(allowed_ws[0])
    r = rng.random()
    if r < 0.15:
        return int(allowed[0])
    if r < 0.3:
        return int(allowed[-1])
    return int(rng.choice(allowed))


def max_structural_whitespace_run(json_text: str) -> int:
    """Longest run of whitespace outside JSON string literals (inside strings it is content)."""
    longest = run = 0
    in_string = escaped = False
    for ch in json_text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch in " \t\r\n":
            run += 1
            longest = max(longest, run)
            continue
        run = 0
        if ch == '"':
            in_string = True
    return longest
