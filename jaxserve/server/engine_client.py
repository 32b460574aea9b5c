"""The asyncio side of the engine loop: one `RequestGroup` per HTTP request.

The engine loop calls back on its own thread; a group turns those callbacks into an asyncio queue on
the server's event loop (`call_soon_threadsafe`), so handlers simply `async for out in group`. A group
holds every sequence of one HTTP request (a batch of prompts, each with its `n` sequences), so
streaming a batch reads one queue.

A client that goes away must not keep its requests running: streamed responses abort in their
generator's `finally` (see `sse.SSEResponse`), other handlers wrap the wait in `abort_on_disconnect`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Sequence

from starlette.requests import Request

from jaxserve.engine.engine import StepOutput
from jaxserve.engine.engine_loop import EngineLoop


class RequestGroup:
    """Requests submitted for one HTTP request, with their outputs on one asyncio queue.

    Create it inside the event loop. `submit` validates synchronously (raises like
    `EngineLoop.submit`); iterate the group to receive every `StepOutput` until all sequences have
    finished; `abort()` stops the unfinished ones.
    """

    def __init__(self, engine_loop: EngineLoop):
        self._engine_loop = engine_loop
        self._event_loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self.rids: list[str] = []
        self._unfinished: set[str] = set()
        self.final: dict[str, StepOutput] = {}

    def submit(self, prompt: str | Sequence[int], sampling_params: dict | None, **kwargs: Any) -> list[str]:
        """Submit one prompt (keyword arguments as `EngineLoop.submit`); returns its rids."""
        rids = self._engine_loop.submit(prompt, sampling_params, on_output=self._on_output, **kwargs)
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
            if out.finished:
                self._unfinished.discard(out.rid)
                self.final[out.rid] = out
            yield out

    async def wait(self) -> list[StepOutput]:
        """The final output of every sequence, in submission order."""
        async for _ in self:
            pass
        return [self.final[r] for r in self.rids]

    def abort(self) -> None:
        """Abort every unfinished sequence (a no-op once all have finished)."""
        for rid in list(self._unfinished):
            self._engine_loop.abort(rid)


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, group: RequestGroup):
    """Abort `group` when the HTTP client disconnects (or the handler fails) before it finishes.

    Watches the ASGI receive channel for `http.disconnect`; the request body must be read already.
    Not for streamed responses: `SSEResponse` listens to the channel itself.
    """

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                group.abort()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        group.abort()
