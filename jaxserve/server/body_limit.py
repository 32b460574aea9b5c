"""`--max-request-body-bytes`: a request body over the bound is a 413 (OpenAI's error shape, no
`param`), refused before it is read whole or parsed. A Content-Length over the bound is answered at once;
a body without one (chunked) is counted as it arrives, and the read that passes the bound raises the
413 in the route that reads it (`request.body()`), so no more than the bound is ever held.

A pure ASGI middleware (Starlette's BaseHTTPMiddleware would wrap streamed responses and hide the
client's disconnect from them).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.server.errors import APIError, error_response

CODE = "request_too_large"


def too_large(limit: int, size: int | None = None) -> APIError:
    """The 413 of a body over `limit` bytes (`size`: its Content-Length, when it gave one)."""
    got = f" (Content-Length {size})" if size is not None else ""
    return APIError(f"the request body is over {limit} bytes{got}; the server's --max-request-body-bytes bounds it",
                    413, code=CODE)


class BodySizeLimitMiddleware:
    """Answers 413 to a request whose body is over `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

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
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise too_large(self.max_bytes)
            return message

        await self.app(scope, counted, send)
