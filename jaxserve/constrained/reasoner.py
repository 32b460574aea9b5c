"""A grammar that waits for the reasoning to end: SGLang 0.5.23's `ReasonerGrammarObject`.

With `--reasoning-parser`, SGLang wraps every grammar of a request that reasons (`require_reasoning`:
the chat layer's thinking mode) so that the model reasons freely and the grammar constrains only what
follows the reasoning's end token sequence (`</think>` encoded by the tokenizer). `ReasonerMatcher`
does the same around any `GrammarMatcher`: while reasoning every token is allowed and accepted, the
end sequence is matched token by token (a partial match that breaks falls back to the longest suffix
that is still a prefix of it), and from the token that completes it on, every call goes to the inner
grammar. Only SGLang's default mode is served (no `--enable-strict-thinking` token filter, no
SGLANG_MAX_THINK_TOKENS budget).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from jaxtyping import Int32

from jaxserve.constrained.backend import GrammarMatcher


class ReasonerMatcher:
    """`inner` deferred until `think_end_ids` have been generated (a `GrammarMatcher` itself).

    Args:
        inner: the request's grammar matcher.
        think_end_ids: the reasoning's end as token ids (non-empty).

    Raises:
        ValueError: empty `think_end_ids`.
    """

    def __init__(self, inner: GrammarMatcher, think_end_ids: Sequence[int]):
        if not think_end_ids:
            raise ValueError("the reasoning's end token sequence must not be empty")
        self.inner = inner
        self.think_end_ids = tuple(int(t) for t in think_end_ids)
        self._recent: tuple[int, ...] = ()  # the reasoning's last len(think_end_ids) tokens
        # one entry per accepted token, for rollback: `_recent` before a reasoning token, None for a
        # token the inner grammar accepted
        self._history: list[tuple[int, ...] | None] = []
        self.is_reasoning = True

    @property
    def constraining(self) -> GrammarMatcher | None:
        """The matcher that constrains the next token: None while reasoning, else the inner grammar."""
        return None if self.is_reasoning else self.inner

    def fill_bitmask(self, bitmask_row: Int32[np.ndarray, " W"]) -> None:
        if self.is_reasoning:
            bitmask_row.fill(-1)
        else:
            self.inner.fill_bitmask(bitmask_row)

    def accept_token(self, token_id: int) -> bool:
        if not self.is_reasoning:
            ok = self.inner.accept_token(token_id)
            if ok:
                self._history.append(None)
            return ok
        self._history.append(self._recent)
        self._recent = (self._recent + (int(token_id),))[-len(self.think_end_ids):]
        if self._recent == self.think_end_ids:
            self.is_reasoning = False
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        for i, t in enumerate(token_ids):
            if not self.accept_token(int(t)):
                return i
        return len(token_ids)

    def is_terminated(self) -> bool:
        return not self.is_reasoning and self.inner.is_terminated()

    def is_accepting(self) -> bool:
        return not self.is_reasoning and self.inner.is_accepting()

    def jump_forward_tokens(self) -> list[int]:
        return [] if self.is_reasoning else self.inner.jump_forward_tokens()

    def accept_jump_forward(self) -> list[int]:
        if self.is_reasoning:
            return []
        forced = self.inner.accept_jump_forward()
        self._history.extend([None] * len(forced))
        return forced

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens, across the reasoning's end if need be.

        Raises:
            ValueError: more tokens than were accepted (or the inner grammar's error).
        """
        if num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens, {len(self._history)} were accepted")
        if num_tokens <= 0:
            return
        undone = self._history[-num_tokens:]
        del self._history[-num_tokens:]
        num_inner = sum(1 for h in undone if h is None)
        if num_inner:
            self.inner.rollback(num_inner)
        first_reasoning = next((h for h in undone if h is not None), None)
        if first_reasoning is not None:
            self._recent = first_reasoning
            self.is_reasoning = True

    def error_message(self) -> str | None:
        return None if self.is_reasoning else self.inner.error_message()

