"""The scheduler: waiting and running queues, and the choice of the next batch.

It composes small parts: the schedule policy orders the waiting queue, the PrefillAdder admits
requests under the token and KV budgets, the CacheManager owns pages and the radix tree, and the
decode path below grows every running request by one token, retracting the least advanced requests
when the pool runs out (they are re-queued with their output so far and resume exactly).

Batch choice: a prefill batch when requests wait, except that when both prefills and decodes are
pending they alternate, so a long chunked prompt never stalls running streams. With mixed chunks
(`--enable-mixed-chunk`, the CPU default) the decodes ride in the same forward as the prefill chunk.
While decodes run, a step's prefill tokens are capped by `PrefillBudget` (measured step times), so a
chunk delays the running streams' next token by a bounded factor (`--prefill-decode-itl-ratio`),
except for the few steps the stall allowance pays for (`--prefill-decode-stall-fraction`), which each
request grants when it is queued (`add`) and takes back in part when it finishes early (`finish`).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Sequence

from jaxserve.core.batch import BatchEntry
from jaxserve.core.request import Req, ReqStatus
from jaxserve.scheduler.cache_manager import CacheManager
from jaxserve.scheduler.lora_slots import LoraSlots
from jaxserve.scheduler.prefill_adder import AddResult, PrefillAdder
from jaxserve.scheduler.prefill_budget import PrefillBudget
from jaxserve.scheduler.schedule_policy import get_policy

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
# a waiting request is held back one round when a request admitted in the same round already covers
# this many of its first tokens that the cache does not have yet (SGLang's in-batch prefix caching)
STAGGER_MIN_SHARED_TOKENS = 32
PREFETCH_POLL_S = 0.005  # longest block on a storage prefetch when nothing else can run (D-41)


@dataclass
class ScheduleBatch:
    """A host-side batch: each request with the number of new tokens it runs this step.

    `num_decodes`: how many of `reqs` were running (decoding) when the batch was built; they come last,
    after the prompts it prefills. Set by the scheduler, so that the batch says what it is after
    `Scheduler.advance` has moved its completed prompts to the running queue.
    """

    reqs: list[Req]
    extend_lens: list[int]
    num_decodes: int = 0

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.extend_lens)

    @property
    def is_decode(self) -> bool:
        """Every request decodes one token (a prompt's last chunk of one token does not count: it still
        has to move to the running queue in `Scheduler.advance`)."""
        return self.is_decode_only and self.num_decodes == len(self.reqs)

    def subset(self, keep: Sequence[int]) -> ScheduleBatch:
        """The batch of the requests at indices `keep` (in order)."""
        first_decode = len(self.reqs) - self.num_decodes
        return ScheduleBatch([self.reqs[i] for i in keep], [self.extend_lens[i] for i in keep],
                             sum(1 for i in keep if i >= first_decode))

    def entries(self, with_targets: bool = False) -> list[BatchEntry]:
        out = []
        for r, n in zip(self.reqs, self.extend_lens):
            targets = r.fill_slice(r.kv_len + 1, r.kv_len + n + 1) if with_targets else None
            out.append(BatchEntry(r.fill_slice(r.kv_len, r.kv_len + n), r.kv_len, r.page_table, targets,
                                  lora_slot=r.lora_slot))
        return out


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int  # <= 0: no chunking
    enable_mixed_chunk: bool
    schedule_policy: str
    disable_radix_cache: bool
    seed: int = 0
    prefill_decode_itl_ratio: float = 0.0  # 0: no bound on the prefill tokens beside decodes
    min_prefill_budget: int = 32
    prefill_decode_stall_fraction: float = 0.0  # share of decode tokens that steps over the bound may delay
    # the model runner's extend token buckets: a capped step is filled up to its bucket, whose padding
    # rows cost the same compute as real tokens
    extend_token_buckets: tuple[int, ...] = ()


class Scheduler:
    """Queues + batch selection. The engine calls `schedule()`, runs the batch, then
    `advance(batch)` and `finish(req)` for requests that are done."""

    def __init__(self, config: SchedulerConfig, cache: CacheManager, lora: LoraSlots | None = None):
        """`lora`: the LoRA adapters' slots (None: no LoRA); a request joins a batch only where its adapter
        fits (`LoraSlots.can_admit`), and holds its slot while admitted."""
        self.config = config
        self.cache = cache
        self.lora = lora
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # decoding
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0
        self._last_was_prefill = False
        self._batch_after_admission = 0  # set by each prefill schedule, read by observe_step
        self._policy = get_policy(config.schedule_policy, not config.disable_radix_cache)
        self._rng = random.Random(config.seed)
        self.prefill_budget = PrefillBudget(
            config.prefill_decode_itl_ratio if config.chunked_prefill_size > 0 else 0.0,
            config.min_prefill_budget,
            self._token_budget(),
            config.prefill_decode_stall_fraction,
        )

    # ---- queues ---------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)
        self.cache.start_prefetch(req)
        self.prefill_budget.admit_request(req.rid, req.sampling_params.max_new_tokens)  # once: not on a retraction

    @property
    def num_running(self) -> int:
        return len(self.running) + (self.chunked_req is not None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def live_reqs(self) -> list[Req]:
        return self.running + ([self.chunked_req] if self.chunked_req else [])

    # ---- batch selection ------------------------------------------------------------------------
    def schedule(self) -> ScheduleBatch | None:
        """The next batch to run, or None when there is nothing to do."""
        self.cache.on_schedule(self.num_running)  # KV release policy: mode, copies, proactive release
        want_prefill = bool(self.waiting or self.chunked_req)
        alternate = self._last_was_prefill and self.running and not self.config.enable_mixed_chunk
        if want_prefill and not alternate:
            decodes = self._prepare_decodes() if self.config.enable_mixed_chunk else []
            batch = self._schedule_prefill(num_decodes=sum(_new_token_lens(decodes)))
            if batch is not None:
                self._last_was_prefill = True
                return ScheduleBatch(batch.reqs + decodes, batch.extend_lens + _new_token_lens(decodes), len(decodes))
            if decodes:
                self._last_was_prefill = False
                return ScheduleBatch(decodes, _new_token_lens(decodes), len(decodes))
        self._last_was_prefill = False
        if self.running:
            decodes = self._prepare_decodes()
            if decodes:
                return ScheduleBatch(decodes, _new_token_lens(decodes), len(decodes))
        if not self.has_work():
            self.prefill_budget.end_busy_period()
        elif self.waiting and not self.running and self.chunked_req is None:
            # only requests whose storage prefetch is still reading: block briefly on it instead of spinning,
            # which would keep the reader thread from the GIL
            self.cache.wait_prefetch(PREFETCH_POLL_S)
        return None

    def schedule_followup(self, reqs: list[Req]) -> ScheduleBatch | None:
        """The decode step after the one in flight, built before that step's tokens are read (the overlap
        schedule, `engine/overlap.py`): `reqs`, in order, each one position further on; call it after
        `advance` of the step in flight. None where `schedule` must run instead: requests wait, a prompt
        is part-way through chunked prefill, `reqs` are not all the running requests, or the pool cannot
        give every request its next page without retracting one."""
        if self.waiting or self.chunked_req is not None or {id(r) for r in reqs} != {id(r) for r in self.running}:
            return None
        self.cache.on_schedule(self.num_running)
        if not self.cache.can_grow(sum(self.cache.pages_needed(r, r.kv_len + 1) for r in reqs)):
            return None
        self._grow_decodes(reqs, [r.kv_len + 1 for r in reqs])
        self._last_was_prefill = False
        return ScheduleBatch(list(reqs), [1] * len(reqs), len(reqs))

    def _token_budget(self) -> int:
        cfg = self.config
        if cfg.chunked_prefill_size > 0:
            return min(cfg.max_prefill_tokens, cfg.chunked_prefill_size)
        return cfg.max_prefill_tokens

    def observe_step(self, batch: ScheduleBatch, seconds: float) -> None:
        """Record how long `batch` took (wall seconds of its forward and sampling), for the prefill budget."""
        num_decodes = batch.num_decodes
        num_tokens = sum(batch.extend_lens)
        self.prefill_budget.observe(num_decodes, num_tokens - num_decodes, seconds, self._fill_bucket(num_tokens),
                                    self._batch_after_admission)
        logger.debug("step: %d decodes, %d prefill tokens, bucket %d, %.1f ms, stall credit %.2f, %d waiting",
                     num_decodes, num_tokens - num_decodes, self._fill_bucket(num_tokens), seconds * 1e3,
                     self.prefill_budget.stall_credit, len(self.waiting))

    def _fill_bucket(self, num_tokens: int) -> int:
        """The step's token count rounded up to its extend bucket (unchanged past the largest)."""
        return next((t for t in self.config.extend_token_buckets if t >= num_tokens), num_tokens)

    def _schedule_prefill(self, num_decodes: int) -> ScheduleBatch | None:
        chunking = self.config.chunked_prefill_size > 0
        budget = self._token_budget()
        # the decode batch once the prompts now prefilling or waiting join: what the bound refers to
        self._batch_after_admission = min(self.config.max_running_requests, self.num_running + len(self.waiting))
        if self.running and not self.prefill_budget.can_stall(len(self.running)):
            cap = self.prefill_budget.budget(len(self.running), self._batch_after_admission)  # 0: measure a decode step
            buckets = self.config.extend_token_buckets
            step = (self.prefill_budget.step_tokens(num_decodes, cap, buckets, self._batch_after_admission) if buckets
                    else self._fill_bucket(num_decodes + cap))
            budget = min(budget, step if cap else num_decodes)
        reserved = sum(int(r.remaining_new_tokens() * self.new_token_ratio) for r in self.running)
        adder = PrefillAdder(
            cache=self.cache,
            token_budget=budget - num_decodes,
            kv_budget_tokens=self.cache.available_tokens() - reserved,
            new_token_ratio=self.new_token_ratio,
            enable_chunking=chunking,
        )
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            result = adder.add_continuing(req)
            if result is not AddResult.ADDED and result is not AddResult.CHUNKED:
                self.chunked_req = req  # pool full: try again after decodes free pages
                return None
        if adder.chunked_req is None:
            self._admit_waiting(adder)
        self.chunked_req = adder.chunked_req
        if not adder.entries:
            return None
        for req, _ in adder.entries:
            req.status = ReqStatus.RUNNING
        return ScheduleBatch([r for r, _ in adder.entries], [n for _, n in adder.entries])

    def _admit_waiting(self, adder: PrefillAdder) -> None:
        admitted_prompts: list[list[int]] = []
        order = self._policy(self.waiting, self.cache.peek_prefix_len, self._rng)
        active_loras = {r.lora_id for r in self.live_reqs()} | {r.lora_id for r, _ in adder.entries}
        for req in order:
            if self.num_running + len(adder.entries) >= self.config.max_running_requests:
                break
            if self._shares_uncached_prefix(req, admitted_prompts) or not self.cache.is_prefetch_ready(req):
                continue
            if self.lora is not None and not self.lora.can_admit(req.lora_id, active_loras):
                continue  # its adapter would exceed --max-loras-per-batch or finds no free slot: it waits
            first_admission = req.num_retractions == 0 and not req.output_ids
            result = adder.add_new(req)
            if result in (AddResult.NO_KV, AddResult.NO_TOKEN_BUDGET):
                break
            self.waiting.remove(req)
            if self.lora is not None:
                req.lora_slot = self.lora.assign_slot(req.lora_id)
                active_loras.add(req.lora_id)
            if first_admission:
                req.cached_tokens = req.kv_len
                req.cached_tokens_details = req.match_tiers
            admitted_prompts.append(req.fill_ids)
            if result is AddResult.CHUNKED:
                break

    def _shares_uncached_prefix(self, req: Req, admitted: list[list[int]]) -> bool:
        if self.config.disable_radix_cache or not admitted:
            return False
        cached = self.cache.peek_prefix_len(req)
        ids = req.fill_ids
        for other in admitted:
            n = _common_prefix_len(ids, other)
            if n - cached >= STAGGER_MIN_SHARED_TOKENS:
                return True
        return False

    def _prepare_decodes(self) -> list[Req]:
        """Give every running request pages for its next token(s), retracting requests if the pool is full.

        A request usually runs one token; after a grammar jump-forward it runs the forced tokens too.
        Such requests wait a step when their tokens would overflow the extend budget.
        """
        reqs, budget = [], self._token_budget()
        for r in self.running:
            n = r.fill_len - r.kv_len
            if n == 1 or n <= budget - len(self.running):
                reqs.append(r)
                budget -= n - 1
        need = sum(self.cache.pages_needed(r, r.fill_len) for r in reqs)
        while not self.cache.can_grow(need) and (len(reqs) > 1 or self.chunked_req is not None):
            if self.chunked_req is not None:
                # a prompt part-way through chunked prefill holds pages too, and has no output to lose:
                # it goes first (its computed prefix stays cached). Kept, it could leave a lone decode
                # unable to grow (n > 1 with a prompt near the pool's size).
                self.retract(self.chunked_req)
            else:
                victim = min(reqs, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
                reqs.remove(victim)
                self.retract(victim)
            need = sum(self.cache.pages_needed(r, r.fill_len) for r in reqs)
        self._grow_decodes(reqs, [r.fill_len for r in reqs])
        return reqs

    def _grow_decodes(self, reqs: list[Req], new_kv_lens: list[int]) -> None:
        """Give each decoding request pages up to its new KV length (`can_grow` said they fit) and decay
        the new-token ratio, once per decode round (SGLang's `new_token_ratio`).

        Raises:
            RuntimeError: a request's pages cannot grow after all (the pool cannot hold one decode).
        """
        for r, n in zip(reqs, new_kv_lens):
            if not self.cache.grow(r, n):
                raise RuntimeError("KV pool cannot hold a single decoding request; raise --max-total-tokens")
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)

    def retract(self, req: Req) -> None:
        """Move a running (or part-way prefilled) request back to the waiting queue; its computed
        prefix stays in the cache."""
        if req is self.chunked_req:
            self.chunked_req = None
        else:
            self.running.remove(req)
        self.cache.release(req)
        self._leave_lora_slot(req)
        req.num_retractions += 1
        self.num_retractions += 1
        self.add(req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.3)
        logger.info("retracted request %s (%d output tokens) to free KV pages", req.rid, len(req.output_ids))

    # ---- after the forward ----------------------------------------------------------------------
    def advance(self, batch: ScheduleBatch) -> list[bool]:
        """Account the KV written by `batch`. Returns, per request, whether its sampled token is real
        (its prompt is complete); a request mid-way through a chunked prompt discards it."""
        produced = []
        for req, n in zip(batch.reqs, batch.extend_lens):
            was_prefilling = req not in self.running
            req.kv_len += n
            complete = req.kv_len == req.fill_len
            if was_prefilling:
                self.cache.cache_prefix(req)
                if complete:
                    self.running.append(req)
            produced.append(complete)
        return produced

    def finish(self, req: Req) -> None:
        """Release a finished (or aborted) request from wherever it is."""
        if req in self.running:
            self.running.remove(req)
            self.cache.release(req)
            self._leave_lora_slot(req)
        elif req is self.chunked_req:
            self.chunked_req = None
            self.cache.release(req)
            self._leave_lora_slot(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self.cache.cancel_prefetch(req)
        self.prefill_budget.finish_request(req.rid, len(req.output_ids))
        if self.lora is not None and req.lora_id is not None:
            self.lora.release(req.lora_id)
        req.status = ReqStatus.FINISHED

    def _leave_lora_slot(self, req: Req) -> None:
        if self.lora is not None:
            self.lora.leave_slot(req.lora_slot)
            req.lora_slot = 0


def _new_token_lens(reqs: list[Req]) -> list[int]:
    return [r.fill_len - r.kv_len for r in reqs]


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
