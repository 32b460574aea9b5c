"""Grammar compilation off the engine thread, and the queue of requests waiting for their grammar.

Compiling a large JSON schema takes 0.1-1 s (llguidance builds its lexer and parser), far longer than a
decode step, so the engine never compiles: `GrammarCompiler.submit` hands the spec to a small thread pool
and returns a Future, and the engine parks the request in a `GrammarQueue` until the Future is done
(SGLang's grammar queue, `scheduler.grammar_queue`). Cache hits resolve at once, without touching the
pool, so a slow schema never holds back a grammar that is already compiled. llguidance drops the GIL
while it compiles, so the engine loop keeps running meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from jaxserve.constrained.backend import CompiledGrammar, GrammarBackend, GrammarSpec

T = TypeVar("T")


class GrammarCompiler:
    """Compiles grammars on `num_workers` background threads; one Future per spec.

    Args:
        backend: the grammar backend (its `compile` must be thread-safe).
        num_workers: compile threads; 2 lets a second grammar compile while a slow one runs.

    A spec already being compiled gets the same Future (concurrent requests with one schema compile it
    once). Futures raise `InvalidGrammarError` from `result()` for an invalid grammar.
    """

    def __init__(self, backend: GrammarBackend, num_workers: int = 2) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.backend = backend
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="grammar-compile")
        self._in_flight: dict[GrammarSpec, Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()

    @property
    def num_pending(self) -> int:
        """Compilations submitted and not finished (distinct specs)."""
        with self._lock:
            return len(self._in_flight)

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """A Future of the compiled grammar; already done if the backend has it cached.

        Raises:
            RuntimeError: after `shutdown`.
        """
        cached = self.backend.lookup(spec)
        if cached is not None:
            done: Future[CompiledGrammar] = Future()
            done.set_result(cached)
            return done
        with self._lock:
            future = self._in_flight.get(spec)
            if future is not None:
                return future
            future = self._pool.submit(self.backend.compile, spec)
            self._in_flight[spec] = future
        # Outside the lock: a future that is already done runs the callback here, and it takes the lock.
        future.add_done_callback(lambda f: self._forget(spec, f))
        return future

    def _forget(self, spec: GrammarSpec, future: Future[CompiledGrammar]) -> None:
        with self._lock:
            if self._in_flight.get(spec) is future:
                del self._in_flight[spec]

    def shutdown(self, wait: bool = True) -> None:
        """Stop the threads; compilations not started are cancelled."""
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> GrammarCompiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(wait=False)


@dataclass(frozen=True)
class GrammarReady(Generic[T]):
    """An item whose grammar finished compiling: exactly one of `compiled` and `error` is set.

    `error` is the compile error (`InvalidGrammarError`: finish the request with an error naming it) or a
    `TimeoutError` when compilation exceeded the queue's timeout.
    """

    item: T
    compiled: CompiledGrammar | None
    error: BaseException | None


@dataclass
class _Waiting(Generic[T]):
    item: T
    future: Future[CompiledGrammar]
    enqueued_at: float


class GrammarQueue(Generic[T]):
    """Items (the engine's requests; opaque here) waiting for their grammar, in arrival order.

    Use from one thread (the engine loop): `add` when a request with a grammar arrives, `pop_ready` each
    step to move the ready ones on to the scheduler's waiting queue.

    Args:
        compiler: where grammars are compiled.
        timeout_s: seconds an item may wait before `pop_ready` returns it with a TimeoutError; None = forever.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        compiler: GrammarCompiler,
        *,
        timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.compiler = compiler
        self.timeout_s = timeout_s
        self._clock = clock
        self._waiting: list[_Waiting[T]] = []

    @property
    def num_pending(self) -> int:
        """Items waiting for their grammar (the grammar-queue length metric)."""
        return len(self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, item: T, spec: GrammarSpec) -> None:
        self._waiting.append(_Waiting(item, self.compiler.submit(spec), self._clock()))

    def pop_ready(self) -> list[GrammarReady[T]]:
        """Remove and return the items whose grammar is done (or timed out), in arrival order; never blocks."""
        now = self._clock()
        ready: list[GrammarReady[T]] = []
        still_waiting: list[_Waiting[T]] = []
        for waiting in self._waiting:
            if waiting.future.cancelled():  # the compiler was shut down
                ready.append(GrammarReady(waiting.item, None, RuntimeError("grammar compilation was cancelled")))
            elif waiting.future.done():
                error = waiting.future.exception()
                compiled = None if error is not None else waiting.future.result()
                ready.append(GrammarReady(waiting.item, compiled, error))
            elif self.timeout_s is not None and now - waiting.enqueued_at > self.timeout_s:
                timeout = TimeoutError(f"grammar compilation took longer than {self.timeout_s:g} s")
                ready.append(GrammarReady(waiting.item, None, timeout))
            else:
                still_waiting.append(waiting)
        self._waiting = still_waiting
        return ready

    def remove(self, item: T) -> bool:
        """Drop `item` (an aborted request); True if it was waiting. The compilation itself runs on and
        still fills the cache."""
        for i, waiting in enumerate(self._waiting):
            if waiting.item is item:
                del self._waiting[i]
                return True
        return False
