"""The asyncio side of the engine loop: one `RequestGroup` per HTTP request.

The engine loop calls back on its own thread; a group turns those callbacks into an asyncio queue on
the server's event loop (`call_soon_threadsafe`), so handlers simply `async for out in group`. A group
holds every sequence of one HTTP request (a batch of prompts, each with its `n` sequences), so
streaming a batch reads one queue.

A client that goes away must not keep its requests running: streamed responses abort in their
generator's `finally` (see `sse.SSEResponse`), other handlers wrap the wait in `abort_on_disconnect`.

A request's preparation (chat template, tokenizing, the grammar check, submitting) runs off the event
loop, on the server's one preprocessing thread (`preprocess`): a long prompt or a slow JSON schema then
delays only its own request, never the streams of the others.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import logging
from typing import AsyncIterator, Callable, Iterator, TypeVar

from starlette.requests import Request

from jaxserve.engine.engine_loop import EngineLoop
from jaxserve.engine.outputs import StepOutput
from jaxserve.engine.queue_admission import QueueReservation
from jaxserve.engine.request_input import GenerateInput
from jaxserve.engine.validation.check import CheckedInput

T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclasses.dataclass
class AccessRecord:
    """Token counts of one HTTP request, for its access log line: each prompt once, every sequence's
    completion tokens; `client_gone` once the client left before a non-streamed reply was sent."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    client_gone: bool = False


_ACCESS_RECORD: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar("jaxserve_access_record", default=None)


def start_access_record() -> AccessRecord:
    """A fresh record for the current HTTP request (the access-log middleware calls it); every
    RequestGroup created while handling that request adds its tokens to it."""
    record = AccessRecord()
    _ACCESS_RECORD.set(record)
    return record


def preprocess_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The server's preprocessing thread. One, as SGLang has one tokenizer manager: the tokenizer's
    encode calls stay serialized, as they were on the event loop."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxserve-preprocess")


async def preprocess(request: Request, fn: Callable[[], T]) -> T:
    """Run `fn` on the app's preprocessing thread and return its result (its exceptions propagate)."""
    return await asyncio.get_running_loop().run_in_executor(request.app.state.preprocess_executor, fn)


class RequestGroup:
    """Requests submitted for one HTTP request, with their outputs on one asyncio queue.

    Create it inside the event loop. `submit` validates synchronously (raises like `EngineLoop.submit`;
    it may run on the preprocessing thread, before the group is iterated); iterate the group to receive
    every `StepOutput` until all sequences have finished; `abort()` stops the unfinished ones.
    `is_probe`: the server's own request (/health_generate), which `--log-requests` does not log.
    """

    def __init__(self, engine_loop: EngineLoop, is_probe: bool = False):
        self._engine_loop = engine_loop
        self._event_loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self.rids: list[str] = []
        self.base_rids: list[str] = []  # one per submitted prompt: its rid (its n sequences are `<rid>-<i>`)
        self._unfinished: set[str] = set()
        self.final: dict[str, StepOutput] = {}
        self._access = _ACCESS_RECORD.get()
        self._first_of_prompt: set[str] = set()  # one rid per submitted prompt: its prompt counts once
        self._completion_counted: dict[str, int] = {}  # rid -> its completion tokens in the access record
        self._reservation: QueueReservation | None = None
        self._log_requests = engine_loop.engine.args.log_requests and not is_probe

    @contextlib.contextmanager
    def reserved(self, num_sequences: int, field: str) -> Iterator[None]:
        """Hold queue room for the whole batch (`EngineLoop.reserve`: raises before anything is queued)
        while its prompts are submitted inside the block; the unused room is given back after it."""
        self._reservation = self._engine_loop.reserve(num_sequences, field)
        try:
            yield
        finally:
            self._engine_loop.release(self._reservation)
            self._reservation = None

    def submit(self, request: GenerateInput | CheckedInput) -> list[str]:
        """Submit one prompt (`EngineLoop.submit`; a `CheckedInput` is not checked again); returns its rids."""
        rids = self._engine_loop.submit(request, on_output=self._on_output, reservation=self._reservation)
        rid = request.request.rid if isinstance(request, CheckedInput) else request.rid
        self.base_rids.append(rid or (rids[0] if len(rids) == 1 else rids[0].rpartition("-")[0]))
        self._first_of_prompt.add(rids[0])
        self.rids += rids
        self._unfinished.update(rids)
        return rids

    def _on_output(self, out: StepOutput) -> None:  # the engine loop's thread
        if self._event_loop.is_closed():  # the server has stopped; nobody is waiting any more
            return
        self._event_loop.call_soon_threadsafe(self._queue.put_nowait, out)

    @property
    def is_finished(self) -> bool:
        return not self._unfinished

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        while self._unfinished:
            out = await self._queue.get()
            self._count_access(out)
            if out.finished:
                self._unfinished.discard(out.rid)
                self.final[out.rid] = out
                if self._log_requests:
                    _log_finished(out)
            yield out

    def _count_access(self, out: StepOutput) -> None:
        """Add `out`'s tokens to the access record as they arrive (a prompt on its first output, the
        completion tokens not counted yet), so a stream its client left logs what it was sent."""
        if self._access is None:
            return
        counted = self._completion_counted.get(out.rid)
        if counted is None and out.rid in self._first_of_prompt:
            self._access.prompt_tokens += out.meta.prompt_tokens
        self._access.completion_tokens += out.meta.completion_tokens - (counted or 0)
        self._completion_counted[out.rid] = out.meta.completion_tokens

    async def wait(self) -> list[StepOutput]:
        """The final output of every sequence, in submission order."""
        async for _ in self:
            pass
        return [self.final[r] for r in self.rids]

    def abort(self) -> None:
        """Abort every unfinished sequence (a no-op once all have finished)."""
        for rid in list(self._unfinished):
            self._engine_loop.abort(rid)


def _log_finished(out: StepOutput) -> None:
    """--log-requests: one info line per finished sequence."""
    m = out.meta
    reason = m.finish_reason.kind if m.finish_reason is not None else None
    logger.info("request finished rid=%s prompt_tokens=%d completion_tokens=%d cached_tokens=%d finish_reason=%s "
                "e2e_latency=%.3fs", out.rid, m.prompt_tokens, m.completion_tokens, m.cached_tokens, reason, m.e2e_latency)


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, group: RequestGroup):
    """Abort `group` when the HTTP client disconnects (or the handler fails) before it finishes; a
    disconnect marks the access record `client_gone` (its log line's status is then 499).

    Watches the ASGI receive channel for `http.disconnect`; the request body must be read already.
    Not for streamed responses: `SSEResponse` listens to the channel itself.
    """

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                group.abort()
                if (record := _ACCESS_RECORD.get()) is not None:
                    record.client_gone = True
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        group.abort()
