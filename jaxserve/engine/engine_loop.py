"""EngineLoop: runs `Engine.step()` in one background thread and lets other threads submit requests.

    loop = EngineLoop(engine); loop.start()
    rids = loop.submit(GenerateInput("Hello", {"max_new_tokens": 8}), on_output=print)   # checked here, now
    loop.abort(rids[0]); loop.flush_cache().result(); loop.shutdown()

Threads: the engine (scheduler, cache, tree, model runner) is touched only by the loop thread. Callers
talk to it through an inbox of commands guarded by one condition variable; the loop drains the inbox,
runs a step, and hands every `StepOutput` to the callback registered for its rid, on the loop thread.
The callback must be quick and must not block (the server's wraps `loop.call_soon_threadsafe`). JAX
releases the GIL while a step runs, so the HTTP event loop keeps serving meanwhile. With no work the
thread sleeps on the condition; while requests only wait for their grammar (compiled off-thread) it
polls every few milliseconds; it never spins.

Going idle: after the step that finishes the last request the loop runs one more `Engine.step()`, whose
schedule is empty, before it sleeps or reads the inbox again: the release policy's per-iteration pass
(soft release of the prefixes just unlocked) and the prefill budget's end of a busy period
(`Scheduler.schedule`) then happen when the engine goes idle, not inside the next request's first
schedule. The load snapshot published then carries fresh radix-cache stats (they are otherwise
refreshed at most once a second), so /metrics read while idle is not a snapshot from up to a second
before the last step.

Validation (`RequestChecker.check`, engine/validation/check.py: sampling values, tokenization, prompt
length, adapter, grammar compilation) runs once, synchronously in the caller's thread, through the engine's
read-only, thread-safe checker, so a bad request raises at `submit` and never reaches the loop, which
queues the checked request as it is; `submit` also makes its rid unique among the pending ones.

Engine death: a step that raises (a bug, an XLA error, out of memory) ends the loop for good. Every
pending request (running, queued or still in the inbox) gets at once an abort finish reason carrying
`status_code` 500 and the error (SGLang's FINISH_ABORT shape), the traceback is logged once, `error`
says what happened, `is_running` turns False (the server's /health answers 503) and every death
observer is called (the server exits non-zero, so a supervisor restarts it). `submit` then raises
`EngineUnavailableError`.

Admission: at most `max_queued_requests` sequences wait (submitted, and not running once the next
schedule has filled the free running slots); one more raises `EngineUnavailableError` (the server's 503 with Retry-After), as SGLang's scheduler aborts a request
beyond `--max-queued-requests`. With `queue_timeout_s`, a request still in the scheduler's waiting
queue that long without a first output ends with an abort carrying `status_code` 503. A batch is
admitted whole or not at all (`reserve`, queue_admission.py); one larger than the bound is a `RequestError`.

Test hook (not a user flag): when the environment variable `JAXSERVE_TEST_FAULT_FILE` names a path,
every step with requests first checks whether that file exists and, if it does, raises `InjectedFault`.
The engine death tests create the file while requests are in flight.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

from jaxserve.cache.release_policy import RadixCacheStats
from jaxserve.core.errors import RequestError
from jaxserve.core.request import finish_abort, new_rid
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.engine import Engine
from jaxserve.engine.engine_load import EngineLoad, snapshot_load
from jaxserve.engine.outputs import RequestMeta, StepOutput
from jaxserve.engine.queue_admission import QueueAdmission, QueueReservation, default_max_queued_requests
from jaxserve.engine.request_input import GenerateInput
from jaxserve.engine.validation.check import CheckedInput
from jaxserve.parallel.distributed import RankLostError

logger = logging.getLogger(__name__)

OutputCallback = Callable[[StepOutput], None]
# Seconds between steps while the engine has work but runs nothing (requests wait for their grammar,
# compiled off-thread): a short poll instead of a spin.
NO_PROGRESS_POLL_S = 0.005
FAULT_FILE_ENV = "JAXSERVE_TEST_FAULT_FILE"


class EngineUnavailableError(RuntimeError):
    """The engine cannot take the request now: its queue is full, it is draining, or it died.

    `retry_after_s` is a hint for the client's Retry-After (None when retrying cannot help: a dead
    engine).
    """

    def __init__(self, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InjectedFault(RuntimeError):
    """Raised by the test-only fault hook (see the module docstring)."""


class _StepResult(enum.Enum):
    PROGRESS = "progress"
    NO_PROGRESS = "no_progress"  # the engine has work but ran nothing (waiting for a grammar compile)


@dataclasses.dataclass
class _Pending:
    on_output: OutputCallback
    prompt_tokens: int
    last: StepOutput | None = None
    submit_time: float = dataclasses.field(default_factory=time.monotonic)


class EngineLoop:
    """The engine's background thread (see the module docstring).

    Args:
        engine: a constructed `Engine`; from `start()` on only the loop thread may change it.
        max_queued_requests: most sequences waiting at once (None: `default_max_queued_requests`
            of the pool).
        queue_timeout_s: seconds a request may wait in the scheduler's queue (None: no limit).
    """

    def __init__(self, engine: Engine, *, max_queued_requests: int | None = None, queue_timeout_s: float | None = None):
        self.engine = engine
        self.max_queued_requests = max_queued_requests or default_max_queued_requests(engine.limits.pool_tokens)
        self.queue_timeout_s = queue_timeout_s
        self._fault_file = os.environ.get(FAULT_FILE_ENV) or None
        self._error: str | None = None
        self._death_observers: list[Callable[[str], None]] = []
        self._admission = QueueAdmission(self.max_queued_requests, engine.scheduler.config.max_running_requests)
        self._num_queue_timeouts = 0
        self._cond = threading.Condition()
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._pending: dict[str, _Pending] = {}  # rid -> its callback; guarded by _cond
        self._groups: dict[str, set[str]] = {}  # base rid of an n > 1 request -> its unfinished rids
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._load = EngineLoad()
        self._num_step_failures = 0
        self._last_step_time: float | None = None
        self._observers: list[OutputCallback] = []
        self._radix_stats: RadixCacheStats | None = None
        self._radix_stats_time = float("-inf")

    # The server reads what the engine fixed at start-up (tokenizer, `limits`, `args`, devices, ...) from
    # `engine` directly: it does not change after construction. LoRA's registry is thread-safe, so its
    # Engine methods run in the caller's thread too.

    def add_output_observer(self, observer: OutputCallback) -> None:
        """Also hand every delivered `StepOutput` to `observer` (on the loop thread; metrics use it),
        from the next output on."""
        self._observers.append(observer)

    def add_death_observer(self, observer: Callable[[str], None]) -> None:
        """Call `observer(error message)` once, on the loop thread, if the engine dies (after every
        pending request has been failed)."""
        self._death_observers.append(observer)

    @property
    def error(self) -> str | None:
        """Why the engine died ("RuntimeError: ..."), or None while it is alive."""
        return self._error

    def load(self) -> EngineLoad:
        """The latest snapshot of the engine's queues and KV pool; the admission counters and the
        waiting count are current (requests are admitted and refused in callers' threads, between
        snapshots, and a long step would otherwise show a full queue as empty to a router)."""
        load = self._load
        with self._cond:  # held only briefly by the loop thread, never across a step
            waiting = max(load.num_waiting_reqs, self._num_not_running() + self._admission.num_reserved)
        if load.num_rejected_queue_full != self._admission.num_rejected or waiting != load.num_waiting_reqs:
            load = dataclasses.replace(load, num_rejected_queue_full=self._admission.num_rejected, num_waiting_reqs=waiting)
        return load

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        if self._thread is None:
            self._publish_load()
            self._thread = threading.Thread(target=self._run, name="jaxserve-engine-loop", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float | None = 30.0, reason: str = "the server is shutting down", status_code: int | None = 503) -> None:
        """Stop the thread after its current step; pending requests finish with an abort finish
        reason whose message is `reason` (and `status_code` when not None: the HTTP status of a
        non-streamed answer)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._fail_all(reason, status_code=status_code)
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()  # the storage tier's queued writes reach the disk

    def die(self, e: BaseException) -> None:
        """End the engine from another thread as a step that raised `e` would (a lost rank of a
        multi-host server, which may leave the loop thread blocked or idle): fail every pending
        request with a 500, call the death observers; the thread stops at its next wake."""
        with self._cond:
            if self._error is not None:
                return
            self._stopping = True
            self._cond.notify()
        self._die(e)

    @property
    def is_running(self) -> bool:
        """True while the loop thread serves: started, not shut down, not dead."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self._error is None

    @property
    def num_pending(self) -> int:
        """Sequences submitted and not finished (thread-safe, exact)."""
        with self._cond:
            return len(self._pending)

    # ---- requests (any thread) ------------------------------------------------------------------
    def submit(
        self,
        request: GenerateInput | CheckedInput | str | Sequence[int],
        sampling_params: SamplingParams | dict | None = None,
        *,
        on_output: OutputCallback,
        reservation: QueueReservation | None = None,
        **fields: Any,
    ) -> list[str]:
        """Check a request now and queue it; returns the rids of its `n` sequences.

        `request`: a `GenerateInput`, or its prompt with the sampling params and other fields by name
        (`GenerateInput.of`). It is checked once, here (`RequestChecker.check`), unless it is a
        `CheckedInput` already (a batch checks every prompt before it submits any); the loop thread queues
        the checked request as it is. `on_output` is called on the loop thread with every `StepOutput` of
        those rids; the last one has `finished=True`. With `reservation` (from `reserve`) its sequences
        take the batch's held room instead of being checked against the queue again.

        Raises:
            SamplingParamsError: an invalid sampling parameter (names it).
            RequestError: empty or too long prompt, bad token ids, a rid in use, bad top_logprobs_num or
                logprob_start_len, an invalid regex / json_schema / ebnf (its field; compiled here, in the caller's thread).
            EngineUnavailableError: the waiting queue is full, or the engine died.
            RuntimeError: the loop is shut down.
        """
        if isinstance(request, CheckedInput):
            if sampling_params is not None or fields:
                raise TypeError("give a CheckedInput alone")
            checked = request
        else:
            checked = self.engine.checker.check(GenerateInput.of(request, sampling_params, **fields))
        input_ids, params = checked.input_ids, checked.params
        base = checked.request.rid or new_rid()
        if base != checked.request.rid:  # no rid, or "" (SGLang's client sends none): the engine gets this one
            checked = dataclasses.replace(checked, request=dataclasses.replace(checked.request, rid=base))
        rids = [base] if params.n == 1 else [f"{base}-{i}" for i in range(params.n)]

        def add() -> None:
            try:
                got = self.engine.add_request(checked)
                assert got == rids, (got, rids)
            except RequestError as e:  # true when checked, not now (its LoRA adapter was unloaded since)
                self._fail(rids, str(e), status_code=400)
            except Exception as e:  # checked already: this is an engine bug, fail only this request
                logger.exception("engine.add_request failed for %s", base)
                self._fail(rids, f"the engine refused the request: {e}", status_code=500)

        with self._cond:
            if self._error is not None:
                raise EngineUnavailableError(f"the engine has stopped after an error: {self._error}")
            if self._stopping:
                raise RuntimeError("the engine loop is shut down")
            taken = [r for r in [base, *rids] if r in self._pending or r in self._groups]
            if taken:
                raise RequestError("rid", f"request id {taken[0]!r} is already in use")
            if not self._admission.take(self._num_not_running(), len(rids), reservation, self._load.num_free_slots):
                raise self._queue_full()
            for r in rids:
                self._pending[r] = _Pending(on_output, len(input_ids))
            if params.n > 1:
                self._groups[base] = set(rids)
            self._inbox.append(add)
            self._cond.notify()
        return rids

    def reserve(self, num_sequences: int, field: str = "prompt") -> QueueReservation:
        """Hold room in the waiting queue for a whole batch of `num_sequences` (prompts x n) before any
        of it is submitted; pass the result to each `submit`, then `release` it (also on failure).

        Raises:
            RequestError: `field` (the batch's prompt field): the batch alone is larger than the
                running slots plus `max_queued_requests`, so retrying cannot help.
            EngineUnavailableError: the queue has no room for the batch now (retry later).
        """
        if not self._admission.can_ever_fit(num_sequences):
            raise RequestError(
                field, f"the batch has {num_sequences} sequences (prompts x n), more than --max-running-requests "
                f"{self._admission.max_running_requests} plus --max-queued-requests {self.max_queued_requests} "
                "can ever hold; split it",
            )
        with self._cond:
            reservation = self._admission.reserve(self._num_not_running(), num_sequences, self._load.num_free_slots)
            if reservation is None:
                raise self._queue_full(num_sequences)
        return reservation

    def release(self, reservation: QueueReservation) -> None:
        """Give back the room of `reservation` that no `submit` used."""
        with self._cond:
            self._admission.release(reservation)

    def _num_not_running(self) -> int:
        """Sequences submitted and not running (holding `_cond`)."""
        return len(self._pending) - self._load.num_running_reqs

    def _queue_full(self, num_sequences: int = 1) -> EngineUnavailableError:
        waiting = self._admission.num_waiting_after(self._num_not_running(), self._load.num_free_slots)
        if num_sequences == 1 or waiting >= self.max_queued_requests:
            what = f"the request queue is full ({waiting} waiting"
        else:  # a batch: the queue has places, only not as many as the batch
            what = (f"the request queue has {self.max_queued_requests - waiting} free places and the batch needs "
                    f"{num_sequences} ({waiting} waiting")
        return EngineUnavailableError(
            f"{what}, --max-queued-requests {self.max_queued_requests}); retry later", retry_after_s=1)

    def abort(self, rid: str) -> bool:
        """Abort a request (or every sequence of an n > 1 request by its base rid). Thread-safe.

        Its callback then receives a last output with finish reason of kind "abort".
        Returns False when the rid is unknown or already finished.
        """
        with self._cond:
            targets = [r for r in self._groups.get(rid, [rid]) if r in self._pending]
            if not targets:
                return False
            self._inbox.append(lambda: self._abort_in_loop(targets))
            self._cond.notify()
        return True

    def abort_all(self, message: str) -> concurrent.futures.Future:
        """Abort every pending request; each ends with an abort finish reason whose message is
        `message` (no status code: a normal, cut-short answer). The future is done once all have
        been told. Used by the graceful shutdown when its drain time is up."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            with self._cond:
                rids = list(self._pending)
            for r in rids:
                self.engine.abort(r)
            self._fail(rids, message, status_code=None)
            future.set_result(len(rids))

        with self._cond:
            if self._stopping or self._error is not None:
                future.set_result(0)
                return future
            self._inbox.append(run)
            self._cond.notify()
        return future

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the loop thread between steps; the future holds its result or error."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)

        with self._cond:
            if self._stopping or self._error is not None:
                raise RuntimeError("the engine loop is shut down" if self._error is None else f"the engine has stopped: {self._error}")
            self._inbox.append(run)
            self._cond.notify()
        return future

    def flush_cache(self) -> concurrent.futures.Future:
        """Empty the prefix cache on the loop thread. The future raises RuntimeError (with the reason)
        when requests are queued or running."""
        return self.call(lambda engine: engine.flush_cache())

    # ---- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - the thread is dying: say so, fail everyone
            if self._error is None:  # not already ended by `die` from another thread
                self._die(e)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._stopping and not self.engine.has_unfinished():
                    self._cond.wait()
                if self._stopping:
                    return
                commands = list(self._inbox)
                self._inbox.clear()
            for command in commands:
                try:
                    command()
                except Exception:  # an abort or add that hit an engine bug: keep serving the others
                    logger.exception("engine loop command failed")
            if self.queue_timeout_s is not None:
                self._end_timed_out_waits()
            busy = self.engine.has_unfinished()
            result = self._step() if busy else _StepResult.PROGRESS
            idle = not self.engine.has_unfinished()
            if busy and idle:
                self._step()  # going idle: an empty schedule (see the module docstring)
            try:
                self._publish_load(fresh_radix_stats=idle)
            except Exception:
                logger.exception("could not snapshot the engine's load")
            if result is _StepResult.NO_PROGRESS:
                with self._cond:  # e.g. only grammars compiling: poll, but wake at once for new commands
                    if not self._inbox and not self._stopping:
                        self._cond.wait(NO_PROGRESS_POLL_S)

    def _step(self) -> "_StepResult":
        """Run one engine step and deliver its outputs (an exception propagates: the engine died)."""
        num_steps = self.engine.stats.num_steps
        # only a step with requests: the empty step after going idle races a test's next request
        if self._fault_file is not None and self.engine.has_unfinished() and os.path.exists(self._fault_file):
            raise InjectedFault(f"fault injected through {FAULT_FILE_ENV}")
        outputs = self.engine.step()
        if outputs:
            self._last_step_time = time.time()
        for out in outputs:
            self._deliver(out)
        progress = outputs or self.engine.stats.num_steps != num_steps or self.engine.step_in_flight
        return _StepResult.PROGRESS if progress else _StepResult.NO_PROGRESS

    def _die(self, e: BaseException) -> None:
        """The loop thread ends: fail every pending request with a 500 naming `e`, then tell the observers."""
        self._num_step_failures += 1
        message = f"{type(e).__name__}: {e}"
        # a lost rank is no bug of this process: its message names the rank, a traceback adds nothing
        logger.error("the engine died (%s); failing every pending request", message,
                     exc_info=None if isinstance(e, RankLostError) else e)
        with self._cond:
            self._error = message
            self._inbox.clear()  # queued adds never reach the engine; their rids are pending and failed below
        self._fail_all(f"engine error: {message}", status_code=500)
        try:
            self._publish_load()
        except Exception:  # the engine's state may be what broke; the counters above are what matters
            self._load = dataclasses.replace(self._load, num_step_failures=self._num_step_failures, num_pending_reqs=0)
        for observer in self._death_observers:
            try:
                observer(message)
            except Exception:
                logger.exception("engine death observer failed")

    def _end_timed_out_waits(self) -> None:
        """End (503) every request that has waited in the scheduler's queue over `queue_timeout_s`
        without a first output."""
        now = time.monotonic()
        expired = []
        with self._cond:
            for req in self.engine.scheduler.waiting:
                pending = self._pending.get(req.rid)
                if pending is not None and pending.last is None and now - pending.submit_time > self.queue_timeout_s:
                    expired.append(req.rid)
        for rid in expired:
            self.engine.abort(rid)
        if expired:
            self._num_queue_timeouts += len(expired)
            self._fail(expired, f"the request waited over --queue-timeout {self.queue_timeout_s:g} s in the queue", status_code=503)

    def _deliver(self, out: StepOutput) -> None:
        for observer in self._observers:
            try:
                observer(out)
            except Exception:
                logger.exception("output observer failed")
        with self._cond:
            pending = self._pending.get(out.rid)
            if pending is None:
                return  # aborted after a failure: its callback already got its last output
            pending.last = out
            if out.finished:
                self._forget(out.rid)
        try:
            pending.on_output(out)
        except Exception:
            logger.exception("output callback of %s failed; aborting it", out.rid)
            if not out.finished:
                self._abort_in_loop([out.rid])

    def _abort_in_loop(self, rids: list[str]) -> None:
        for r in rids:
            if not self.engine.abort(r):
                # not in the engine (never added, or already finished): answer the callback directly
                self._fail([r], "aborted by the client", status_code=None)

    def _fail_all(self, message: str, status_code: int | None) -> None:
        with self._cond:
            rids = list(self._pending)
        self._fail(rids, message, status_code)

    def _fail(self, rids: list[str], message: str, status_code: int | None) -> None:
        """Give each rid's callback a last, aborted output (built from the last output it had)."""
        reason = finish_abort(message, status_code)
        for r in rids:
            with self._cond:
                pending = self._pending.get(r)
                if pending is None:
                    continue
                self._forget(r)
            last = pending.last
            if last is not None:
                meta = dataclasses.replace(last.meta, finish_reason=reason)
                out = StepOutput(r, [], last.output_ids, last.text, "", True, meta)
            else:
                meta = RequestMeta(r, pending.prompt_tokens, 0, 0, reason, 0.0)
                out = StepOutput(r, [], [], "", "", True, meta)
            try:
                pending.on_output(out)
            except Exception:
                logger.exception("output callback of %s failed", r)

    def _forget(self, rid: str) -> None:
        """Drop a finished rid (caller holds the lock); a group goes when its last sequence does."""
        del self._pending[rid]
        base, _, index = rid.rpartition("-")
        group = self._groups.get(base)
        if group is not None and rid in group:  # O(1): an n = 10^4 request must not cost n^2 to end
            group.discard(rid)
            if not group:
                del self._groups[base]

    def _publish_load(self, fresh_radix_stats: bool = False) -> None:
        with self._cond:
            num_pending = len(self._pending)
        self._load = snapshot_load(
            self.engine, num_pending_reqs=num_pending, num_step_failures=self._num_step_failures,
            last_step_time=self._last_step_time, num_rejected_queue_full=self._admission.num_rejected,
            num_queue_timeouts=self._num_queue_timeouts, radix_cache=self._radix_cache_stats(fresh_radix_stats))

    def _radix_cache_stats(self, fresh: bool) -> RadixCacheStats | None:
        """The tree walk costs O(nodes), so while busy it runs here on the loop thread at most once a
        second; `fresh` (the engine is idle) refreshes it now."""
        now = time.monotonic()
        if fresh or now - self._radix_stats_time >= 1.0:
            self._radix_stats = self.engine.radix_cache_stats()
            self._radix_stats_time = now
        return self._radix_stats
