"""Server-sent events: `data: {json}\\n\\n` per event, `data: [DONE]` last (SGLang and OpenAI's completions;
the Responses API names its events and sends no [DONE]).

`SSEResponse` always listens for the client's disconnect while it streams and closes the event
generator when it stops, whatever the ASGI server's spec version: uvicorn does not fail a `send`
to a gone client, so without the listener a stream would run (and hold KV pages) to its end. The
generator aborts its requests in a `finally` block.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse_event(payload: Any, event: str | None = None) -> str:
    """One SSE event carrying `payload` as JSON (non-ASCII kept as is), named `event` when given (the
    Responses API names each event by its type)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response over an async generator of `sse_event` strings."""

    media_type = "text/event-stream"

    def __init__(self, content, **kwargs: Any):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as task_group:

                async def run_then_cancel(func) -> None:
                    await func()
                    task_group.cancel_scope.cancel()

                task_group.start_soon(run_then_cancel, partial(self.stream_response, send))
                await run_then_cancel(partial(self.listen_for_disconnect, receive))
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
