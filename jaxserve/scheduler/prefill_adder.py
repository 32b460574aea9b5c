"""PrefillAdder: admits waiting requests into one prefill batch under a token budget and the KV budget.

Token budget: at most `token_budget` new tokens per batch (`--chunked-prefill-size`, or
`--max-prefill-tokens` without chunking). With chunking, the request that does not fit is cut to the
remaining budget and continues in the next prefill batch (the "chunked request").

KV budget (after SGLang's PrefillAdder): a request is admitted only if its remaining prompt plus
`new_token_ratio x max_new_tokens` fits in what the pool can give now (free pages + evictable cache),
after the same reservation for every running request. The ratio starts at 0.7 and decays towards 0.1
as requests finish early; a retraction pushes it back up (see Scheduler).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from jaxserve.core.request import Req
from jaxserve.scheduler.cache_manager import CacheManager


class AddResult(enum.Enum):
    ADDED = "added"
    CHUNKED = "chunked"  # admitted with part of its prompt; the batch is full
    NO_TOKEN_BUDGET = "no_token_budget"
    NO_KV = "no_kv"


@dataclass
class PrefillAdder:
    """Collects (req, extend_len) for one prefill batch."""

    cache: CacheManager
    token_budget: int
    kv_budget_tokens: int
    new_token_ratio: float
    enable_chunking: bool
    entries: list[tuple[Req, int]] = field(default_factory=list)
    chunked_req: Req | None = None

    def add_continuing(self, req: Req) -> AddResult:
        """The next chunk of the request chunked in an earlier batch (already matched and locked)."""
        remaining = req.fill_len - req.kv_len
        return self._add(req, remaining, first_admission=False)

    def add_new(self, req: Req) -> AddResult:
        """Match the cached prefix of a waiting request and admit as much of it as the budgets allow."""
        self.cache.match(req)
        remaining = req.fill_len - req.kv_len
        reserve = int(req.remaining_new_tokens() * self.new_token_ratio)
        if remaining + reserve > self.kv_budget_tokens or not self.cache.can_freeze(req, remaining):
            self.cache.release(req)
            return AddResult.NO_KV
        result = self._add(req, remaining, first_admission=True)
        if result in (AddResult.ADDED, AddResult.CHUNKED):
            self.kv_budget_tokens -= remaining + reserve
        return result

    def _add(self, req: Req, remaining: int, first_admission: bool) -> AddResult:
        extend_len = remaining
        if extend_len > self.token_budget:
            if not self.enable_chunking or self.token_budget <= 0:
                if first_admission:
                    self.cache.release(req)
                return AddResult.NO_TOKEN_BUDGET
            extend_len = self.token_budget
        if not self.cache.grow(req, req.kv_len + extend_len):
            if first_admission:
                self.cache.release(req)
            return AddResult.NO_KV
        self.entries.append((req, extend_len))
        self.token_budget -= extend_len
        if extend_len < remaining:
            self.chunked_req = req
            return AddResult.CHUNKED
        return AddResult.ADDED
