"""`--max-request-body-bytes`: a request body over the bound is a 413 (OpenAI's error shape, no
`param`), refused before it is read whole or parsed. A Content-Length over the bound is answered at once;
a body without one (chunked) is counted as it arrives, and the read that passes the bound raises the
413 in the route that reads it (`request.body()`), so no more than the bound is ever held.

A body that stops arriving is a 408 after `BODY_IDLE_TIMEOUT_S` without a byte (a client that sent a
Content-Length and less body held its connection and handler for as long as it liked).

A pure ASGI middleware (Starlette's BaseHTTPMiddleware would wrap streamed responses and hide the
client's disconnect from them).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.server.errors import APIError, error_response

CODE = "request_too_large"
# Seconds a request body may go without a byte before it is a 408 (between chunks; after the last one,
# reads wait as long as they like: a streamed response waits on them for the client's disconnect).
BODY_IDLE_TIMEOUT_S = 60.0


def too_large(limit: int, size: int | None = None) -> APIError:
    """The 413 of a body over `limit` bytes (`size`: its Content-Length, when it gave one)."""
    got = f" (Content-Length {size})" if size is not None else ""
    return APIError(f"the request body is over {limit} bytes{got}; the server's --max-request-body-bytes bounds it",
                    413, code=CODE)


def body_timed_out(idle_s: float) -> APIError:
    """The 408 of a body that went `idle_s` seconds without a byte."""
    return APIError(f"the request body stopped arriving: nothing for {idle_s:g} s", 408, code="request_timeout")


class BodySizeLimitMiddleware:
    """Answers 413 to a request whose body is over `max_bytes`, and 408 to one that stops arriving for
    `idle_timeout_s` seconds."""

    def __init__(self, app: ASGIApp, max_bytes: int, idle_timeout_s: float = BODY_IDLE_TIMEOUT_S):
        self.app = app
        self.max_bytes = max_bytes
        self.idle_timeout_s = idle_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
            err = too_large(self.max_bytes, int(length))
            response = error_response(err.message, err.status_code, code=err.code)
            response.headers["Connection"] = "close"  # the body is left unread on the connection
            await response(scope, receive, send)
            return
        received, body_done = 0, False

        async def counted() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.idle_timeout_s)
            except asyncio.TimeoutError:
                raise body_timed_out(self.idle_timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        await self.app(scope, counted, send)
