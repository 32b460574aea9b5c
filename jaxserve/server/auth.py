"""`--api-key`: every request must carry `Authorization: Bearer KEY`, except liveness probes.

A pure ASGI middleware (Starlette's BaseHTTPMiddleware would wrap streamed responses and hide the
client's disconnect from them).
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.server.errors import error_body

OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Answers 401 (OpenAI's error shape) when the bearer token is missing or wrong."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):
            body = error_body("invalid or missing API key (send 'Authorization: Bearer KEY')", 401, code="invalid_api_key")
            await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)
