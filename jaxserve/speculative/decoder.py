"""N-gram speculative decoding: which decode steps speculate, the drafts, and the acceptance counters.

A speculative step verifies, for every running request, its last token plus K draft tokens in one
forward: an extend of K + 1 query tokens over the paged pool with logits at each of them (the model
runner's `BatchEntry.num_logits`). Position j is sampled exactly as plain decoding would sample the
request's output token number len(output) + j (`acceptance`), the longest agreeing draft prefix is
kept, and the KV written for rejected drafts is rolled back (kv_len, and the pages past it).

The step itself is `Engine._launch_verify` and `engine/output_processor.py`; this module owns the proposals:
- `should_speculate`: decode-only steps of at most `--speculative-max-batch-size` requests.
  Verification multiplies the tokens of a step by up to K + 1: on a batch-1 decode, which reads every
  weight for one token, the extra tokens are nearly free; a full batch is already compute-bound.
  Within such a step, `policy.DraftPolicy` keeps a request's draft only where its measured
  acceptance pays for the measured cost of verifying it.
- `propose`: the radix tree's continuation of the request's exact prefix (another request's output
  after the same prompt) when there is one, else the longer of two n-gram matches of the request's
  suffix: `ngram_match` over its own tokens and `NgramStore.match` over recent finished requests'
  tokens (`--speculative-ngram-capacity`; the request's own match wins a tie).
- `constrain_draft`: a grammar-constrained request's draft is cut at the first token its grammar
  rejects, and its bitmask rows are the grammar's states along the draft.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
from jaxtyping import Int32

from jaxserve.cache.radix_tree import RadixCache
from jaxserve.constrained.bitmask import allocate_bitmask
from jaxserve.core.request import Req
from jaxserve.speculative.ngram import NgramMatch, ngram_match
from jaxserve.speculative.ngram_store import NgramStore
from jaxserve.speculative.policy import DraftPolicy, DraftState

ALGORITHMS = ("NGRAM",)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """`num_draft_tokens`: K per sequence and step; `max_match_len`: the longest suffix matched;
    `max_batch_size`: the largest decode batch that speculates; `adaptive`: drafts only where the
    measured costs and acceptance say they pay (`policy.DraftPolicy`); `store_capacity`: tokens of
    recent requests kept for cross-request drafts (`NgramStore`; 0: none)."""

    num_draft_tokens: int
    max_match_len: int
    max_batch_size: int
    adaptive: bool = True
    store_capacity: int = 0

    @staticmethod
    def of(algorithm: str, num_draft_tokens: int, max_match_len: int, max_batch_size: int, adaptive: bool = True,
           store_capacity: int = 0) -> "SpeculativeConfig":
        """The config of `algorithm` (`--speculative-algorithm`).

        Raises:
            ValueError: an algorithm other than those of ALGORITHMS (NGRAM).
        """
        if algorithm not in ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        return SpeculativeConfig(num_draft_tokens, max_match_len, max_batch_size, adaptive, store_capacity)


@dataclasses.dataclass
class SpeculativeStats:
    """Lifetime counters. One verification = one sequence verified in one forward."""

    num_verifications: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def accept_length(self) -> float:
        """Mean tokens emitted per sequence per verifying forward: accepted drafts + the one sampled
        token (SGLang's `spec_accept_length`); 0 before any verification."""
        if not self.num_verifications:
            return 0.0
        return (self.num_accepted_tokens + self.num_verifications) / self.num_verifications

    @property
    def accept_rate(self) -> float:
        """Accepted / proposed draft tokens (SGLang's `spec_accept_rate`); 0 before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class NgramSpeculator:
    """Draft policy of n-gram speculative decoding (see the module docstring); the engine counts."""

    def __init__(self, config: SpeculativeConfig, tree: RadixCache):
        self.config = config
        self.tree = tree
        self.policy = DraftPolicy(config.adaptive)
        self.store = NgramStore(config.store_capacity, config.max_match_len) if config.store_capacity > 0 else None
        self.store_accept_by_class: dict[int, float] = {}  # every request's DraftState shares it (policy.py)

    def observe_finished(self, req: Req) -> None:
        """A request finished: its prompt + output join the cross-request store."""
        if self.store is not None:
            self.store.feed(req.fill_ids, req.namespace)

    def flush(self) -> None:
        """Forget the cross-request store (with the radix cache's flush)."""
        if self.store is not None:
            self.store.reset()

    def should_speculate(self, reqs: Sequence[Req], is_decode_only: bool) -> bool:
        return (is_decode_only and 0 < len(reqs) <= self.config.max_batch_size
                and self.policy.can_speculate(len(reqs)))

    def observe_decode(self, num_reqs: int, seconds: float) -> None:
        """A plain decode-only step took `seconds` (wall, forward + sampling)."""
        self.policy.costs.observe_decode(num_reqs, seconds)

    def observe_verify(self, drafts: Sequence[Sequence[int]], seconds: float) -> None:
        """A verification step over `drafts` (one per request) took `seconds`."""
        self.policy.costs.observe_verify(len(drafts), sum(len(d) for d in drafts), seconds)

    def record(self, req: Req, num_draft: int, num_accepted: int) -> None:
        """`req`'s draft of `num_draft` tokens had `num_accepted` accepted."""
        self.policy.record(self._draft_state(req), num_draft, num_accepted)

    def propose_batch(
        self, reqs: Sequence[Req], max_rows: int, context_length: int, grow: Callable[[Req, int], bool]
    ) -> list[list[int]]:
        """A draft per decoding request, with KV pages for its verification (`grow(req, kv_len)`, the
        cache manager's; a request whose pages cannot grow gets no draft). A draft stops before
        max_new_tokens and the context, and all requests' tokens share the verify step's `max_rows`
        logits rows (one per verified token)."""
        rows_left = max_rows - len(reqs)
        drafts = []
        for req in reqs:
            room = min(rows_left, req.remaining_new_tokens() - 1, context_length - req.fill_len)
            draft = self.propose(req, room) if room > 0 else []
            if draft and not self.policy.wants_draft(self._draft_state(req), len(reqs), len(draft)):
                draft = []
            if draft and not grow(req, req.kv_len + 1 + len(draft)):
                draft = []
            rows_left -= len(draft)
            drafts.append(draft)
        return drafts

    def propose(self, req: Req, max_tokens: int) -> list[int]:
        """Up to min(K, max_tokens) draft tokens to follow `req.fill_ids`. Notes the draft's match
        length in the request's `DraftState` (a radix-tree continuation of the exact prefix counts as
        the longest match) for the policy."""
        k = min(self.config.num_draft_tokens, max_tokens)
        if k <= 0:
            return []
        tokens = req.fill_ids
        draft = self.tree.continuation(tokens, k, req.namespace)
        match_len, is_from_store = self.config.max_match_len, False
        if not draft:
            (draft, match_len), is_from_store = self.ngram_match(req, k)
        state = self._draft_state(req)
        state.match_len, state.is_from_store = match_len, is_from_store
        return draft[:k]

    def ngram_match(self, req: Req, k: int) -> tuple[NgramMatch, bool]:
        """The longer of the request's own n-gram match and the store's, and whether it is the store's.
        A tie goes to the request's own match (the store's drafts at ties accepted 0.8 tokens against
        4.9: D-31)."""
        own = ngram_match(req.fill_ids, k, self.config.max_match_len)
        if self.store is None or own.match_len >= self.config.max_match_len:
            return own, False
        other = self.store.match(req.fill_ids, k, req.namespace)
        if other.match_len > own.match_len:
            return other, True
        return own, False

    def _draft_state(self, req: Req) -> DraftState:
        if req.draft_state is None:
            req.draft_state = DraftState(store_accept_by_class=self.store_accept_by_class)
        return req.draft_state


def constrain_draft(grammar, draft: Sequence[int], rows: Int32[np.ndarray, "K1 W"]) -> list[int]:
    """Cut `draft` at the first token `grammar` rejects; fill `rows[j]` with the grammar's bitmask
    after draft[:j] for each kept j (rows [K + 1, W], W = ceil(vocab / 32)). The grammar is left as it
    was (the kept tokens are rolled back).

    Returns:
        The kept draft prefix.
    """
    kept: list[int] = []
    grammar.fill_bitmask(rows[0])
    for tok in draft:
        if grammar.is_terminated() or not grammar.accept_token(int(tok)):
            break
        kept.append(int(tok))
        grammar.fill_bitmask(rows[len(kept)])
    if kept:
        grammar.rollback(len(kept))
    return kept


def constrain_drafts(
    reqs: Sequence[Req], drafts: Sequence[Sequence[int]], vocab_size: int
) -> tuple[list[list[int]], Int32[np.ndarray, "R W"]]:
    """`constrain_draft` for every grammar request of a verify step. Returns the drafts (cut) and the
    step's bitmask, one row per verified position (R = sum of len(draft) + 1; all allowed for requests
    without a grammar)."""
    kept, masks = [], []
    for req, draft in zip(reqs, drafts):
        rows = allocate_bitmask(len(draft) + 1, vocab_size)
        if req.grammar is not None:
            draft = constrain_draft(req.grammar, draft, rows)
        kept.append(list(draft))
        masks.append(rows[: len(draft) + 1])
    return kept, np.concatenate(masks)
